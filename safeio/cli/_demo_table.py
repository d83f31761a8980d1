"""``safeio demo``'s numbers: per-pattern summaries from the ranks' tallies and the mount's counters, and
the side-by-side table."""

from __future__ import annotations

from collections import Counter
from typing import Any

from safeio.cli._demo_work import DESCRIPTIONS, PATTERNS

# Operations that change the shared filesystem (the NFS-like mount's counter names).
WRITE_OPS = ("open_write", "write", "truncate", "rename", "unlink", "mkdir", "rmdir")
# Truncations of existing files: what interlocks with readers on NFS.
TRUNCATING_OPS = ("open_trunc", "truncate")
_MAX_ERRORS = 4


def summarize(
    done: dict[int, dict[str, Any]],
    reader: dict[str, Any],
    ops: Any,
    hazards: list[dict[str, Any]] | None,
    rank_pids: dict[int, int],
    reader_pid: int | None,
    wall: float,
) -> dict[str, Any]:
    ranks = sorted(done)
    saves = [done[r]["saves"] for r in ranks]
    loads = [done[r]["loads"] for r in ranks]
    errors: list[str] = []
    for tally in [*saves, *loads, reader]:
        for error in tally["errors"]:
            if error not in errors and len(errors) < _MAX_ERRORS:
                errors.append(error)
    summary: dict[str, Any] = {
        "saves": sum(t["attempts"] for t in saves),
        "failed_saves": sum(t["failures"] for t in saves),
        "rank_loads": sum(t["attempts"] for t in loads),
        "failed_rank_loads": sum(t["failures"] for t in loads),
        "reader_loads": reader["attempts"],
        "failed_reader_loads": reader["failures"],
        "wall_seconds": round(wall, 3),
        "errors": errors,
        "hazards": None,
        "hazard_kinds": None,
        "writes_per_rank": None,
        "truncations": None,
        "ops_per_rank": None,
        "reader_ops": None,
    }
    summary["loads"] = summary["rank_loads"] + summary["reader_loads"]
    summary["failed_loads"] = summary["failed_rank_loads"] + summary["failed_reader_loads"]
    if hazards is not None:
        summary["hazards"] = len(hazards)
        summary["hazard_kinds"] = dict(Counter(str(h.get("kind")) for h in hazards))
    if ops is not None:
        per_rank = [dict(ops.of(rank_pids[r])) for r in ranks]
        reader_ops = dict(ops.of(reader_pid)) if reader_pid is not None else {}
        summary["ops_per_rank"] = per_rank
        summary["reader_ops"] = reader_ops
        summary["writes_per_rank"] = [sum(o.get(k, 0) for k in WRITE_OPS) for o in per_rank]
        summary["truncations"] = sum(o.get(k, 0) for o in [*per_rank, reader_ops] for k in TRUNCATING_OPS)
    return summary


def safeio_problems(result: dict[str, Any]) -> list[str]:
    """What went wrong in the safeio pattern (it must have none of these)."""
    s = result["patterns"]["safeio"]
    checks = [
        ("hazards", s["hazards"]),
        ("failed saves", s["failed_saves"]),
        ("failed loads", s["failed_loads"]),
        ("in-place truncations", s["truncations"]),
    ]
    found = [f"{value} {name}" for name, value in checks if value]
    if s["writes_per_rank"] is not None and any(s["writes_per_rank"][1:]):
        found.append(f"non-writer ranks wrote to the shared directory ({s['writes_per_rank']})")
    if s["failed_saves"] or s["failed_loads"]:
        found += [f"error: {e}" for e in s["errors"][:2]]
    return found


def _na(value: Any) -> str:
    return "n/a" if value is None else str(value)


def render(result: dict[str, Any]) -> str:
    u, s = (result["patterns"][p] for p in PATTERNS)
    ranks = "/".join(str(r) for r in range(result["ranks"]))
    counted = result["backend"] == "nfslike"

    def writes(summary: dict[str, Any]) -> str:
        w = summary["writes_per_rank"]
        return "n/a" if w is None else "/".join(str(n) for n in w)

    rows = [
        ("hazards (blocked truncations/reads)", _na(u["hazards"]), _na(s["hazards"])),
        ("failed saves", f"{u['failed_saves']}/{u['saves']}", f"{s['failed_saves']}/{s['saves']}"),
        (
            "failed loads, ranks",
            f"{u['failed_rank_loads']}/{u['rank_loads']}",
            f"{s['failed_rank_loads']}/{s['rank_loads']}",
        ),
        (
            "failed loads, reader",
            f"{u['failed_reader_loads']}/{u['reader_loads']}",
            f"{s['failed_reader_loads']}/{s['reader_loads']}",
        ),
        ("in-place truncations (O_TRUNC)", _na(u["truncations"]), _na(s["truncations"])),
        (f"shared-fs writes, rank {ranks}", writes(u), writes(s)),
        ("wall time", f"{u['wall_seconds']:.2f} s", f"{s['wall_seconds']:.2f} s"),
    ]
    left = max(len(r[0]) for r in rows)
    mid = max(len("unguarded"), *(len(r[1]) for r in rows))
    right = max(len("safeio"), *(len(r[2]) for r in rows))
    lines = [f"{'':<{left}}  {'unguarded':>{mid}}  {'safeio':>{right}}"]
    lines += [f"{name:<{left}}  {a:>{mid}}  {b:>{right}}" for name, a, b in rows]
    lines.append("")
    for pattern in PATTERNS:
        lines.append(f"{pattern}: {DESCRIPTIONS[pattern]}")
    where = "the NFS-like FUSE mount" if counted else "a local temporary directory"
    lines.append(
        f"{result['ranks']} ranks (gloo on loopback) x {result['iterations']} saves each, on {where}, "
        "with a reader process loading in a loop."
    )
    if counted:
        lines.append(
            f"A truncation of a file another process holds open waited {result['hazard_timeout']:g} s, then "
            "failed (a real NFS client waits forever: the 35-hour hang)."
        )
    else:
        lines.append(
            "Hazards and per-rank writes need the NFS-like mount (FUSE); run with --nfslike to see them."
        )
    if u["errors"]:
        lines.append("unguarded errors, for example: " + "; ".join(u["errors"][:2]))
    return "\n".join(lines)
