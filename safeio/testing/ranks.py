"""Run a function on N ranks of a real torch.distributed job (gloo over loopback).

Rank 0 hosts the TCPStore, as under torchrun; every rank gets ``RANK``/``WORLD_SIZE``/``MASTER_*`` in its
environment and an initialized default process group. The parent collects each rank's return value or
exception (pickled, with its traceback) and kills every rank that has not finished by ``timeout``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

_START_METHOD = os.environ.get("SAFEIO_MP_START", "forkserver")


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


class RanksFailed(AssertionError):
    """Some ranks raised or never finished; the message holds every rank's story."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    env: dict[str, str],
    results: Any,
    init_timeout: float,
) -> None:
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=init_timeout)
        )
        value = fn(rank, world_size, *args)
    except BaseException as exc:
        payload: tuple[Any, ...]
        try:
            import pickle

            pickle.dumps(exc)
            payload = (rank, None, exc, traceback.format_exc())
        except Exception:
            payload = (rank, None, RuntimeError(f"{type(exc).__name__}: {exc}"), traceback.format_exc())
        results.put(payload)
    else:
        results.put((rank, value, None, ""))
    finally:
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()


# transformers imports lazily: the modules safeio's patch wraps (processing_utils alone takes ~1.7 s)
# and those the ranks' saves and loads use are imported here once, not in every rank of every call.
PRELOAD = [
    "torch.distributed",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.tokenization_utils_base",
    "transformers.tokenization_utils_tokenizers",
    "transformers.models.auto.tokenization_auto",
    "transformers.processing_utils",
    "transformers.image_processing_base",
    "transformers.feature_extraction_utils",
    "transformers.video_processing_utils",
    "transformers.configuration_utils",
    "transformers.generation.configuration_utils",
    "safeio",
]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 1200.0,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> list[RankResult]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return one result per rank.

    ``fn`` must be importable by module path (a module-level function). With ``check`` (default) any
    rank's exception or a timeout raises RanksFailed describing every rank. ``timeout`` bounds the whole
    run, generously by default: it only ends a run that hangs, and a loaded machine (a shared CI runner)
    must not end one that works. The process group's own timeout (connecting the ranks, a collective, a
    store request) is ``timeout`` up to 300 s: with 60 s, 8 ranks on a loaded 2-core machine failed to
    connect ("Gloo connectFullMesh failed ... Connect timeout").
    """
    ctx: Any = mp.get_context(_START_METHOD)
    if _START_METHOD == "forkserver":
        # Imported once in the fork server, inherited by every rank: a rank starts in milliseconds
        # instead of importing torch and transformers anew (missing modules are skipped).
        ctx.set_forkserver_preload(PRELOAD)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, args, dict(env or {}), results, min(timeout, 300.0)),
            name=f"safeio-rank-{rank}",
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, RankResult] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, value, error, tb = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            collected[rank] = RankResult(rank, value, error, tb)
    finally:
        timed_out = set()
        for rank, proc in enumerate(procs):
            proc.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            if proc.is_alive():
                timed_out.add(rank)
                proc.kill()
                proc.join(5)
        results.close()
    out = []
    for rank, proc in enumerate(procs):
        if rank in collected:
            out.append(collected[rank])
        else:
            # A rank killed from outside is not one that timed out (the demo called a rank killed by
            # SIGKILL "timed out", issue 36): only the ranks killed here at the deadline did.
            reason = "timed out" if rank in timed_out else exit_reason(proc.exitcode)
            out.append(RankResult(rank, None, TimeoutError(f"rank {rank} {reason} without reporting"), ""))
    if check and not all(r.ok for r in out):
        raise RanksFailed(describe(out))
    return out


def exit_reason(code: int | None) -> str:
    """How a process ended, from its ``exitcode``: "was killed by SIGKILL", "exited with code 3"."""
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def describe(results: list[RankResult]) -> str:
    lines = []
    for r in results:
        if r.ok:
            lines.append(f"rank {r.rank}: ok -> {r.value!r}")
        else:
            lines.append(f"rank {r.rank}: {type(r.error).__name__}: {r.error}\n{r.traceback}")
    return "\n".join(lines)
