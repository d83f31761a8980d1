"""The watchdog: a phase that lasts too long becomes a WARNING, from the rank stuck in it, with its stack.

The job this library exists for sat 35 hours in uninterruptible NFS waits with nothing in its logs. A
thread in the kernel's ``D`` state cannot be interrupted from Python, so the watchdog never tries to
stop the save; it makes the stall visible: which rank, host and pid, which phase of which path, for how
long, what the user can do, and where in Python the watched thread is. Warnings repeat while the phase
lasts on the cadence of ``safeio._stalls`` (after ``warn_after``, then each time the elapsed time has
doubled), the one every waiting rank's progress lines follow. A phase that is itself a wait for another
rank (``source.waiting``) is told by the waiting lines instead, which name the rank waited for.

It watches the writer of a replicated save (its ``Channel``) and every rank of a checkpoint's calls
(its ``RankStatus``), and refreshes their published phase record every few seconds, so that a waiting
peer can say how long ago the rank it waits for was last heard from: a process that is alive but stuck
keeps being heard; a dead one goes quiet.

One daemon thread per process serves every watched save (starting a thread per save would cost about
0.25 ms, half of a whole tokenizer save), and a second one sends the heartbeats (see ``_Monitor``). They
are started by the first save of the process (also in a forked child, which inherits no threads) and
sleep without waking while nothing is watched. At exit they are told to leave at once and joined,
briefly (``_EXIT_BOUND``): a heartbeat must not be caught inside a store call while the interpreter tears
the process down.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Protocol

from safeio._diagnostics.collectives import active_section, blocked_in_collective
from safeio._stalls import next_line, thread_stack
from safeio._who import who

logger = logging.getLogger("safeio")

HEARTBEAT_EVERY = 5.0  # a TCPStore set costs well under a millisecond
_EXIT_BOUND = 2.0  # at exit, how long each of the two threads may take to leave (a heartbeat in flight)


class PhaseSource(Protocol):
    """What the watchdog reads (a replicated save's ``Channel`` on its writer; a checkpoint call's
    ``RankStatus`` on every rank). A source whose ``waiting`` is true is in a wait for another rank:
    no stall warning then (the wait's own lines name the rank it waits for), heartbeats go on."""

    @property
    def phase(self) -> str: ...
    @property
    def phase_since(self) -> float: ...  # time.time() when the phase began
    @property
    def target_url(self) -> str: ...
    def heartbeat(self, *, wait: bool = True) -> None: ...


class Watchdog:
    """Watches the phases of one save; ``start()`` it on the thread that does the work (its stack is the
    one told), ``stop()`` it after. ``role`` names that thread's part in messages ("the writer", "this
    rank"); ``advice(phase)`` says what the user can do about a stall in ``phase``."""

    def __init__(
        self,
        source: PhaseSource,
        warn_after: float,
        *,
        rank: int | None = None,
        heartbeat_every: float | None = None,
        role: str = "the writer",
        advice: Callable[[str], str] | None = None,
    ) -> None:
        self.source = source
        self.warn_after = warn_after
        self.rank = rank
        self.role = role
        self.advice = advice
        # At least as often as a warning, so that "last heard" stays meaningful with a short warn_after.
        self.heartbeat_every = (
            min(HEARTBEAT_EVERY, warn_after) if heartbeat_every is None else heartbeat_every
        )
        self.warnings = 0
        self._writer_ident: int | None = None
        self._writer_name = ""
        self._current: tuple[str, float] | None = None
        self._warned_in_phase = False
        self._warn_at = math.inf  # wall clock, like the channel's phase_since
        self._next_beat = math.inf  # monotonic
        self._stopped = False

    def start(self) -> Watchdog:
        writer = threading.current_thread()
        self._writer_ident, self._writer_name = writer.ident, writer.name
        if math.isfinite(self.heartbeat_every) and self.heartbeat_every > 0:
            self._next_beat = time.monotonic() + self.heartbeat_every
        self._observe(self.source.phase, self.source.phase_since, time.time())
        _monitor.add(self)
        return self

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        _monitor.remove(self)
        if self._warned_in_phase and self._current is not None:
            self._left(self._current[0], time.time() - self._current[1])

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _observe(self, phase: str, since: float, now: float) -> None:
        if (phase, since) == self._current:
            return
        if self._current is not None and self._warned_in_phase:
            self._left(self._current[0], now - self._current[1])
        self._current, self._warned_in_phase = (phase, since), False
        self._warn_at = since + self.warn_after

    def tick(self) -> float:
        """Warn if due (on the monitor thread); seconds until the next warning is due."""
        if self._stopped:
            return math.inf
        phase, since = self.source.phase, self.source.phase_since
        now = time.time()
        self._observe(phase, since, now)
        if now >= self._warn_at:
            elapsed = now - since
            # A wait for another rank is told by the waiting lines (getattr: a replicated save's Channel,
            # the writer's, never waits for its peers).
            if not getattr(self.source, "waiting", False):
                self._warn(phase, elapsed)
            self._warn_at = since + next_line(elapsed)
        return self._warn_at - time.time()

    def beat_in(self) -> float:
        """Seconds until the next heartbeat is due."""
        return math.inf if self._stopped else self._next_beat - time.monotonic()

    def beat(self) -> None:
        """Refresh the published phase record (on the heartbeat thread)."""
        if self._stopped:
            return
        # Never wait for the channel: the writer thread may be publishing a new phase itself.
        self.source.heartbeat(wait=False)
        self._next_beat = time.monotonic() + self.heartbeat_every

    def due(self) -> float:
        """Seconds until this watch needs the monitor again."""
        return min(self._warn_at - time.time(), self.beat_in())

    def _stack(self) -> tuple[str, str]:
        """The watched thread's stack, and what it says about a collective it is blocked in."""
        frame = sys._current_frames().get(self._writer_ident or -1)
        if frame is None:
            return "  (the thread has exited)\n", ""
        return thread_stack(self._writer_ident), self._collective_note(frame)

    def _collective_note(self, frame: FrameType) -> str:
        collective = blocked_in_collective(frame)
        if collective is None:
            return ""
        section = active_section(self._writer_ident)
        if section is None:
            return f" The writer is blocked in torch.distributed.{collective}(), waiting for the other ranks."
        # A collective bound before the section (``from torch.distributed import barrier``) or reached
        # without a Python-level lookup escapes the section's check; it never returns.
        return (
            f" The writer is blocked in torch.distributed.{collective}() inside the writer-only save of "
            f"{section}: only the writer runs this code, so the other ranks never join and it will not "
            "return. Collective and sharded saves must run on every rank (safeio.Checkpoints)."
        )

    def _warn(self, phase: str, elapsed: float) -> None:
        self.warnings += 1
        self._warned_in_phase = True
        path = self.source.target_url
        stack, collective = self._stack()
        advice = f" {self.advice(phase)}" if self.advice is not None else ""
        logger.warning(
            "%s: %s has been in %s of %s for %.1f s (warn_after %g s); the save goes on, "
            "this is a warning only.%s%s Stack of thread %r (most recent call last):\n%s",
            who(self.rank),
            self.role,
            phase,
            path,
            elapsed,
            self.warn_after,
            advice,
            collective,
            self._writer_name,
            stack,
            extra={"safeio_phase": phase, "safeio_path": path, "safeio_elapsed": elapsed},
        )

    def _left(self, phase: str, elapsed: float) -> None:
        # Closes the story a stall warning opened: a reader of the log must not assume it still hangs.
        path = self.source.target_url
        logger.warning(
            "%s: %s left %s of %s after %.1f s",
            who(self.rank),
            self.role,
            phase,
            path,
            elapsed,
            extra={"safeio_phase": phase, "safeio_path": path, "safeio_elapsed": elapsed},
        )


class _Monitor:
    """The one thread that ticks every started Watchdog of this process, and its heartbeat thread.

    Heartbeats run on a thread of their own: a TCPStore client serialises its requests, so a heartbeat
    sent while another thread of the process waits on the store (a writer whose body waits for a key,
    a peer of another save) waits with it, and the warnings must not wait for anything.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._watches: set[Watchdog] = set()
        self._thread: threading.Thread | None = None
        self._wake_at = 0.0  # monotonic time the thread will next look at its watches
        self._added = 0  # counts add() calls, so a watch added during a round is not slept past
        self._beats: queue.SimpleQueue[Watchdog | None] = queue.SimpleQueue()  # None: leave
        self._pending: set[Watchdog] = set()  # queued or in progress on the heartbeat thread
        self._beater: threading.Thread | None = None
        self._stopping = False

    def add(self, watch: Watchdog) -> None:
        due = time.monotonic() + watch.due()
        with self._cond:
            self._watches.add(watch)
            self._added += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="safeio-watchdog", daemon=True)
                self._thread.start()
            elif due < self._wake_at:
                self._cond.notify()  # the thread sleeps past this watch's first warning or heartbeat

    def remove(self, watch: Watchdog) -> None:
        with self._cond:
            self._watches.discard(watch)  # no wake-up: the thread finds the watch gone on its own

    def _run(self) -> None:
        while True:
            with self._cond:
                watches, seen = list(self._watches), self._added
            pause = math.inf  # nothing watched: sleep until add() or stop() wakes the thread
            for watch in watches:
                try:
                    pause = min(pause, watch.tick(), self._schedule_beat(watch))
                except Exception:  # the watchdog must outlive any one broken save
                    logger.exception("%s: the safeio watchdog failed on %s", who(), watch.source.target_url)
            now = time.monotonic()
            with self._cond:
                if self._stopping:
                    self._thread = None
                    return
                if self._added != seen:
                    continue  # a save started during this round: look at it before sleeping
                pause = max(pause, 0.01)
                self._wake_at = now + pause
                self._cond.wait(pause if math.isfinite(pause) else None)

    def _schedule_beat(self, watch: Watchdog) -> float:
        """Queue the watch's heartbeat if due; seconds until the monitor must look at it again for that."""
        with self._cond:
            if watch in self._pending:
                return math.inf  # still queued or blocked in the store: do not pile up more
            due = watch.beat_in()
            if due > 0:
                return due
            self._pending.add(watch)
            self._beats.put(watch)
            if self._beater is None or not self._beater.is_alive():
                self._beater = threading.Thread(target=self._beat_loop, name="safeio-heartbeat", daemon=True)
                self._beater.start()
            return math.inf

    def _beat_loop(self) -> None:
        while True:
            watch = self._beats.get()  # blocks without waking while nothing is watched
            if watch is None:  # stop(): the process is exiting
                return
            try:
                watch.beat()
            except Exception:
                logger.exception("%s: the safeio heartbeat failed on %s", who(), watch.source.target_url)
            finally:
                with self._cond:
                    self._pending.discard(watch)
                    if time.monotonic() + watch.beat_in() < self._wake_at:
                        self._cond.notify()  # the monitor sleeps past this watch's next beat

    def stop(self, bound: float) -> None:
        """At exit: both threads leave now (no new watch can come: every save has returned), each
        joined for at most ``bound`` seconds (a heartbeat blocked in the store is left to the exit)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            threads = [t for t in (self._thread, self._beater) if t is not None]
        self._beats.put(None)
        for thread in threads:
            thread.join(bound)

    def reset_after_fork(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._watches = set()
        self._thread = None
        self._added = 0
        self._beats = queue.SimpleQueue()
        self._pending = set()
        self._beater = None
        self._stopping = False


_monitor = _Monitor()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_monitor.reset_after_fork)
atexit.register(_monitor.stop, _EXIT_BOUND)
