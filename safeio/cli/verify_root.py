"""``safeio verify ROOT`` on a ``safeio.Checkpoints`` root: every step, and the ``latest`` pointer.

Every entry gets the state ``safeio ls`` gives it (``safeio.cli._states``); a committed step is then checked
against its marker like any promoted directory (checksums included), and is damaged when anything differs.
A problem is a step that is damaged or written without safeio and incomplete (``latest()`` never resumes
from it), or a ``latest`` that does not name a committed step; each is reported with what fixes it. A step
written without safeio that its framework's own marker says is complete (the Trainer's
``trainer_state.json``, DCP's ``.metadata``, accelerate's random states of every rank) is listed as not
checked: no manifest of its files exists. Stages are shown, not judged, with the fix for a stale one
(``safeio gc``). Another user's steps and stages (of another uid than the root's owner) are shown as theirs
and never read or hashed, whatever their state: root's ``verify`` of a share once hashed another user's
partial step whose manifest listed a sparse 1 TiB file (issue 34).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from safeio.cli._common import EXIT_OK, EXIT_PROBLEMS, print_json
from safeio.cli._entries import LATEST_FIX, checkpoint_rows, latest_pointer, name_patterns
from safeio.cli._states import State, fix
from safeio.cli.ls import print_fixes
from safeio.shares import Target

JUDGED = (State.DAMAGED, State.UNMARKED_INCOMPLETE)  # a step in these states is a problem


def verify_root(root: str, args: argparse.Namespace) -> int:
    rows = checkpoint_rows(root, name_patterns(root, None))
    for row in rows:
        if row["state"] == State.COMMITTED:
            _check(root, row, check_hashes=not args.no_hashes)
    problems = [f"{r['name']}: {r['state']}: {r['detail']}" for r in rows if r["state"] in JUDGED]
    latest, pointer_problem = latest_pointer(root)
    committed = {r["name"] for r in rows if r["state"] == State.COMMITTED}
    if pointer_problem is None and latest is not None and latest not in committed:
        pointer_problem = f"latest names {latest!r}, which is not a committed checkpoint"
    if pointer_problem is not None:
        problems.append(pointer_problem)
    report: dict[str, Any] = {
        "path": root,
        "ok": not problems,
        "problems": problems,
        "latest": latest,
        "latest_fix": LATEST_FIX if pointer_problem is not None else None,
        "checkpoints": rows,
    }
    if args.json:
        print_json(report)
    else:
        _print(report)
    return EXIT_OK if not problems else EXIT_PROBLEMS


def _check(root: str, row: dict[str, Any], *, check_hashes: bool) -> None:
    """A committed step checked against its marker, checksums included: damaged when anything differs.
    Read as the root owner's directory it was judged (``owner``): in a root others may write, a link or
    a directory of theirs put in its place since is reported, never hashed."""
    owner = os.stat(root).st_uid
    found = Target(os.path.join(root, row["name"]), owner=owner).verify(check_hashes=check_hashes)
    if found:
        row.update(state=State.DAMAGED, detail="; ".join(found), fix=fix(State.DAMAGED, root))


def _print(report: dict[str, Any]) -> None:
    rows = report["checkpoints"]
    committed = sum(1 for r in rows if r["state"] == State.COMMITTED)
    problems = report["problems"]
    head = "ok" if not problems else f"FAILED: {len(problems)} problem(s)"
    print(f"{head}: {report['path']}: {committed} committed checkpoint(s), latest {report['latest']!r}")
    for problem in problems:
        print(f"  {problem}")
    if report["latest_fix"] is not None:
        print(f"  fix latest: {report['latest_fix']}")
    for row in rows:
        if row["step"] is None or row["state"] == State.ANOTHER_USERS:
            print(f"  note: {row['name']}: {row['state']}: {row['detail']}")
        elif row["state"] == State.UNMARKED_COMPLETE:
            print(
                f"  not checked: {row['name']}: {row['state']}: {row['detail']}; safeio has no manifest of "
                "its files, so their sizes and contents were not checked"
            )
    print_fixes(rows, indent="  ")
