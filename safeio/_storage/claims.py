"""The sibling names this process is using right now, so that its own recovery leaves them alone.

Recovery removes a sibling whose owner is gone. When the owner is this very process, the pid says
nothing: a stage an earlier save here left behind is stale, while one a save in another thread is still
filling is not. Every writer therefore claims a sibling's name before it creates it and releases the name
once the sibling is renamed into place, removed, or left for recovery; recovery here skips a claimed name.

Claims are taken before the sibling exists because a thread that recovers can list the directory at any
moment: a stage made first and claimed afterwards was once removed by a background thread's save of the
same target in that gap (CI, ``test_identity.py::test_shapes_on_local_disk[threads]``). Names, not paths,
are claimed: two saves may spell one parent differently, and a sibling's name is unique by itself (it
carries this process's pid and a random part).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_claimed: set[str] = set()


def claim(name: str) -> str:
    """Claim ``name`` (before creating it) until ``release``; returns it."""
    with _lock:
        _claimed.add(name)
    return name


def release(name: str) -> None:
    with _lock:
        _claimed.discard(name)


def is_claimed(name: str) -> bool:
    with _lock:
        return name in _claimed


@contextlib.contextmanager
def claimed(name: str) -> Iterator[str]:
    """``name`` claimed for the block: a sibling that lives only inside one step of a save."""
    claim(name)
    try:
        yield name
    finally:
        release(name)
