"""Open file handles of the mount, keyed by backing file descriptor.

The interlock asks "which other processes hold this inode open", silly rename asks "is this inode
open at all on this mount"; both wait on the table's condition for handles to come and go.
"""

from __future__ import annotations

import dataclasses
import threading

InodeKey = tuple[int, int]  # (st_dev, st_ino) of the backing file


@dataclasses.dataclass(frozen=True)
class Handle:
    fh: int  # the backing file descriptor, also the FUSE file handle
    key: InodeKey
    pid: int  # process (thread group) that opened it
    path: str  # mount-relative path at open time, for globs once the name is gone


class HandleTable:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._by_fh: dict[int, Handle] = {}
        self._count: dict[InodeKey, int] = {}

    def add(self, handle: Handle) -> None:
        with self.cond:
            self._by_fh[handle.fh] = handle
            self._count[handle.key] = self._count.get(handle.key, 0) + 1
            self.cond.notify_all()

    def remove(self, fh: int) -> tuple[Handle | None, bool]:
        """Forget `fh`; returns the handle and whether it was the last one on its inode."""
        with self.cond:
            handle = self._by_fh.pop(fh, None)
            if handle is None:
                return None, False
            left = self._count[handle.key] - 1
            if left:
                self._count[handle.key] = left
            else:
                del self._count[handle.key]
            self.cond.notify_all()
            return handle, left == 0

    def get(self, fh: int | None) -> Handle | None:
        if fh is None:
            return None
        with self.cond:
            return self._by_fh.get(fh)

    def is_open(self, key: InodeKey) -> bool:
        with self.cond:
            return key in self._count

    def pids_holding(self, key: InodeKey, *, exclude: int) -> set[int]:
        """Processes other than `exclude` with a handle on `key`. Call with `cond` held."""
        if key not in self._count:
            return set()
        return {h.pid for h in self._by_fh.values() if h.key == key and h.pid != exclude}
