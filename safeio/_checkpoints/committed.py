"""Whether a step is committed, and waiting (bounded) until it is visible from this rank."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable

from safeio._errors import PeerTimeout
from safeio._storage import manifest

_FIRST_PAUSE = 0.02


def is_committed(path: str) -> bool:
    """Whether ``path`` is a committed checkpoint: a real directory (a link planted under a step's name
    is never one), its marker there, listing every file at its size."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    record = manifest.read(path)
    return record is not None and "step" in record and not manifest.problems(path, record, check_hashes=False)


def poll_until(visible: Callable[[], bool], deadline: float, message: str, path: str) -> None:
    """Return once ``visible()`` is true; PeerTimeout(``message``) at the deadline. A bounded poll with
    backoff: a cache expiring (NFS attributes, an object store client's listing) has nothing to block on."""
    pause = _FIRST_PAUSE
    while not visible():
        if time.monotonic() >= deadline:
            raise PeerTimeout(message, path)
        time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
        pause = min(pause * 2, 0.5)


def wait_visible(path: str, deadline: float, rank: int, what: str, *, manifest_needed: bool = True) -> None:
    """Return once ``path`` (a committed step, or a stage) is visible from this rank; bounded.

    NFS clients cache directory entries and attributes: a rank on another client may not see a
    directory for a while after the writer made it.
    """

    def visible() -> bool:
        try:
            st = os.lstat(path)
        except OSError:
            return False
        return stat.S_ISDIR(st.st_mode) and (not manifest_needed or is_committed(path))

    poll_until(visible, deadline, f"rank {rank}: {what} at {path} is still not visible from this rank", path)
