"""``safeio ls ROOT``: the checkpoints under a ``safeio.Checkpoints`` root, committed or partial."""

from __future__ import annotations

import argparse
import contextlib
import os
import stat
from typing import Any

from safeio._checkpoints.pointer import read_pointer
from safeio._errors import InvalidTargetError
from safeio._promotion.backends import backend_for
from safeio._promotion.steps import LATEST, StepNames
from safeio._storage.dirfd import held_directory, walk_files
from safeio._storage.manifest import MANIFEST_NAME
from safeio._storage.names import parse
from safeio.cli._common import EXIT_OK, EXIT_PROBLEMS, existing_directory, human_bytes, print_json
from safeio.integrations._accelerate_files import ranks_written
from safeio.integrations.transformers import TRAINER_STATE, is_complete_by_trainer

PATTERNS = ("step_{step}", "checkpoint-{step}", "checkpoint_{step}")  # checkpoint_{step}: accelerate's


def add_parser(commands: Any, epilog: str) -> None:
    parser = commands.add_parser(
        "ls",
        help="list the checkpoints under a Checkpoints root (committed, partial, in progress)",
        description="List the step directories under ROOT (a safeio.Checkpoints root): committed (the "
        "commit marker is there and every file it lists has its size), partial (a safeio marker whose "
        "files do not match it: never resumed from), written without safeio (no marker: complete or "
        "incomplete by its framework's own marker: the HF Trainer's trainer_state.json, DCP's .metadata, "
        "accelerate's random states of every rank), "
        "and stages of saves in progress or left by "
        "crashed writers (`safeio gc` removes those whose owner is gone). Marks the one `latest` "
        "names. A step or stage of another user than the root's owner is shown as theirs, whatever it holds, "
        "and nothing in it is read (Checkpoints never resumes from or retires it). Exit 1 when `latest` "
        "names something that is not a committed step.",
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


def _size(path: str) -> int:
    try:
        with held_directory(path) as fd:
            return sum(st.st_size for _rel, _fd, _name, st in walk_files(fd))
    except OSError:
        return 0


def checkpoint_rows(root: str, names: list[StepNames]) -> list[dict[str, Any]]:
    """Every step directory and checkpoint stage under ``root``: name, step, state, size (sorted).

    Ownership before content: an entry of another user than the root's owner is labelled as theirs
    (``FOREIGN``) from its ``lstat`` alone, whatever its state, and nothing inside it is opened, parsed,
    hashed or sized (size None): a planted step's trainer_state.json, archive or manifest listing a
    sparse 1 TiB file is never read (issue 34)."""
    rows: list[dict[str, Any]] = []
    owner = os.stat(root).st_uid
    for entry in sorted(os.listdir(root)):
        path = os.path.join(root, entry)
        sibling = parse(entry)
        if sibling is not None:
            if sibling.kind != "stage" or not any(p.parse(sibling.base) is not None for p in names):
                continue
            step = None
        else:
            step = next((s for s in (p.parse(entry) for p in names) if s is not None), None)
            if step is None:
                continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if step is not None and not stat.S_ISDIR(st.st_mode):
            continue  # a file or a link under a step's name is no checkpoint
        if sibling is not None:
            alive = sibling.owner_is_alive()
            state = {True: "in progress", False: "stage of a dead writer", None: "stage (other host)"}[alive]
        if st.st_uid != owner:
            state = f"{FOREIGN} (uid {st.st_uid})" + (f", {state}" if sibling is not None else "")
            rows.append({"name": entry, "step": step, "state": state, "size": None})
            continue
        if sibling is None:
            state = step_state(path, owner)
        rows.append({"name": entry, "step": step, "state": state, "size": _size(path)})
    rows.sort(key=lambda r: (r["step"] is None, r["step"] or 0, r["name"]))
    _fewer_ranks_are_incomplete(root, rows)
    return rows


def _fewer_ranks_are_incomplete(root: str, rows: list[dict[str, Any]]) -> None:
    """accelerate writes no marker, and ``ls`` does not know how many ranks the job had: a checkpoint
    with fewer ranks' random states than another of this root is one a killed rank left unfinished."""
    counted = {
        row["name"]: ranks_written(os.path.join(root, row["name"]))
        for row in rows
        if row["state"].startswith(f"{UNMARKED}, complete by {ACCELERATE}")
    }
    most = max((n for n in counted.values() if n is not None), default=0)
    for row in rows:
        ranks = counted.get(row["name"])
        if ranks is not None and ranks < most:
            row["state"] = (
                f"{UNMARKED}, incomplete (accelerate's random states of {ranks} of the {most} ranks "
                "its other checkpoints have)"
            )


def step_state(path: str, owner: int) -> str:
    """ "committed"; for a step committed by someone other than the root's owner (in a shared root), whose
    it is (``Checkpoints`` never resumes from or retires another user's step); "partial" when a safeio
    marker is there but the files do not match it; for a directory safeio did not write (no marker at
    all), whether it is complete by its framework's own marker (``UNMARKED``)."""
    with contextlib.suppress(OSError):
        marker_uid = os.lstat(os.path.join(path, MANIFEST_NAME)).st_uid
        if marker_uid != owner:  # another user's marker in a directory they can write: not read
            return f"{FOREIGN} (uid {marker_uid})"
    reader = backend_for(path).reader()
    record = reader.committed_marker()
    if record is not None:
        uid = reader.owner(record)
        return "committed" if uid == owner else f"{FOREIGN} (uid {uid})"
    if reader.manifest() is not None:
        return "partial"
    marker = framework_marker(path)
    return f"{UNMARKED}, complete by {marker}" if marker else f"{UNMARKED}, incomplete"


FOREIGN = "another user's"
UNMARKED = "written without safeio"


def framework_marker(path: str) -> str | None:
    """The framework's own completion marker of a checkpoint directory safeio did not write, when it is
    there: the HF Trainer's ``trainer_state.json`` (with the weights), accelerate's random states of every
    rank (written last by each; ``_accelerate_files``), or ``torch.distributed.checkpoint``'s
    ``.metadata`` (written last by its save). None: no marker safeio knows says it is complete."""
    if is_complete_by_trainer(path):
        return TRAINER_STATE
    ranks = ranks_written(path)
    if ranks is not None:
        return f"{ACCELERATE} of {ranks} rank{'s' if ranks > 1 else ''}"
    with contextlib.suppress(OSError), held_directory(path) as fd:
        if stat.S_ISREG(os.stat(DCP_METADATA, dir_fd=fd, follow_symlinks=False).st_mode):
            return f"torch.distributed.checkpoint's {DCP_METADATA}"
    return None


DCP_METADATA = ".metadata"
ACCELERATE = "accelerate's random_states_<rank>.pkl"


def name_patterns(root: str, name: str | None) -> list[StepNames]:
    return [StepNames(p, root) for p in ([name] if name else PATTERNS)]


def latest_pointer(root: str) -> tuple[str | None, str | None]:
    """What ``latest`` under ``root`` names (None: no pointer), and the problem with it, if any (a link,
    a FIFO, a huge file: reported with its path, never followed or read)."""
    try:
        return read_pointer(os.path.join(root, LATEST)), None
    except InvalidTargetError as exc:
        return None, str(exc)


def run(args: argparse.Namespace) -> int:
    root = existing_directory(args.root, what="ROOT")
    latest, problem = latest_pointer(root)
    rows = checkpoint_rows(root, name_patterns(root, args.name))
    latest_ok = problem is None and (
        latest is None or any(r["name"] == latest and r["state"] == "committed" for r in rows)
    )
    report: dict[str, Any] = {"root": root, "latest": latest, "latest_ok": latest_ok}
    report.update(latest_problem=problem, checkpoints=rows)
    if args.json:
        print_json(report)
    else:
        for row in rows:
            mark = "  <- latest" if row["name"] == latest else ""
            size = human_bytes(row["size"]) if row["size"] is not None else "-"
            print(f"{row['state']:<22} {size:>10}  {row['name']}{mark}")
        if not rows:
            print(f"no checkpoints under {root}")
        if problem is not None:
            print(problem)
        elif not latest_ok:
            print(f"latest names {latest!r}, which is not a committed checkpoint here")
    return EXIT_OK if latest_ok else EXIT_PROBLEMS
