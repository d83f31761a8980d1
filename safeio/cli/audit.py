"""``safeio audit report DIR``: merge the audit sanitizer's per-process records into one report."""

from __future__ import annotations

import argparse
from typing import Any

from safeio.cli._common import EXIT_OK, EXIT_PROBLEMS, CliError, existing_directory, print_json


def add_parser(commands: Any, epilog: str) -> None:
    parser = commands.add_parser(
        "audit",
        help="reports of the audit sanitizer (safeio.audit / SAFEIO_AUDIT)",
        description="Work with the records the audit sanitizer writes while a job runs.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="audit_command", metavar="ACTION")
    sub.required = True
    report = sub.add_parser(
        "report",
        help="merge the records in DIR and list unsafe writes and conflicts",
        description="Merge the per-process audit records in DIR into one report: unsafe in-place writes "
        "to shared paths and conflicts (several processes writing one path). Exit 1 when there are "
        "conflicts.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument("record_dir", metavar="DIR", help="the directory the sanitizer wrote its records to")
    report.add_argument("--json", action="store_true", help="print a machine-readable report")
    report.set_defaults(run=run_report)


def run_report(args: argparse.Namespace) -> int:
    record_dir = existing_directory(args.record_dir, what="DIR")
    try:
        # Imported here: the sanitizer is machinery the other commands never need.
        from safeio.shares import format_audit_report, merge_audit_records
    except ImportError as exc:
        raise CliError(f"the audit sanitizer is not available in this installation ({exc})") from None
    report = merge_audit_records(record_dir)
    if args.json:
        print_json(report.to_dict())
    else:
        print(format_audit_report(report))
    return EXIT_PROBLEMS if report.conflicts else EXIT_OK
