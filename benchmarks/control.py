"""Figure 5 — control-plane latency: what safeio's outcome broadcast and group wait cost at 2-8 ranks.

``safeio.replicated`` with an empty body (non-durable, on tmpfs, so the writer's filesystem work is
small) is timed from the first rank entering to the last rank returning, against a ``dist.barrier()``
round trip and ``broadcast_object_list`` of a small outcome on the default gloo group and on a separate
gloo ``new_group`` (the "side group" a NCCL job would need for CPU objects). safeio itself uses neither:
the writer sets a key in the job's TCPStore and peers ``store.wait`` on it (no collective, so a writer
that other code already guards with "rank 0 only" cannot hang).
"""

from __future__ import annotations

import os
from typing import Any

from benchmarks._core import Result, Row, Spread, fs_type, ratio_row, ratios, scratch
from benchmarks._ranks import time_on_ranks, walls

NAME = "control"
METHODS = (
    "dist.barrier",
    "broadcast_object_list (default group)",
    "broadcast_object_list (gloo side group)",
    "safeio.replicated (empty body)",
)


def _rank(rank: int, world: int, reps: int, base: str) -> dict[str, Any]:
    import torch.distributed as dist

    import safeio

    side = dist.new_group(backend="gloo")
    outcome = {"ok": True, "target": os.path.join(base, "t"), "writer_rank": 0, "value": None}

    def barrier(rep: int) -> None:
        dist.barrier()

    def broadcast(rep: int) -> None:
        dist.broadcast_object_list([outcome if rank == 0 else None], src=0)

    def broadcast_side(rep: int) -> None:
        dist.broadcast_object_list([outcome if rank == 0 else None], src=0, group=side)

    def replicated(rep: int) -> None:
        with safeio.replicated(os.path.join(base, "target"), durable=False):
            pass

    methods = dict(zip(METHODS, (barrier, broadcast, broadcast_side, replicated), strict=True))
    return {"pid": os.getpid(), "spans": time_on_ranks(methods, reps, warmup=3)}


def run(quick: bool = False, tmpfs: str = "/dev/shm") -> Result:
    from safeio.testing.ranks import run_ranks

    worlds = [2] if quick else [2, 4, 8]
    reps = 5 if quick else 80
    result = Result(
        NAME,
        "5. Control-plane latency: outcome broadcast and group wait",
        "Wall time from the first rank entering to the last returning, per repetition, methods "
        f"interleaved after a barrier; safeio.replicated with an empty body, durable=False, target on "
        f"{tmpfs} ({fs_type(tmpfs)}). safeio publishes the outcome through the TCPStore (store.set / "
        "store.wait), not through a gloo side group; the side-group broadcast is the alternative design.",
        params={"worlds": worlds, "reps": reps},
    )
    series: dict[str, Any] = {m: {"x": [], "y": [], "lo": [], "hi": []} for m in METHODS}
    for world in worlds:
        with scratch(tmpfs) as base:
            per_rank = [r.value["spans"] for r in run_ranks(_rank, world, reps, base, timeout=300)]
        times = {m: walls(per_rank, m) for m in METHODS}
        result.samples[f"{world} ranks"] = times
        for m in METHODS:
            spread = Spread.of(times[m]).scaled(1e3)
            series[m]["x"].append(world)
            series[m]["y"].append(spread.median)
            series[m]["lo"].append(spread.lo)
            series[m]["hi"].append(spread.hi)
            result.rows.append(
                Row(f"{world} ranks: {m}", "wall time, entering to all returned", "-", spread, "ms")
            )
        safe = times["safeio.replicated (empty body)"]
        result.rows += [
            ratio_row(
                f"{world} ranks: safeio.replicated / dist.barrier",
                "a whole empty replicated save in barrier round trips",
                "- (no target set)",
                ratios(safe, times["dist.barrier"]),
                None,
            ),
            ratio_row(
                f"{world} ranks: safeio.replicated / broadcast_object_list (gloo side group)",
                "safeio's store-based outcome vs the side-group design (plus safeio's stage+rename)",
                "- (no target set)",
                ratios(safe, times["broadcast_object_list (gloo side group)"]),
                None,
            ),
        ]
    result.plots.append(
        {
            "title": "5. control-plane latency",
            "kind": "lines",
            "xlabel": "ranks",
            "ylabel": "ms (median, min-max)",
            "logy": True,
            "series": series,
        }
    )
    return result
