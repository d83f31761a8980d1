"""Figure 12 — how long an async checkpoint blocks training: safeio over bare ``dcp.async_save``.

``dcp.async_save`` returns once the state is staged (copied off the training tensors); the upload runs
on a background thread. Through safeio the same call sits in ``with ckpts.save(step) as ckpt:`` with
``ckpt.commit_after(future)``, and the commit (reports, manifest, rename, ``latest``) runs once the
upload is done, on a background thread too; what safeio adds before control returns to the training
loop is the stage's announcement and the bookkeeping of handing the commit over. Both methods also save
a 1 MB tokenizer (rank 0's ``save_pretrained`` in the plain pattern; ``safeio.save_pretrained`` on every
rank, which only the writer makes). Timed from the first rank entering to the last rank getting control
back, on 4 gloo ranks, interleaved; the uploads and commits are waited for outside the timed span.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from benchmarks._core import Result, Row, Spread, fs_type, ratio_row, ratios, scratch
from benchmarks._ranks import sharded_state, walls

NAME = "async_blocking"
WORLD = 4
METHODS = ("bare dcp.async_save", "safeio")


def _rank(rank: int, world: int, reps: int, root: str, megabytes: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import safeio
    from safeio.testing.hf_objects import fast_tokenizer

    tok = fast_tokenizer(words=50_000)
    state = sharded_state(megabytes, rank, WORLD)
    pg = dist.new_group(backend="gloo")  # DCP's background collectives, apart from the training's
    ckpts = safeio.Checkpoints(os.path.join(root, "safeio"), keep=1, timeout=600)

    def bare(rep: int) -> Callable[[], None]:
        path = os.path.join(root, "bare", f"step_{rep}")
        future = dcp.async_save(state, checkpoint_id=path, process_group=pg)
        if rank == 0:
            tok.save_pretrained(path)
        return future.result

    def through(rep: int) -> Callable[[], None]:
        with ckpts.save(rep) as ckpt:
            ckpt.commit_after(dcp.async_save(state, checkpoint_id=ckpt.path, process_group=pg))
            safeio.save_pretrained(tok, ckpt.path)
        return ckpts.wait

    methods = {"bare dcp.async_save": bare, "safeio": through}
    names = list(methods)
    spans: dict[str, list[list[float]]] = {name: [] for name in names}
    warmup = 1
    for rep in range(warmup + reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.monotonic()
            finish = methods[name](rep)
            end = time.monotonic()
            finish()  # the upload (and safeio's commit): not blocking training, not timed
            if rep >= warmup:
                spans[name].append([start, end])
    dist.barrier()
    return {"spans": spans}


def run(quick: bool, *, disk: str) -> Result:
    from safeio.testing.ranks import run_ranks

    # The target's size, and a small one: there what safeio adds stands out of the noise in milliseconds.
    sizes = (1, 64) if quick else (1, 512)
    reps = 3 if quick else 15
    result = Result(
        NAME,
        "12. Async checkpoints: the time training is blocked, safeio / bare dcp.async_save",
        __doc__.split("\n\n", 1)[1].strip(),
        params={"world": WORLD, "sizes_mb": list(sizes), "reps": reps, "disk": disk, "fs": fs_type(disk)},
    )
    for megabytes in sizes:
        with scratch(disk) as root:
            per_rank = [
                r.value["spans"] for r in run_ranks(_rank, WORLD, reps, root, megabytes, timeout=3600)
            ]
        wall = {m: walls(per_rank, m) for m in METHODS}
        result.samples[f"{megabytes}MB"] = wall
        result.rows.append(
            ratio_row(
                f"12. time an async save blocks training, safeio / bare dcp.async_save, {WORLD} ranks, "
                f"{megabytes} MB of state",
                "from the first rank entering the save to the last getting control back (upload and commit "
                "on background threads, waited for outside the span)",
                "≤ 1.05x" if megabytes == sizes[-1] else "informational",
                ratios(wall["safeio"], wall["bare dcp.async_save"]),
                1.05 if megabytes == sizes[-1] else None,
            )
        )
        added = [a - b for a, b in zip(wall["safeio"], wall["bare dcp.async_save"], strict=True)]
        result.rows.append(
            Row(
                f"12. what safeio adds to the blocked time, {megabytes} MB",
                "per repetition, safeio's blocked time minus bare dcp.async_save's (the stage's announcement, "
                "the writer's result of the tokenizer save heard by the other ranks, handing the commit over)",
                "informational",
                Spread.of(added).scaled(1000),
                "ms",
                None,
            )
        )
    return result
