"""A checkpoint save's outcome as every rank hears it: what is wrong with one heard from the store (input),
the error every rank raises for a step that was not committed, and the writer abandoning its stage."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from safeio._checkpoints.steps import StepCommit
from safeio._coordination.calls import text
from safeio._errors import CheckpointError
from safeio._who import who

logger = logging.getLogger("safeio")


def abandon(commit: StepCommit) -> None:
    """Nothing is committed: the stage goes, best effort (the previous checkpoints and ``latest`` stay;
    what is left is the next save's recovery or ``safeio gc``'s)."""
    with contextlib.suppress(OSError):
        commit.promotion.discard("")


def outcome_problem(outcome: dict[str, Any]) -> str | None:
    """What is wrong with a save's outcome heard from the store (input), or None."""
    failed, missing, warnings = (
        outcome.get("failed", {}),
        outcome.get("missing", []),
        outcome.get("warnings", []),
    )
    if not (isinstance(failed, dict) and all(r.isdigit() and isinstance(e, str) for r, e in failed.items())):
        return f"failed is not a map of ranks to errors: {text(failed)}"
    if not (isinstance(missing, list) and all(_is_rank(r) for r in missing)):
        return f"missing is not a list of ranks: {text(missing)}"
    if not (isinstance(warnings, list) and all(isinstance(w, str) for w in warnings)):
        return f"warnings is not a list of texts: {text(warnings)}"
    return None


def _is_rank(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31


def failure(outcome: dict[str, Any], rank: int, step: int, final: str) -> CheckpointError:
    """The error every rank raises for a failed step; ``outcome`` as heard from the store (input)."""
    heard_failed, heard_missing = outcome.get("failed"), outcome.get("missing")
    failed = {
        int(r): text(e)
        for r, e in (heard_failed.items() if isinstance(heard_failed, dict) else ())
        if isinstance(r, str) and r.isdigit() and len(r) < 8
    }
    missing = [r for r in (heard_missing if isinstance(heard_missing, list) else ()) if _is_rank(r)]
    heard_where = outcome.get("where")
    where = heard_where if isinstance(heard_where, dict) else {}
    parts = [f"rank {r}: {e}" for r, e in sorted(failed.items())[:16]]
    for r in missing[:16]:
        last = where.get(str(r))
        parts.append(
            f"rank {r} never reported ({text(last) if isinstance(last, str) else 'died or still busy'})"
        )
    return CheckpointError(
        f"rank {rank}: step {step} was not committed ({'; '.join(parts) or 'failed'}); nothing was "
        f"committed at {final} and latest is unchanged",
        final,
        failed=failed,
        missing=missing,
    )


def note_warnings(warnings: object, rank: int) -> list[str]:
    """The warnings of a committed step's outcome (as heard: input), each logged on this rank."""
    if not isinstance(warnings, list):
        return []
    noted = [text(w) for w in warnings[:100]]
    for warning in noted:
        logger.warning("%s: %s", who(rank), warning)
    return noted
