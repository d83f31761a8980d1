"""Figure 6 — a whole checkpoint: ``safeio.Checkpoints.save`` over what it replaces, on 4 gloo ranks.

The baseline is the plain pattern: ``dcp.save`` on every rank into ``step_N`` plus the tokenizer saved
by rank 0 and a barrier (no staging, no commit, no ``latest``; ``dcp.save`` fsyncs each rank's shard and
the ``.metadata``, as ``FileSystemWriter(sync_files=True)`` does by default, nothing else is fsynced).
safeio's save does the same writes into a stage, then reports, commits (manifest, rename, ``latest``)
and, here, keeps every step. Both are timed from the first rank entering to the last returning,
interleaved, at two state sizes: the ratio shows the commit's cost, the difference between sizes whether
that cost grows with the checkpoint.
"""

from __future__ import annotations

import os
from typing import Any

from benchmarks._core import Result, Row, Spread, ratio_row, ratios, scratch
from benchmarks._ranks import sharded_state, time_on_ranks, walls

NAME = "checkpoints"
WORLD = 4
METHODS = ("plain", "safeio durable=False", "safeio")


def _rank(rank: int, world: int, reps: int, root: str, megabytes: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import safeio
    from safeio.testing.hf_objects import fast_tokenizer

    tok = fast_tokenizer(words=50_000)
    state = sharded_state(megabytes, rank, WORLD)
    ckpts = {
        "safeio": safeio.Checkpoints(os.path.join(root, "safeio"), keep=None, timeout=600),
        "safeio durable=False": safeio.Checkpoints(
            os.path.join(root, "fast"), keep=None, timeout=600, durable=False
        ),
    }

    def plain(rep: int) -> None:
        path = os.path.join(root, "plain", f"step_{rep}")
        dcp.save(state, checkpoint_id=path)
        if rank == 0:
            tok.save_pretrained(path)
        dist.barrier()

    def through(which: str) -> Any:
        def save(rep: int) -> None:
            with ckpts[which].save(rep) as ckpt:
                dcp.save(state, checkpoint_id=ckpt.path)
                safeio.save_pretrained(tok, ckpt.path)

        return save

    methods = {
        "plain": plain,
        "safeio durable=False": through("safeio durable=False"),
        "safeio": through("safeio"),
    }
    return {"spans": time_on_ranks(methods, reps, warmup=1)}


def run(quick: bool, *, disk: str) -> Result:
    from safeio.testing.ranks import run_ranks

    sizes = (16, 64) if quick else (64, 256)
    reps = 2 if quick else 5
    result = Result(
        NAME,
        "6. Whole checkpoints: Checkpoints.save over dcp.save + tokenizer",
        __doc__.split("\n\n", 1)[1].strip(),
        params={"world": WORLD, "sizes_mb": list(sizes), "reps": reps, "disk": disk},
    )
    medians: dict[int, dict[str, float]] = {}
    for megabytes in sizes:
        with scratch(disk) as root:
            per_rank = [
                r.value["spans"] for r in run_ranks(_rank, WORLD, reps, root, megabytes, timeout=1800)
            ]
        wall = {m: walls(per_rank, m) for m in METHODS}
        medians[megabytes] = {m: Spread.of(wall[m]).median for m in METHODS}
        result.samples[f"{megabytes}MB"] = wall
        result.rows.append(
            ratio_row(
                f"6. Checkpoints.save durable=False / plain, {WORLD} ranks, {megabytes} MB of state",
                "wall time of a whole checkpoint (every rank's shards and a 1 MB tokenizer), safeio over the "
                "unstaged pattern",
                "≤ 1.05x",
                ratios(wall["safeio durable=False"], wall["plain"]),
                1.05,
            )
        )
        result.rows.append(
            ratio_row(
                f"6. Checkpoints.save (durable) / plain, {WORLD} ranks, {megabytes} MB",
                "the same with every file, the stage and the root fsynced (dcp.save fsyncs each rank's shard "
                "and its .metadata in both patterns, FileSystemWriter(sync_files=True) by default; the plain "
                "pattern fsyncs neither the tokenizer nor any directory)",
                "informational",
                ratios(wall["safeio"], wall["plain"]),
                None,
            )
        )
    small, large = sizes
    cost = {s: medians[s]["safeio durable=False"] - medians[s]["plain"] for s in sizes}
    result.rows.append(
        Row(
            "6. commit cost at the larger size minus at the smaller (durable=False)",
            f"safeio's extra seconds per checkpoint at {large} MB minus at {small} MB: flat means the commit "
            "does not grow with the checkpoint",
            "≈ 0 (flat)",
            Spread.of([cost[large] - cost[small]]).scaled(1000),
            "ms",
            None,
        )
    )
    return result
