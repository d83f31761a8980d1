"""``safeio.verify``, ``safeio.is_complete``, ``safeio.snapshot``: reading a promoted target, through its
back end's reader, for any caller (no rank logic)."""

from __future__ import annotations

import os

from safeio._options import flag
from safeio._promotion.backends import backend_for


def verify(path: str | os.PathLike[str], *, check_hashes: bool = True) -> list[str]:
    """Everything wrong with a promoted target against its manifest (empty when it is complete)."""
    backend = backend_for(path)
    return backend.reader().verify(check_hashes=flag(check_hashes, "check_hashes", backend.url()))


def is_complete(path: str | os.PathLike[str]) -> bool:
    """True when the target has its manifest (the commit marker) and every file it lists, at its size."""
    return not verify(path, check_hashes=False)


def snapshot(path: str | os.PathLike[str]) -> str:
    """The directory a reader should load from to see one consistent version.

    For a ``mode="versioned"`` target this resolves the link once, to an immutable version directory
    that stays for the grace period even if a writer publishes a newer one meanwhile; any other target
    is returned as it is.
    """
    return backend_for(path).reader().snapshot()
