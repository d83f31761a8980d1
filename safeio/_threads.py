"""safeio's background threads (an async save's commit, retired steps' deletion): finished at exit, bounded.

The interpreter joins a non-daemon thread at exit without any bound, before the ``atexit`` handlers run: a
deletion stuck on a dead NFS server, or a commit waiting for a peer that died, would keep the process
alive, and ``torchrun`` waits for every rank (which it starts in sessions of their own, so a kill of the
launcher's process group does not end them). So these threads are daemons, and one ``atexit`` handler
joins each for at most its own bound; a thread still running then is left with a warning naming it (what
it leaves on disk is the next save's recovery, or ``safeio gc``'s).
"""

from __future__ import annotations

import atexit
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

from safeio._stalls import Cadence, seconds
from safeio._who import who

__all__ = ["start_background"]

logger = logging.getLogger("safeio")


@dataclass(frozen=True)
class _Started:
    thread: threading.Thread
    bound: float  # how long the exit waits for it, in seconds
    describe: Callable[[], str] | None  # where it is, for the lines of a long wait at exit
    warn_after: float


_lock = threading.Lock()
_started: list[_Started] = []


def start_background(
    target: Callable[[], None],
    *,
    name: str,
    bound: float,
    describe: Callable[[], str] | None = None,
    warn_after: float = math.inf,
) -> threading.Thread:
    """Start ``target`` on a thread the process waits for at exit, ``bound`` seconds at most; while the
    exit waits longer than ``warn_after``, it says so (with ``describe()``, where the thread is)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    with _lock:
        _started[:] = [s for s in _started if s.thread.is_alive()]
        _started.append(_Started(thread, bound, describe, warn_after))
    thread.start()
    return thread


@atexit.register
def finish_at_exit() -> None:
    """Join every background thread still running, each for at most its bound. Registered when safeio is
    imported, so it runs after the handlers of what is imported later (atexit runs them last-in first-out)
    and before logging's own shutdown."""
    with _lock:
        running = [s for s in _started if s.thread.is_alive()]
        _started.clear()
    for started in running:
        thread, bound = started.thread, started.bound
        cadence = Cadence(started.warn_after)
        while thread.is_alive() and cadence.elapsed() < bound:
            thread.join(min(cadence.due_in(), bound - cadence.elapsed()))
            elapsed = cadence.take() if thread.is_alive() else None
            if elapsed is not None:
                where = started.describe() if started.describe is not None else "running"
                logger.warning(
                    "%s: exiting: still waiting after %s s (at most %g s) for %r: %s",
                    who(),
                    seconds(elapsed),
                    bound,
                    thread.name,
                    where,
                )
        if thread.is_alive():
            logger.warning(
                "%s: exiting with %r still running after its bound (%g s): left unfinished",
                who(),
                thread.name,
                bound,
            )
