"""A bound on a stretch of test code by its progress, not by wall time (issue 37).

A wall-clock alarm cannot tell a hang from a loaded machine: on 2 cores beside a dozen busy processes, a
hostile-share case that builds a 3,000-level tree took longer than its 30 s alarm and failed as "still
running". What a hang looks like instead is a process that does nothing: ``stall_alarm`` samples, once a
second, the CPU time of this process (every thread) and of its descendants, and the voluntary context
switches of its threads (each blocking request answered — a FUSE operation served by a daemon that the
load starves — is one). The code is hung when none of them moved for ``stalled_after`` seconds: a FIFO
opened blindly, a lock never released, a peer that never answers. A sample taken late counts as progress
too: the process was running, runnable, or in a kernel wait that ended (an fsync behind a busy disk).
``ceiling`` (wall time) stays as the backstop for a loop that spins for ever, or that polls with sleeps
(each sleep is a context switch), and is far above anything load does to a working case.

The sampler's own work (reading /proc) is not counted: each sample is taken before the sampler works and
compared with the previous one taken after it. The signal that wakes a blocked process costs it one
context switch per sample, so one or two per second are not progress.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

__all__ = ["Hung", "stall_alarm"]

_TICK = 1.0  # seconds between samples
_CPU_STEP = 0.002  # seconds of CPU between two samples that count as progress (the sampler costs ~0.1 ms)
_SWITCH_STEP = 3  # voluntary context switches between two samples that count as progress


class Hung(Exception):
    pass


def _own_switches() -> int:
    total = 0
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


def _descendants_cpu(root: int) -> int:
    """CPU clock ticks of every live descendant of ``root`` (one scan of /proc), plus its reaped ones."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry)
        parents[pid] = int(fields[1])
        ticks[pid] = int(fields[11]) + int(fields[12])  # utime, stime
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo += children.get(pid, [])
    reaped = os.times()
    return total + round((reaped.children_user + reaped.children_system) * os.sysconf("SC_CLK_TCK"))


@contextlib.contextmanager
def stall_alarm(stalled_after: float, *, ceiling: float) -> Iterator[None]:
    """Raise `Hung` in the main thread when the block made no progress for ``stalled_after`` seconds, or
    after ``ceiling`` seconds whatever it does. Uses SIGALRM (ITIMER_REAL): not for a block that sets
    its own alarm, unless it restores the timer after (as ``tests._hostile_cases.alarm`` does)."""
    began = time.monotonic()
    me = os.getpid()
    last: dict[str, float] = {
        "cpu": time.process_time(),
        "switches": _own_switches(),
        "children": _descendants_cpu(me),
        "at": began,
    }
    still_since = began

    def sample(signum: int, frame: object) -> None:
        nonlocal still_since
        now = time.monotonic()
        cpu = time.process_time()  # before this sampler's own work
        switches = _own_switches()
        children = _descendants_cpu(me)
        moved = (
            # Late: the process could not take the signal for a while, so it was running (or runnable
            # and waiting for a CPU), or in an uninterruptible wait in the kernel that has just ended
            # (an fsync behind a disk that load keeps busy took 30 s here). A wait in the kernel that
            # never ends never runs this either, as with any alarm.
            now - last["at"] >= 2 * _TICK
            or cpu - last["cpu"] >= _CPU_STEP
            or switches - last["switches"] >= _SWITCH_STEP
            or children != last["children"]
        )
        last.update(cpu=time.process_time(), switches=_own_switches(), children=children, at=time.monotonic())
        if moved:
            still_since = now
        elif now - still_since >= stalled_after:
            raise Hung(f"no progress for {now - still_since:.0f} s (no CPU time, no request answered)")
        if now - began >= ceiling:
            raise Hung(f"still running after {ceiling:g} s, though making progress (a loop that never ends?)")

    previous = signal.signal(signal.SIGALRM, sample)
    outer = signal.setitimer(signal.ITIMER_REAL, _TICK, _TICK)  # pytest-timeout's, in a test process
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer != (0.0, 0.0):
            left = outer[0] - (time.monotonic() - began)
            signal.setitimer(signal.ITIMER_REAL, max(left, 0.001), outer[1])
