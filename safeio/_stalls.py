"""When a stall is told, and what is told of a thread: one rule for every wait and every slow phase.

The job this library exists for sat 35 hours with nothing in its logs. Whatever is slow in safeio says
so — the rank stuck in a phase (``safeio._diagnostics.watchdog``), every rank waiting for another
(``safeio._coordination``), the process waiting at exit for its background threads (``safeio._threads``)
— on one cadence: the first line once ``warn_after`` seconds have passed, then each time the elapsed
time has doubled, at most ``MAX_GAP`` apart, so that a long stall is neither silent nor a flood; and the
lines of a stalled rank and of the ranks waiting for it come out together.
"""

from __future__ import annotations

import math
import sys
import time
import traceback

MAX_GAP = 600.0
_STACK_FRAMES = 40


def next_line(elapsed: float) -> float:
    """The elapsed time at which the line after one told at ``elapsed`` is due."""
    return min(2 * elapsed, elapsed + MAX_GAP)


class Cadence:
    """The lines about one wait, from ``start`` (``time.monotonic()``; default now). ``warn_after``
    ``inf``: never a line."""

    def __init__(self, warn_after: float, start: float | None = None) -> None:
        self.start = time.monotonic() if start is None else start
        self._due = warn_after  # elapsed seconds at which the next line is due

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def due_in(self) -> float:
        """Seconds until the next line is due (never negative; ``inf``: never)."""
        return max(0.0, self._due - self.elapsed()) if math.isfinite(self._due) else math.inf

    def take(self) -> float | None:
        """If a line is due, the elapsed time to tell (and the next one is scheduled); else None."""
        elapsed = self.elapsed()
        if elapsed < self._due:
            return None
        self._due = next_line(elapsed)
        return elapsed


def seconds(value: float) -> str:
    """A duration for a stall line: tenths below 10 s (a short ``warn_after``), whole seconds above."""
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


def thread_stack(ident: int | None) -> str:
    """Where in Python the thread ``ident`` is now (most recent call last)."""
    frame = sys._current_frames().get(ident if ident is not None else -1)
    if frame is None:
        return "  (the thread has exited)\n"
    return "".join(traceback.format_stack(frame, limit=_STACK_FRAMES))
