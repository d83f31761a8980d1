"""What recovery reports, shared by every behaviour's recovery and by ``safeio gc``."""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass

from safeio._storage.dirfd import lstat_at, open_directory, skip_unreadable, walk
from safeio._storage.names import Sibling


@dataclass(frozen=True)
class Action:
    """Something recovery did (or, in a dry run, would do)."""

    verb: str  # "remove", "restore", "roll-forward", "skip", "failed" (reason: the error)
    path: str
    reason: str
    size: int = 0


@dataclass(frozen=True)
class Leftover:
    """A stale sibling a dead writer left beside a target, and why it was judged stale.

    ``parent_fd`` is the held parent directory; every step on the leftover is relative to it.
    """

    sibling: Sibling
    parent: str
    parent_fd: int
    reason: str

    @property
    def name(self) -> str:
        return self.sibling.name

    @property
    def path(self) -> str:
        return os.path.join(self.parent, self.sibling.name)

    @property
    def size(self) -> int:
        return tree_size(self.parent_fd, self.sibling.name)


def tree_size(dir_fd: int, name: str) -> int:
    """Bytes of the regular files under ``name`` (or of ``name`` itself), following no link."""
    st = lstat_at(dir_fd, name)
    if st is None:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size
    total = 0
    with contextlib.suppress(OSError):
        fd = open_directory(name, dir_fd=dir_fd)
        try:
            total = sum(
                s.st_size
                for listing in walk(fd, max_relative=None, onerror=skip_unreadable)  # any depth
                for _name, s in listing.entries
                if stat.S_ISREG(s.st_mode)
            )
        finally:
            os.close(fd)
    return total
