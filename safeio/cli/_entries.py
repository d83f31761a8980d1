"""What ``safeio ls`` and ``safeio verify`` find under a ``safeio.Checkpoints`` root: every step directory
and checkpoint stage, each with its state (``safeio.cli._states``), a detail and a fix.

Ownership before content: an entry of another user than the root's owner is labelled as theirs from its
``lstat`` alone, whatever it holds, and nothing inside it is opened, parsed, hashed or sized (size None):
a planted step's trainer_state.json, archive or manifest listing a sparse 1 TiB file is never read
(issue 34).
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import Any

from safeio._errors import InvalidTargetError
from safeio.cli._states import State, fix
from safeio.frameworks import open_shared_directory
from safeio.shares import (
    MANIFEST_NAME,
    Sibling,
    StepNames,
    Target,
    framework_marker,
    parse_leftover,
    read_latest,
)

PATTERNS = ("step_{step}", "checkpoint-{step}", "checkpoint_{step}")  # checkpoint_{step}: accelerate's
# How a latest pointer that does not name a committed step is put right (ls and verify say it alike).
LATEST_FIX = (
    "the next committed save rewrites it; `latest()` resumes from the newest committed step meanwhile"
)


def name_patterns(root: str, name: str | None) -> list[StepNames]:
    return [StepNames(p, root) for p in ([name] if name else PATTERNS)]


def latest_pointer(root: str) -> tuple[str | None, str | None]:
    """What ``latest`` under ``root`` names (None: no pointer), and the problem with it, if any (a link,
    a FIFO, a huge file: reported with its path, never followed or read)."""
    try:
        return read_latest(root), None
    except InvalidTargetError as exc:
        return None, str(exc)


def checkpoint_rows(root: str, names: list[StepNames]) -> list[dict[str, Any]]:
    """Every step directory and checkpoint stage under ``root``, sorted by step: its ``name``, ``step``
    (None for a stage), ``state``, ``detail``, ``fix`` and ``size`` (None: not read)."""
    rows: list[dict[str, Any]] = []
    accelerate_ranks: dict[str, int] = {}
    owner = os.stat(root).st_uid
    for entry in sorted(os.listdir(root)):
        path = os.path.join(root, entry)
        sibling = parse_leftover(entry)
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
        size: int | None = None
        if st.st_uid != owner:
            state, detail = State.ANOTHER_USERS, _theirs(st.st_uid, sibling)
        elif sibling is not None:
            state, detail = stage_state(sibling)
            size = _size(path)
        else:
            state, detail, ranks = step_state(path, owner)
            if ranks is not None:
                accelerate_ranks[entry] = ranks
            size = _size(path)
        rows.append({"name": entry, "step": step, "state": state, "detail": detail, "size": size})
    rows.sort(key=lambda r: (r["step"] is None, r["step"] or 0, r["name"]))
    _fewer_ranks_are_incomplete(rows, accelerate_ranks)
    for row in rows:
        row["fix"] = fix(row["state"], root)
    return rows


def _theirs(uid: int, sibling: Sibling | None) -> str:
    what = "a stage of their save" if sibling is not None else "nothing in it read"
    return f"another user's (uid {uid}): {what}"


def stage_state(sibling: Sibling) -> tuple[State, str]:
    """A checkpoint stage: its save's process alive (in progress), gone (stale), or on another host."""
    alive = sibling.owner_is_alive()
    if alive is None:
        return State.OTHER_HOST, f"stage of a save on another host (tag {sibling.host}, pid {sibling.pid})"
    if alive:
        return State.IN_PROGRESS, f"stage of a save by pid {sibling.pid}, alive"
    return State.STALE, f"stage of a save by pid {sibling.pid}, which is gone"


def step_state(path: str, owner: int) -> tuple[State, str, int | None]:
    """The state of a step directory of the root's owner, its detail, and (for one accelerate wrote
    without safeio, complete) how many ranks' random states it holds. A step committed by someone other
    than the root's owner (in a shared root) is theirs: ``Checkpoints`` never resumes from or retires it."""
    with contextlib.suppress(OSError):
        marker_uid = os.lstat(os.path.join(path, MANIFEST_NAME)).st_uid
        if marker_uid != owner:  # another user's marker in a directory they can write: not read
            return State.ANOTHER_USERS, _theirs(marker_uid, None), None
    reader = Target(path, owner=owner)  # a link or their directory put in its place since: not read
    record = reader.committed_marker()
    if record is not None:
        uid = reader.marker_owner(record)
        if uid != owner:
            return State.ANOTHER_USERS, f"committed by another user (uid {uid})", None
        return State.COMMITTED, f"step {record['step']}, {len(record['files'])} file(s)", None
    record = reader.manifest()
    if record is not None:
        problems = reader.problems(record, check_hashes=False)
        if not problems:
            return State.DAMAGED, f"its {MANIFEST_NAME} names no step: not a checkpoint's marker", None
        return State.DAMAGED, _first(problems), None
    if os.path.lexists(os.path.join(path, MANIFEST_NAME)):
        return State.DAMAGED, reader.no_manifest_problem(), None
    marker, ranks = framework_marker(path)
    if marker is None:
        return State.UNMARKED_INCOMPLETE, "no safeio marker, and no framework marker safeio knows", None
    return State.UNMARKED_COMPLETE, f"complete by {marker}", ranks


def _first(problems: list[str], shown: int = 3) -> str:
    more = f"; and {len(problems) - shown} more" if len(problems) > shown else ""
    return "; ".join(problems[:shown]) + more


def _fewer_ranks_are_incomplete(rows: list[dict[str, Any]], ranks: dict[str, int]) -> None:
    """accelerate writes no marker, and ``ls`` does not know how many ranks the job had: a checkpoint
    with fewer ranks' random states than another of this root is one a killed rank left unfinished."""
    most = max(ranks.values(), default=0)
    for row in rows:
        written = ranks.get(row["name"])
        if written is not None and written < most:
            row["state"] = State.UNMARKED_INCOMPLETE
            row["detail"] = (
                f"accelerate's random states of {written} of the {most} ranks its other checkpoints have"
            )


def _size(path: str) -> int:
    try:
        with open_shared_directory(path) as directory:
            return directory.size()
    except OSError:
        return 0
