"""``safeio verify ROOT`` on a ``safeio.Checkpoints`` root: every step, and the ``latest`` pointer.

A committed step is checked against its marker like any promoted directory. A directory under a step's
name that is not committed is a problem (a step damaged after its commit, or written without safeio and
incomplete: ``latest()`` never resumes from it), except one written without safeio that its framework's
own marker says is complete (the Trainer's ``trainer_state.json``, DCP's ``.metadata``, accelerate's random
states of every rank): it is listed as not checked, since no manifest of its files exists. ``latest`` must
name a committed step. Stages of saves in progress are shown, not judged; those of dead writers are what
``safeio gc`` removes. Another user's steps (of another uid than the root's owner) are shown as theirs and
never read or hashed, whatever their state: root's ``verify`` of a share once hashed another user's
partial step whose manifest listed a sparse 1 TiB file (issue 34).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from safeio._promotion.backends import backend_for
from safeio.cli._common import EXIT_OK, EXIT_PROBLEMS, print_json
from safeio.cli.ls import FOREIGN, UNMARKED, checkpoint_rows, latest_pointer, name_patterns


def verify_root(root: str, args: argparse.Namespace) -> int:
    rows = checkpoint_rows(root, name_patterns(root, None))
    problems: list[str] = []
    for row in rows:
        if row["step"] is None or row["state"].startswith(FOREIGN):
            continue  # shown below, not judged: a stage in progress, another user's step
        if row["state"].startswith(UNMARKED):
            if "incomplete" in row["state"]:
                problems.append(
                    f"{row['name']}: {row['state']} (no safeio marker, and no framework marker safeio knows "
                    "says it is complete); latest() never resumes from it"
                )
            continue  # complete by its framework's marker: shown below as not checked
        reader = backend_for(os.path.join(root, row["name"])).reader()
        found = reader.verify(check_hashes=not args.no_hashes)
        row["problems"] = found
        if row["state"] != "committed" or found:
            has_marker = reader.manifest() is not None
            why = "damaged after its commit" if has_marker else "not committed (no valid marker)"
            problems.append(f"{row['name']}: {why}; latest() never resumes from it: {'; '.join(found)}")
    latest, pointer_problem = latest_pointer(root)
    if pointer_problem is not None:
        problems.append(pointer_problem)
    elif latest is not None and not any(r["name"] == latest and r["state"] == "committed" for r in rows):
        problems.append(f"latest names {latest!r}, which is not a committed checkpoint")
    report: dict[str, Any] = {
        "path": root,
        "ok": not problems,
        "problems": problems,
        "latest": latest,
        "checkpoints": rows,
    }
    if args.json:
        print_json(report)
    else:
        committed = [r["name"] for r in rows if r["state"] == "committed" and not r.get("problems")]
        head = "ok" if not problems else f"FAILED: {len(problems)} problem(s)"
        print(f"{head}: {root}: {len(committed)} committed checkpoint(s), latest {latest!r}")
        for problem in problems:
            print(f"  {problem}")
        for row in rows:
            if row["step"] is None or row["state"].startswith(FOREIGN):
                print(f"  note: {row['name']}: {row['state']}")
            elif row["state"].startswith(UNMARKED) and "incomplete" not in row["state"]:
                print(
                    f"  not checked: {row['name']}: {row['state']}; safeio has no manifest of its files, "
                    "so their sizes and contents were not checked"
                )
    return EXIT_OK if not problems else EXIT_PROBLEMS
