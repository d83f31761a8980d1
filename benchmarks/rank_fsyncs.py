"""Figure 11 — a durable checkpoint with DCP's own fsync off costs what DCP's own fsync costs.

``dcp.save`` fsyncs each rank's files on that rank by default (``FileSystemWriter(sync_files=True)``);
with it off, a durable ``Checkpoints`` still makes every file durable before the commit's rename. Before
issue 26 the writer did so alone, one file after another, while every other rank waited; now every rank
syncs a share of the stage's files at the same time, after the bodies and before the commit. Both
methods save the same state on 4 gloo ranks through a durable ``Checkpoints`` (and a 1 MB tokenizer,
written by the writer), interleaved, timed from the first rank entering to the last returning.
"""

from __future__ import annotations

import os
import time
from typing import Any

from benchmarks._core import Result, Row, Spread, fs_type, ratio_row, ratios, scratch
from benchmarks._ranks import sharded_state, time_on_ranks, walls

NAME = "rank_fsyncs"
WORLD = 4
METHODS = ("dcp fsync on", "dcp fsync off")


def _rank(rank: int, world: int, reps: int, root: str, megabytes: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    import safeio
    from safeio.testing.hf_objects import fast_tokenizer

    tok = fast_tokenizer(words=50_000)
    state = sharded_state(megabytes, rank, WORLD)
    # keep=1: the state of old steps would otherwise fill the disk at 1 GB and more.
    ckpts = {
        m: safeio.Checkpoints(os.path.join(root, m.replace(" ", "-")), keep=1, timeout=600) for m in METHODS
    }

    bodies: dict[str, list[float]] = {m: [] for m in METHODS}  # when this rank's body ended, per rep
    commits: dict[str, list[float]] = {m: [] for m in METHODS}  # when this rank's save returned

    def through(method: str, sync_files: bool) -> Any:
        def save(rep: int) -> None:
            with ckpts[method].save(rep) as ckpt:
                dcp.save(state, storage_writer=dcp.FileSystemWriter(ckpt.path, sync_files=sync_files))
                safeio.save_pretrained(tok, ckpt.path)
                bodies[method].append(time.monotonic())
            commits[method].append(time.monotonic())
            ckpts[method].wait()  # the retired step's deletion (background) is not the next method's cost

        return save

    methods = {
        "dcp fsync on": through("dcp fsync on", True),
        "dcp fsync off": through("dcp fsync off", False),
    }
    spans = time_on_ranks(methods, reps, warmup=1)
    # The warm-up repetition dropped, as time_on_ranks does.
    return {
        "spans": spans,
        "bodies": {m: ends[1:] for m, ends in bodies.items()},
        "commits": {m: ends[1:] for m, ends in commits.items()},
    }


def run(quick: bool, *, disk: str) -> Result:
    from safeio.testing.ranks import run_ranks

    sizes = (64,) if quick else (256, 1024)
    reps = 2 if quick else 5
    result = Result(
        NAME,
        "11. Durable checkpoints with DCP's fsync off: every rank syncs its share",
        __doc__.split("\n\n", 1)[1].strip(),
        params={"world": WORLD, "sizes_mb": list(sizes), "reps": reps, "disk": disk, "fs": fs_type(disk)},
    )
    for megabytes in sizes:
        with scratch(disk) as root:
            values = [r.value for r in run_ranks(_rank, WORLD, reps, root, megabytes, timeout=3600)]
        per_rank = [v["spans"] for v in values]
        wall = {m: walls(per_rank, m) for m in METHODS}
        # After the last body: the reports, the fsyncs safeio makes, the manifest and the rename (not the
        # retired step's deletion, which runs in the background and is joined outside this span).
        commit = {
            m: [
                max(v["commits"][m][i] for v in values) - max(v["bodies"][m][i] for v in values)
                for i in range(reps)
            ]
            for m in METHODS
        }
        result.samples[f"{megabytes}MB commit"] = commit
        result.samples[f"{megabytes}MB"] = wall
        result.rows.append(
            ratio_row(
                f"11. durable Checkpoints.save, DCP fsync off / on, {WORLD} ranks, {megabytes} MB of state",
                "wall time of a whole durable checkpoint when safeio makes DCP's files durable (shared out "
                "among the ranks) over DCP syncing its own",
                "≤ 1.1x",
                ratios(wall["dcp fsync off"], wall["dcp fsync on"]),
                1.1,
            )
        )
        for method in METHODS:
            result.rows.append(
                Row(
                    f"11. from the last body's end to the last rank's return, {method}, {megabytes} MB",
                    "the commit: reports, the fsyncs safeio makes (every file again when DCP synced them "
                    "already: clean, cheap), manifest, rename",
                    "informational",
                    Spread.of(commit[method]).scaled(1000),
                    "ms",
                    None,
                )
            )
    return result
