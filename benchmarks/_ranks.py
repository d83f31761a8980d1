"""Helpers for the multi-rank benchmarks: synchronised, interleaved timing on every rank."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any


def time_on_ranks(
    methods: Mapping[str, Callable[[int], object]], reps: int, warmup: int
) -> dict[str, list[list[float]]]:
    """On every rank: per repetition, each method once (rotating order, identical on every rank),
    each started right after a barrier. Returns method -> [[start, end], ...] in CLOCK_MONOTONIC,
    which is one clock for all processes of a machine, so the parent can take max(end) - min(start)."""
    import torch.distributed as dist

    names = list(methods)
    spans: dict[str, list[list[float]]] = {name: [] for name in names}
    for rep in range(warmup + reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.monotonic()
            methods[name](rep)
            end = time.monotonic()
            if rep >= warmup:
                spans[name].append([start, end])
    dist.barrier()
    return spans


def walls(per_rank: list[dict[str, list[list[float]]]], method: str) -> list[float]:
    """Per repetition: from the first rank entering to the last rank returning, in seconds."""
    reps = len(per_rank[0][method])
    return [
        max(r[method][i][1] for r in per_rank) - min(r[method][i][0] for r in per_rank) for i in range(reps)
    ]


def sharded_state(megabytes: int, rank: int, world: int) -> dict[str, Any]:
    """``rank``'s part of ``megabytes`` of state, sharded as DCP sees it: each rank owns a distinct slice
    (a plain float32 tensor per rank, keyed by rank)."""
    import torch

    per_rank = megabytes * (1 << 20) // world // 4
    return {f"shard{rank}": torch.full((per_rank,), float(rank))}
