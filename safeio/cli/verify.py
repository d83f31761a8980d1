"""``safeio verify PATH``: is a promoted directory (or object-store prefix) complete per its manifest?"""

from __future__ import annotations

import argparse
import os
from typing import Any

from safeio.cli._common import EXIT_OK, EXIT_PROBLEMS, not_a_directory, print_json
from safeio.cli._states import State, fix
from safeio.cli.verify_root import verify_root
from safeio.shares import MANIFEST_NAME, Target, checksum_kinds, framework_marker


def add_parser(commands: Any, epilog: str) -> None:
    parser = commands.add_parser(
        "verify",
        help="check a promoted directory or object-store prefix against its manifest",
        description="Check a directory (or an object-store prefix such as s3://bucket/ckpt/tokenizer) "
        f"that safeio promoted against its {MANIFEST_NAME}: every listed file present, sizes and "
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
    reader = Target(args.path)  # InvalidTargetError (empty path, NUL byte) is bad input: exit 2
    shown = reader.url
    absent = reader.absence()
    if absent is not None:  # a path naming nothing is bad input, as for `ls` and `gc`
        raise not_a_directory(args.path, absent)
    if reader.manifest() is None and reader.holds_checkpoints():
        return verify_root(reader.path, args)
    problems = reader.verify(check_hashes=not args.no_hashes)
    record = reader.manifest()
    unlisted: list[str] = []
    try:
        unlisted = reader.unlisted(record) if record else []
    except OSError as exc:  # a tree too deep to list, a directory that cannot be read
        where = os.path.join(shown, exc.filename) if isinstance(exc.filename, str) else shown
        problems = [*problems, f"{where}: {exc.strerror or exc}; its files were not checked"]
    state, detail = _state(reader.path, reader, record, problems)
    checksums = checksum_kinds(record) if record is not None and not args.no_hashes else []
    if record is None:
        problems = [] if state == State.UNMARKED_COMPLETE else [detail]
    report: dict[str, Any] = {
        "path": shown,
        "ok": not problems,
        "state": state,
        "detail": detail,
        "fix": _fix(state, shown),
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


def _fix(state: State, shown: str) -> str | None:
    """What fixes one target: saving it again (through safeio), which a checkpoint step refuses while a
    directory it did not commit stands at its name."""
    again = {State.DAMAGED: "save it again", State.UNMARKED_INCOMPLETE: "save it through safeio"}.get(state)
    if again is None:
        return fix(state, shown)
    return f"{again}: the next safeio save of {shown} replaces it (a checkpoint step: move it away first)"


def _state(
    path: str, reader: Target, record: dict[str, Any] | None, problems: list[str]
) -> tuple[State, str]:
    """The target's state in the words ``ls`` and ``gc`` use, and its detail."""
    if record is not None:
        if problems:
            return State.DAMAGED, f"{len(problems)} problem(s) against its {MANIFEST_NAME}"
        return State.COMMITTED, f"{len(record['files'])} file(s) match its {MANIFEST_NAME}"
    if reader.marker_required:  # an object-store prefix: objects, and no commit marker
        return State.UNCOMMITTED, reader.describe_missing_manifest()
    if os.path.lexists(os.path.join(path, MANIFEST_NAME)):
        return State.DAMAGED, reader.no_manifest_problem()
    marker, _ranks = framework_marker(path)
    if marker is None:
        return State.UNMARKED_INCOMPLETE, (
            f"{reader.no_manifest_problem()}, and no framework marker safeio knows says it is complete"
        )
    return State.UNMARKED_COMPLETE, (
        f"complete by {marker}; safeio has no manifest of its files, so their sizes and contents were not "
        "checked"
    )


def _print(report: dict[str, Any]) -> None:
    state, detail = report["state"], report["detail"]
    if report["ok"] and state == State.COMMITTED:
        checked = f"sizes and {', '.join(report['checksums'])}" if report["checksums"] else "sizes"
        print(f"ok: {report['path']}: {report['files']} file(s) match the manifest ({checked})")
    elif report["ok"]:
        print(f"not checked: {report['path']}: {state}: {detail}")
    else:
        print(f"FAILED: {report['path']}: {state}: {len(report['problems'])} problem(s)")
        for problem in report["problems"]:
            print(f"  {problem}")
    for rel in report["unlisted"]:
        print(f"  note: {rel} is not listed in the manifest")
    if report["fix"] is not None:
        print(f"  fix: {report['fix']}")
