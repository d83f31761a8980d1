"""Run a function on N ranks of a real torch.distributed job (gloo over loopback).

Rank 0 hosts the TCPStore, as under torchrun; every rank gets ``RANK``/``WORLD_SIZE``/``MASTER_*`` in its
environment and an initialized default process group. The parent collects each rank's return value or
exception (pickled, with its traceback) and kills every rank that has not finished by ``timeout``.

Connecting is a phase of its own: every rank reports that its group is up and waits for the parent's go
before it calls the function. gloo does not always honour its own connect timeout: beside 8 CPU burners
two ranks sat 14 minutes in ``gloo::transport::tcp::Pair::waitUntilConnected`` inside
``init_process_group`` with a 300 s timeout (issue 37). Ranks that have not all connected by that timeout
plus a grace are killed and started again on a new port, before any of them ran the function; so are
ranks whose rank 0 found the port taken by another process between ``free_port`` and its listen.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

_START_METHOD = os.environ.get("SAFEIO_MP_START", "forkserver")

# A group that has not connected by its own timeout plus this grace is hung in gloo, not slow: gloo
# raises at its timeout when it notices. The ranks are then started anew, at most _CONNECT_ATTEMPTS times.
_CONNECT_GRACE = 60.0
_CONNECT_ATTEMPTS = 3
_CONNECTED = "connected"


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
    go: Any,
    init_timeout: float,
    leave: Any,
    run_timeout: float,
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
        results.put((_CONNECTED, rank))
        # The parent says go once every rank connected, or kills this attempt; the bound only keeps a
        # rank from outliving a parent that died.
        if not go.wait(2 * (init_timeout + _CONNECT_GRACE)):
            raise TimeoutError(f"rank {rank}: the parent never said go after the group connected")
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
        if rank == 0:
            # Rank 0 hosts the store: it stays until every other rank has reported or ended, as the
            # store under torchrun (its agent's) outlives the ranks. Leaving at once, it took the store
            # with it while a peer still read the writer's published answer ("Broken pipe", issue 37).
            leave.wait(run_timeout + _CONNECT_GRACE)
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
    rank's exception or a timeout raises RanksFailed describing every rank. ``timeout`` bounds the run
    from the moment every rank connected, generously by default: it only ends a run that hangs, and a
    loaded machine (a shared CI runner) must not end one that works. The process group's own timeout
    (connecting the ranks, a collective, a store request) is ``timeout`` up to 300 s: with 60 s, 8 ranks
    on a loaded 2-core machine failed to connect ("Gloo connectFullMesh failed ... Connect timeout").
    A group hung in connecting past that timeout is started again (see the module's docstring).
    """
    ctx: Any = mp.get_context(_START_METHOD)
    if _START_METHOD == "forkserver":
        # Imported once in the fork server, inherited by every rank: a rank starts in milliseconds
        # instead of importing torch and transformers anew (missing modules are skipped).
        ctx.set_forkserver_preload(PRELOAD)
    connect_timeout = min(timeout, 300.0)
    bound = connect_timeout + _CONNECT_GRACE
    for attempt in range(1, _CONNECT_ATTEMPTS + 1):
        ranks = _Attempt(ctx, fn, world_size, args, dict(env or {}), connect_timeout, timeout)
        if ranks.connect(bound):
            break
        ranks.stop()
        why = (
            f"the store's port {ranks.port} was taken before rank 0 listened on it"
            if ranks.port_taken()
            else f"still connecting after {bound:.0f} s (gloo past its own timeout of "
            f"{connect_timeout:.0f} s)"
        )
        print(
            f"safeio.testing.ranks: {world_size} ranks {why}, attempt {attempt} of {_CONNECT_ATTEMPTS}",
            file=sys.stderr,
        )
    else:
        why = f"did not connect: {_CONNECT_ATTEMPTS} attempt(s) of {bound:.0f} s each"
        hung = [RankResult(rank, None, TimeoutError(f"rank {rank} {why}")) for rank in range(world_size)]
        if check:
            raise RanksFailed(describe(hung))
        return hung
    out = ranks.finish(timeout)
    if check and not all(r.ok for r in out):
        raise RanksFailed(describe(out))
    return out


