"""Ranks whose collective calls on a root differ (one skipped a ``save`` or made one more ``latest()``):
who entered a call first, as recorded in the store, and the ``CollectiveMismatch`` every rank of the
call raises, built from the record the rank that found it set (input: every field is checked)."""

from __future__ import annotations

from typing import Any

from safeio._coordination.calls import text
from safeio._errors import CollectiveMismatch


def diverged_record(calls: dict[int, str], problem: str, *, number: int, found_by: int) -> dict[str, Any]:
    """What the rank that found the calls differ sets in every key of the call (``waited_on_keys``)."""
    return {
        "call": number,
        "calls": {str(r): w for r, w in calls.items()},
        "found_by": found_by,
        "problem": problem,
    }


def waited_on_keys(world_size: int, writer: int) -> list[str]:
    """Every key of a call a rank of it may be waiting for: set to the record, they all wake at once."""
    names = ["announce", "outcome", "fsync"]
    for r in range(world_size):
        if r != writer:
            names += [f"rank/{r}", f"synced/{r}"]
    return names


def mismatch_error(record: object, *, rank: int, root: str, number: int) -> CollectiveMismatch:
    """The error every rank of a diverged call raises (``record`` as heard: input)."""
    record = record if isinstance(record, dict) else {}
    calls: dict[int, str] = {}
    raw_calls = record.get("calls")
    if isinstance(raw_calls, dict):
        for r, what in list(raw_calls.items())[:8]:
            if isinstance(r, str) and r.isdigit() and isinstance(what, str):
                calls[int(r)] = text(what)
    found_by = record.get("found_by")
    problem = record.get("problem")
    parts = [f"rank {r} is in {w}" for r, w in sorted(calls.items())]
    detail = " while ".join(parts) if len(parts) > 1 else (parts[0] if parts else "")
    if isinstance(problem, str) and problem:
        detail = f"{detail} ({text(problem)})" if detail else text(problem)
    found = f"; found by rank {found_by}" if isinstance(found_by, int) and found_by != rank else ""
    return CollectiveMismatch(
        f"rank {rank}: the ranks' collective calls on {root} differ at call {number}: "
        f"{detail or 'what each rank makes there is unknown'}{found}. save(), latest(), at() and "
        "steps() are collective: every rank of the group makes them, in the same order; one rank "
        "skipped a call or made one more (a reading of one process alone takes "
        "group=safeio.Group(), as safeio.integrations.transformers.get_last_checkpoint does)",
        root,
        call=number,
        calls=calls,
    )


def entrant(record: object) -> tuple[int, str] | None:
    """(rank, what) of a call's record (input), or None if it is not one."""
    if not isinstance(record, dict):
        return None
    rank, what = record.get("rank"), record.get("what")
    if isinstance(rank, bool) or not isinstance(rank, int) or not isinstance(what, str):
        return None
    return rank, text(what)
