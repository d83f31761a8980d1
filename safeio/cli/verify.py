"""``safeio verify PATH``: is a promoted directory (or object-store prefix) complete per its manifest?"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from safeio._storage import manifest
from safeio._storage.dirfd import held_directory
from safeio._storage.location import Location, resolve
from safeio._storage.readers import reader_for
from safeio.cli._common import EXIT_OK, EXIT_PROBLEMS, print_json
from safeio.cli.verify_root import is_checkpoint_root, verify_root


def add_parser(commands: Any, epilog: str) -> None:
    parser = commands.add_parser(
        "verify",
        help="check a promoted directory or object-store prefix against its manifest",
        description="Check a directory (or an object-store prefix such as s3://bucket/ckpt/tokenizer) "
        f"that safeio promoted against its {manifest.MANIFEST_NAME}: every listed file present, sizes and "
        "sha256 (when the save was durable) matching. An object-store prefix without its commit marker "
        "is an incomplete commit. PATH may also be a safeio.Checkpoints root: then every step is checked (a "
        "step directory that is not committed is a problem: latest() never resumes from it) and so is "
        "`latest`. Exit 0 when complete, 1 when anything is missing or damaged.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", metavar="PATH", help="the promoted directory, or an fsspec URL")
    parser.add_argument(
        "--no-hashes", action="store_true", help="check presence and sizes only (skip sha256: faster)"
    )
    parser.add_argument("--json", action="store_true", help="print a machine-readable report")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    location = resolve(args.path)  # InvalidTargetError (empty path, NUL byte) is bad input: exit 2
    shown = location.url()
    reader = reader_for(location)
    if location.is_local and reader.manifest() is None and is_checkpoint_root(location.path):
        return verify_root(location.path, args)
    problems = reader.verify(check_hashes=not args.no_hashes)
    record = reader.manifest() if reader.exists() else None
    if problems and record is None and not location.is_local:
        problems = [_describe_uncommitted(location)]
    report: dict[str, Any] = {
        "path": shown,
        "ok": not problems,
        "problems": problems,
        "files": len(record["files"]) if record else 0,
        "hashes_checked": record is not None and not args.no_hashes and _has_hashes(record),
        "unlisted": _unlisted(location, record) if record else [],
    }
    if args.json:
        print_json(report)
    else:
        _print(report)
    return EXIT_OK if not problems else EXIT_PROBLEMS


def _has_hashes(record: dict[str, Any]) -> bool:
    return any("sha256" in entry for entry in record["files"].values())


def _describe_uncommitted(location: Location) -> str:
    # No marker: either nothing was ever committed there, or an upload stopped before its last step.
    fs = location.fs
    assert fs is not None, "only called for object-store locations"
    try:
        objects = [key for key in fs.find(location.path) if not key.endswith("/")]
    except (OSError, ValueError):
        objects = []
    if not objects:
        return f"missing: nothing under {location.url()}"
    return (
        f"incomplete commit: {len(objects)} object(s) under {location.url()} but no commit marker "
        f"({manifest.MANIFEST_NAME}); the upload did not finish or is still running"
    )


def _unlisted(location: Location, record: dict[str, Any]) -> list[str]:
    """Files present but not in the manifest: not an error (merge-mode directories may hold files other
    tools wrote), but worth showing, since in a replace-mode target they were written in place."""
    if not location.is_local:
        return []
    listed = set(record["files"])
    with held_directory(location.path, follow=True) as fd:
        return [rel for rel in manifest.content_files(fd) if rel not in listed]


def _print(report: dict[str, Any]) -> None:
    if report["ok"]:
        checked = "sizes and sha256" if report["hashes_checked"] else "sizes"
        print(f"ok: {report['path']}: {report['files']} file(s) match the manifest ({checked})")
    else:
        print(f"FAILED: {report['path']}: {len(report['problems'])} problem(s)", file=sys.stdout)
        for problem in report["problems"]:
            print(f"  {problem}")
    for rel in report["unlisted"]:
        print(f"  note: {rel} is not listed in the manifest")