class _Attempt:
    """One start of the ranks: connect them, let them run, collect what each reported."""

    def __init__(
        self,
        ctx: Any,
        fn: Callable[..., Any],
        world_size: int,
        args: tuple[Any, ...],
        env: dict[str, str],
        connect_timeout: float,
        run_timeout: float,
    ) -> None:
        self.world_size = world_size
        self.results = ctx.Queue()
        self.go = ctx.Event()
        self.leave = ctx.Event()
        self.port = port = free_port()
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(
                    *(fn, rank, world_size, port, args, env, self.results),
                    *(self.go, connect_timeout, self.leave, run_timeout),
                ),
                name=f"safeio-rank-{rank}",
            )
            for rank in range(world_size)
        ]
        self.connected: set[int] = set()
        self.collected: dict[int, RankResult] = {}
        for proc in self.procs:
            proc.start()

    def connect(self, bound: float) -> bool:
        """Wait until every rank connected (then say go) or one gave up; False if still hung at ``bound``."""
        deadline = time.monotonic() + bound
        while len(self.connected | set(self.collected)) < self.world_size:
            # A rank that failed to connect reported its error: the run ends as it would have anyway.
            if self.collected or not self._receive(deadline):
                break
        if self.port_taken():
            return False  # no rank may go on: one that connected may have reached another job's store
        self.go.set()
        settled = len(self.connected | set(self.collected)) == self.world_size or bool(self.collected)
        # Ranks that all ended without a word (killed, crashed) are reported as such by finish().
        return settled or not any(proc.is_alive() for proc in self.procs)

    def port_taken(self) -> bool:
        """Whether rank 0 could not listen on the port ``free_port`` gave, because another process took
        it in between (EADDRINUSE). Two suites on one machine (issue 37's stress pair): rank 0 failed at
        once, and the other ranks tried to connect to that port for the group's whole timeout, 300 s."""
        return any(
            result.rank not in self.connected and "EADDRINUSE" in str(result.error)
            for result in self.collected.values()
        )

    def finish(self, timeout: float) -> list[RankResult]:
        deadline = time.monotonic() + timeout
        while len(self.collected) < self.world_size and self._receive(deadline):
            pass
        timed_out = self.stop(deadline)
        out = []
        for rank, proc in enumerate(self.procs):
            if rank in self.collected:
                out.append(self.collected[rank])
            else:
                # A rank killed from outside is not one that timed out (the demo called a rank killed by
                # SIGKILL "timed out", issue 36): only the ranks killed here at the deadline did.
                reason = "timed out" if rank in timed_out else exit_reason(proc.exitcode)
                out.append(
                    RankResult(rank, None, TimeoutError(f"rank {rank} {reason} without reporting"), "")
                )
        return out

    def _receive(self, deadline: float) -> bool:
        """Take one report; False at the deadline, or once every rank reported or ended and nothing is
        left to read."""
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                report = self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                # Every rank reported or ended (rank 0, the store's host, waits to be told to leave).
                settled = (rank in self.collected or not p.is_alive() for rank, p in enumerate(self.procs))
                if all(settled) and self.results.empty():
                    return False
                continue
            if report[0] == _CONNECTED:
                self.connected.add(report[1])
            else:
                rank, value, error, tb = report
                self.collected[rank] = RankResult(rank, value, error, tb)
            return True
        return False

    def stop(self, deadline: float | None = None) -> set[int]:
        """End every rank still running (after a short join when a deadline is left); those it killed."""
        self.leave.set()
        killed = set()
        for rank, proc in enumerate(self.procs):
            wait = 0.0 if deadline is None else max(0.0, min(5.0, deadline - time.monotonic()))
            proc.join(timeout=wait)
            if proc.is_alive():
                killed.add(rank)
                proc.kill()
                proc.join(5)
        self.results.close()
        return killed


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
