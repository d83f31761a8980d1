"""``safeio demo``'s parent side: start the reader and the ranks, step them through the patterns, count.

The ranks run under ``safeio.testing.ranks.run_ranks`` in a worker thread, so that the main thread stays
free to talk to them (a queue up, an event per pattern down), to read the mount's counters between
patterns, and to receive Ctrl-C, after which it kills them through their Process objects.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from safeio.cli import _demo_table
from safeio.cli._demo_env import Workspace
from safeio.cli._demo_work import DESCRIPTIONS, PATTERNS
from safeio.testing.ranks import exit_reason

# The demo gives up when nothing happened for this long (no message from a rank or the reader): not a
# bound on the whole run, which takes well under a minute on 2 quiet cores and several on a loaded
# machine (issue 37). The ranks are stopped by this process when it gives up, not by their own bound.
SILENCE = 240.0
RANKS_BOUND = 24 * 3600.0
# Imported once in the forkserver, so every rank and the reader fork with them already loaded.
PRELOAD = [
    "torch.distributed",
    "transformers.models.auto.tokenization_auto",
    "transformers.tokenization_utils_tokenizers",
    "transformers.modeling_utils",  # safeio.hf checks for models: 3.5 s to import on first use
    "safeio._saves.hf",
    "safeio.cli._demo_work",
]


class DemoFailed(Exception):
    pass


def _pid_state(pid: int | None) -> str:
    if pid is None:
        return "never started"
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return f"pid {pid}, gone"
    return f"pid {pid}, {'gone' if state in (b'Z', b'X') else 'running'}"  # Z: ended, not yet reaped


class Run:
    """The parent's side: start the reader and the ranks, step them through the patterns, count."""

    def __init__(self, workspace: Workspace, ranks: int, iterations: int, say: Callable[[str], None]) -> None:
        self.ws = workspace
        self.world = ranks
        self.iterations = iterations
        self.say = say
        self.method = os.environ.get("SAFEIO_MP_START", "forkserver")  # as safeio.testing.ranks
        self.ctx: Any = mp.get_context(self.method)
        self.deadline = time.monotonic() + SILENCE  # moved on by every message (see _handle)
        self.rank_pids: dict[int, int] = {}
        self.ready: set[int] = set()
        self.reader_pid: int | None = None
        self.reader_started: set[int] = set()
        self.reader_done: dict[int, dict[str, Any]] = {}
        self.progress: dict[int, dict[int, int]] = {i: {} for i in range(len(PATTERNS))}
        self.done: dict[int, dict[int, dict[str, Any]]] = {i: {} for i in range(len(PATTERNS))}
        self.rank_outcome: list[Any] | None = None
        self.rank_crash: BaseException | None = None

    def run(self) -> dict[str, Any]:
        from safeio.cli import _demo_work

        started = time.monotonic()
        self.say(f"starting {self.world} rank(s) and a reader (torch.distributed/gloo on loopback)...")
        if self.method == "forkserver":
            from multiprocessing import forkserver

            self.ctx.set_forkserver_preload(PRELOAD)
            forkserver.ensure_running()
        self.messages = self.ctx.Queue()
        self.commands = self.ctx.Queue()
        # Semaphores, not Events: Event.set() waits for every process sleeping in wait() to wake, so a
        # rank killed while it waited for its go hung the demo in set() for ever (issue 36).
        self.go = [self.ctx.Semaphore(0) for _ in PATTERNS]
        self.stops = [self.ctx.Event() for _ in PATTERNS]
        plan = {
            "iterations": self.iterations,
            "timeout": 120.0,
            "targets": {p: self.ws.target(p) for p in PATTERNS},
            "seeds": [self.ws.seed(p) for p in PATTERNS],
        }
        self.reader = self.ctx.Process(
            target=_demo_work.reader_main,
            args=(plan, self.commands, self.messages, self.stops),
            name="safeio-demo-reader",
            daemon=True,
        )
        self.worker = threading.Thread(
            target=self._ranks, args=(plan,), name="safeio-demo-ranks", daemon=True
        )
        try:
            self.reader.start()
            self.worker.start()
            self._pump_until(lambda: len(self.ready) == self.world and self.reader_pid is not None)
            pids = ", ".join(str(self.rank_pids[r]) for r in range(self.world))
            took = time.monotonic() - started
            self.say(f"  ready in {took:.1f} s (ranks: pid {pids}; reader: pid {self.reader_pid})")
            return self._steps()
        except DemoFailed as exc:  # which process stopped, or is still awaited, and why
            raise DemoFailed(f"{str(exc).rstrip()}\n{self._processes()}") from None
        finally:
            self._stop_children()

    def _ranks(self, plan: dict[str, Any]) -> None:
        from safeio.cli import _demo_work
        from safeio.testing.ranks import run_ranks

        try:
            args = (plan, self.messages, self.go)
            self.rank_outcome = run_ranks(
                _demo_work.rank_main, self.world, *args, timeout=RANKS_BOUND, check=False
            )
        except BaseException as exc:  # reported by the main thread
            self.rank_crash = exc

    def _steps(self) -> dict[str, Any]:
        patterns = {}
        for index, pattern in enumerate(PATTERNS):
            patterns[pattern] = self._pattern(index, pattern)
        self.commands.put(("quit",))
        self.worker.join(30.0)
        if self.rank_outcome is not None and not all(r.ok for r in self.rank_outcome):
            from safeio.testing.ranks import describe

            raise DemoFailed(f"a rank failed after the patterns ran:\n{describe(self.rank_outcome)}")
        return {
            "backend": self.ws.backend,
            "ranks": self.world,
            "iterations": self.iterations,
            "hazard_timeout": self.ws.hazard_timeout if self.ws.mount is not None else None,
            "rank_pids": [self.rank_pids[r] for r in range(self.world)],
            "reader_pid": self.reader_pid,
            "patterns": patterns,
        }

    def _pattern(self, index: int, pattern: str) -> dict[str, Any]:
        mount = self.ws.mount
        target = self.ws.target(pattern)
        self.say(f"{pattern}: {DESCRIPTIONS[pattern]}")
        hazards_before = 0
        if mount is not None:
            mount.reset_ops()
            hazards_before = len(mount.hazards())
        self.commands.put(("load", index, target))
        self._pump_until(lambda: index in self.reader_started)
        started = time.monotonic()
        for _ in range(self.world):
            self.go[index].release()
        self._pump_until(lambda: len(self.done[index]) == self.world)
        wall = time.monotonic() - started
        self.stops[index].set()
        self._pump_until(lambda: index in self.reader_done)
        self.say(f"  {pattern}: done in {wall:.1f} s")
        ops = mount.ops() if mount is not None else None
        hazards = mount.hazards()[hazards_before:] if mount is not None else None
        return _demo_table.summarize(
            self.done[index], self.reader_done[index], ops, hazards, self.rank_pids, self.reader_pid, wall
        )

    def _pump_until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            if time.monotonic() > self.deadline:
                raise DemoFailed(f"nothing happened for {SILENCE:g} s: the ranks or the reader are stuck")
            try:
                message = self.messages.get(timeout=0.2)
            except queue.Empty:
                self._check_alive()
                continue
            self._handle(message)

    def _check_alive(self) -> None:
        if not self.worker.is_alive():
            if self.rank_crash is not None:
                raise DemoFailed(f"the ranks could not run: {self.rank_crash!r}")
            # Ranks that all returned have run every pattern (each sends its "done" before it returns),
            # so what is still awaited is the reader's: on a loaded machine its last load outlasts the
            # ranks, which was reported as the ranks stopping early (issue 37).
            if self.rank_outcome is None or not all(r.ok for r in self.rank_outcome):
                from safeio.testing.ranks import describe

                raise DemoFailed(f"the ranks stopped early:\n{describe(self.rank_outcome or [])}")
        if not self.reader.is_alive():
            raise DemoFailed(f"the reader (pid {self.reader.pid}) {exit_reason(self.reader.exitcode)} early")

    def _processes(self) -> str:
        """Each process of the demo, by pid: what it had done (its last report) and whether it runs."""
        lines = []
        for rank in range(self.world):
            pid = self.rank_pids.get(rank)
            done = [PATTERNS[i] for i in range(len(PATTERNS)) if rank in self.done[i]]
            did = f"finished {', '.join(done)}" if done else "ready" if rank in self.ready else "not ready"
            lines.append(f"rank {rank} ({_pid_state(pid)}): {did}")
        read = [PATTERNS[i] for i in sorted(self.reader_done)]
        did = (
            f"finished {', '.join(read)}" if read else "ready" if self.reader_pid is not None else "not ready"
        )
        lines.append(f"reader ({_pid_state(self.reader.pid)}): {did}")
        return "\n".join(lines)

    def _handle(self, message: tuple[Any, ...]) -> None:
        self.deadline = time.monotonic() + SILENCE
        kind = message[0]
        if kind == "hello":
            self.rank_pids[message[1]] = message[2]
        elif kind == "ready":
            self.ready.add(message[1])
        elif kind == "reader-ready":
            self.reader_pid = message[1]
        elif kind == "reader-started":
            self.reader_started.add(message[1])
        elif kind == "reader-done":
            self.reader_done[message[1]] = message[2]
        elif kind == "progress":
            _, rank, index, iteration = message
            self.progress[index][rank] = iteration
            if all(self.progress[index].get(r, 0) >= iteration for r in range(self.world)):
                self.say(f"  {PATTERNS[index]}: iteration {iteration}/{self.iterations} done on every rank")
        elif kind == "done":
            self.done[message[2]][message[1]] = message[3]

    def _stop_children(self) -> None:
        # Runs on success, failure and Ctrl-C alike. Every process here was started by this demo and is
        # stopped through its own Process object; ranks still starting while we stop are caught by
        # looping until run_ranks (the worker thread) has seen every rank end.
        if self.reader.pid is not None:
            if self.reader.is_alive():
                self.reader.kill()
            self.reader.join(5.0)
        deadline = time.monotonic() + 15.0
        while self.worker.is_alive() and time.monotonic() < deadline:
            for child in mp.active_children():
                if child.name.startswith("safeio-rank-"):
                    child.kill()
            self.worker.join(0.2)
        for q in (self.messages, self.commands):
            q.close()
            q.cancel_join_thread()
