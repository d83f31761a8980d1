"""``safeio verify PATH``: is a promoted directory (or object-store prefix) complete per its manifest?"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from safeio._promotion.backends import backend_for
from safeio._storage import digests, manifest
from safeio.cli._common import EXIT_OK, EXIT_PROBLEMS, print_json
from safeio.cli.verify_root import verify_root


def add_parser(commands: Any, epilog: str) -> None:
    parser = commands.add_parser(
        "verify",
        help="check a promoted directory or object-store prefix against its manifest",
        description="Check a directory (or an object-store prefix such as s3://bucket/ckpt/tokenizer) "
        f"that safeio promoted against its {manifest.MANIFEST_NAME}: every listed file present, sizes and "
        "checksums (when the save was durable: xxh3_128, or sha256 in a format-1 manifest of an earlier "
        "safeio) matching. An object-store prefix without its commit marker "
        "is an incomplete commit. PATH may also be a safeio.Checkpoints root: then every step is checked (a "
        "step directory that is not committed is a problem: latest() never resumes from it) and so is "
        "`latest`. Exit 0 when complete, 1 when anything is missing or damaged.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", metavar="PATH", help="the promoted directory, or an fsspec URL")
    parser.add_argument(
        "--no-hashes", action="store_true", help="check presence and sizes only (skip the checksums: faster)"
    )
    parser.add_argument("--json", action="store_true", help="print a machine-readable report")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    backend = backend_for(args.path)  # InvalidTargetError (empty path, NUL byte) is bad input: exit 2
    shown = backend.url()
    reader = backend.reader()
    if reader.manifest() is None and backend.holds_checkpoints():
        return verify_root(backend.location.path, args)
    problems = reader.verify(check_hashes=not args.no_hashes)
    record = reader.manifest() if reader.exists() else None
    if problems and record is None and reader.exists():
        problems = [reader.describe_missing_manifest()]
    unlisted: list[str] = []
    try:
        unlisted = reader.unlisted(record) if record else []
    except OSError as exc:  # a tree too deep to list, a directory that cannot be read
        where = os.path.join(shown, exc.filename) if isinstance(exc.filename, str) else shown
        problems = [*problems, f"{where}: {exc.strerror or exc}; its files were not checked"]
    checksums = _checksums(record) if record is not None and not args.no_hashes else []
    report: dict[str, Any] = {
        "path": shown,
        "ok": not problems,
        "problems": problems,
        "files": len(record["files"]) if record else 0,
        "hashes_checked": bool(checksums),
        "checksums": checksums,
        "unlisted": unlisted,
    }
    if args.json:
        print_json(report)
    else:
        _print(report)
    return EXIT_OK if not problems else EXIT_PROBLEMS


def _checksums(record: dict[str, Any]) -> list[str]:
    """The kinds of checksum the manifest's entries hold (a merge may keep older sha256 entries)."""
    return sorted({name for entry in record["files"].values() for name in digests.recorded(entry)})


def _print(report: dict[str, Any]) -> None:
    if report["ok"]:
        checked = f"sizes and {', '.join(report['checksums'])}" if report["checksums"] else "sizes"
        print(f"ok: {report['path']}: {report['files']} file(s) match the manifest ({checked})")
    else:
        print(f"FAILED: {report['path']}: {len(report['problems'])} problem(s)", file=sys.stdout)
        for problem in report["problems"]:
            print(f"  {problem}")
    for rel in report["unlisted"]:
        print(f"  note: {rel} is not listed in the manifest")
