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
import threading
from collections.abc import Callable

from safeio._who import who

__all__ = ["start_background"]

logger = logging.getLogger("safeio")

_lock = threading.Lock()
_started: list[tuple[threading.Thread, float]] = []  # (thread, its bound at exit, in seconds)


def start_background(target: Callable[[], None], *, name: str, bound: float) -> threading.Thread:
    """Start ``target`` on a thread the process waits for at exit, ``bound`` seconds at most."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    with _lock:
        _started[:] = [(t, b) for t, b in _started if t.is_alive()]
        _started.append((thread, bound))
    thread.start()
    return thread


@atexit.register
def finish_at_exit() -> None:
    """Join every background thread still running, each for at most its bound. Registered when safeio is
    imported, so it runs after the handlers of what is imported later (atexit runs them last-in first-out)
    and before logging's own shutdown."""
    with _lock:
        running = [(t, b) for t, b in _started if t.is_alive()]
        _started.clear()
    for thread, bound in running:
        thread.join(bound)
        if thread.is_alive():
            logger.warning(
                "%s: exiting with %r still running after its bound (%g s): left unfinished",
                who(),
                thread.name,
                bound,
            )
