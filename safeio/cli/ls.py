"""``safeio ls ROOT``: the checkpoints under a ``safeio.Checkpoints`` root, each with its state."""

from __future__ import annotations

import argparse
from typing import Any

from safeio.cli._common import EXIT_OK, EXIT_PROBLEMS, columns, existing_directory, human_bytes, print_json
from safeio.cli._entries import LATEST_FIX, checkpoint_rows, latest_pointer, name_patterns
from safeio.cli._states import State

SHOWN = 3  # names per fix line; a share can hold thousands of planted ones


def add_parser(commands: Any, epilog: str) -> None:
    parser = commands.add_parser(
        "ls",
        help="list the checkpoints under a Checkpoints root, each with its state",
        description="List the step directories under ROOT (a safeio.Checkpoints root) and the stages of "
        "saves of them, each with its state (the words `safeio verify` and `safeio gc` use too): "
        "committed; damaged (a safeio marker the files do not match: never resumed from); "
        "written-without-safeio-complete or -incomplete (no safeio marker: judged by its framework's own "
        "marker: the HF Trainer's trainer_state.json, DCP's .metadata, accelerate's random states of "
        "every rank); in-progress, stale (its save's process is gone: `safeio gc` removes it) or "
        "other-host for a stage; another-users for a step or stage of another user than the root's "
        "owner, whatever it holds (nothing in it is read; Checkpoints never resumes from or retires it). "
        "Marks the one `latest` names, and says what fixes each problem. Exit 1 when `latest` names "
        "something that is not a committed step.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("root", metavar="ROOT", help="the checkpoint root directory")
    parser.add_argument(
        "--name",
        default=None,
        help="the step name pattern (default: step_{step}, checkpoint-{step} and checkpoint_{step})",
    )
    parser.add_argument("--json", action="store_true", help="print a machine-readable report")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    root = existing_directory(args.root, what="ROOT")
    latest, problem = latest_pointer(root)
    rows = checkpoint_rows(root, name_patterns(root, args.name))
    latest_ok = problem is None and (
        latest is None or any(r["name"] == latest and r["state"] == State.COMMITTED for r in rows)
    )
    if problem is None and not latest_ok:
        problem = f"latest names {latest!r}, which is not a committed checkpoint here"
    report: dict[str, Any] = {"root": root, "latest": latest, "latest_ok": latest_ok}
    report.update(latest_problem=problem, latest_fix=None if latest_ok else LATEST_FIX, checkpoints=rows)
    if args.json:
        print_json(report)
    else:
        _print(report)
    return EXIT_OK if latest_ok else EXIT_PROBLEMS


def _print(report: dict[str, Any]) -> None:
    rows = report["checkpoints"]
    if not rows:
        print(f"no checkpoints under {report['root']}")
    table = [["STATE", "SIZE", "NAME", "DETAIL"]]
    for row in rows:
        mark = " <- latest" if row["name"] == report["latest"] else ""
        size = human_bytes(row["size"]) if row["size"] is not None else "-"
        table.append([row["state"], size, row["name"] + mark, row["detail"]])
    for line in columns(table, right=frozenset({1})) if rows else []:
        print(line)
    if report["latest_problem"] is not None:
        print(f"{report['latest_problem']}; fix: {report['latest_fix']}")
    print_fixes(rows)


def print_fixes(rows: list[dict[str, Any]], indent: str = "") -> None:
    """One line per problem state present: which entries are in it, and what fixes them."""
    by_state: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["fix"] is not None:
            by_state.setdefault(row["state"], []).append(row)
    for state, found in by_state.items():
        names = ", ".join(r["name"] for r in found[:SHOWN])
        more = f" and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
        print(f"{indent}fix {state} ({names}{more}): {found[0]['fix']}")
