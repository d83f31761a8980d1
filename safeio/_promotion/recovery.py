"""What recovery reports, shared by every behaviour's recovery and by ``safeio gc``."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from safeio._storage.names import Sibling


@dataclass(frozen=True)
class Action:
    """Something recovery did (or, in a dry run, would do)."""

    verb: str  # "remove", "restore", "roll-forward", "skip"
    path: str
    reason: str
    size: int = 0


@dataclass(frozen=True)
class Leftover:
    """A stale sibling a dead writer left beside a target, and why it was judged stale."""

    sibling: Sibling
    path: str
    parent: str
    reason: str

    @property
    def size(self) -> int:
        return tree_size(self.path)


def tree_size(path: str) -> int:
    if os.path.islink(path) or not os.path.isdir(path):
        try:
            return os.lstat(path).st_size
        except OSError:
            return 0
    total = 0
    for dirpath, _dirnames, filenames in os.walk(path):
        for name in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total
