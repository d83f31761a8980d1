"""Injected faults: a byte budget (ENOSPC), EIO on fsync, latency, and hangs on a path pattern
(optionally only of writes past an offset: a save stopped in the middle of its bytes).

Globs are matched with `fnmatch` against the mount-relative path without its leading "/"
(`*` also matches "/", so "*.json" matches "a/b/c.json"). The settings can be changed while
mounted through the control channel (`Mount.set_faults`).
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("safeio.testing.nfslike")

FAULT_NAMES = ("enospc_after", "eio_on_fsync", "latency", "hang", "hang_timeout", "hang_after_bytes")


def _matches(glob: str | None, paths: tuple[str | None, ...]) -> bool:
    return glob is not None and any(p is not None and fnmatch.fnmatchcase(p.lstrip("/"), glob) for p in paths)


class Faults:
    def __init__(
        self,
        *,
        enospc_after: int | None = None,
        eio_on_fsync: str | None = None,
        latency: float = 0.0,
        hang: str | None = None,
        hang_timeout: float | None = None,
        hang_after_bytes: int | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._written = 0
        self._released = threading.Event()
        self.enospc_after = enospc_after
        self.eio_on_fsync = eio_on_fsync
        self.latency = latency
        self.hang = hang
        self.hang_timeout = hang_timeout
        self.hang_after_bytes = hang_after_bytes
        self._hung: dict[int, tuple[int, str]] = {}  # per hung call: its caller's pid, its path

    def update(self, settings: dict[str, Any]) -> None:
        unknown = set(settings) - set(FAULT_NAMES)
        if unknown:
            raise ValueError(f"unknown nfslike faults: {sorted(unknown)}")
        with self._lock:
            for name, value in settings.items():
                setattr(self, name, value)
            if "hang" in settings:
                # A new pattern lets what the old one holds go (a test moves the hang from one
                # operation to the next), and is armed until released again.
                self._released.set()
                self._released = threading.Event()
            if "enospc_after" in settings:
                self._written = 0
        logger.info("faults updated: %s", settings)

    def release(self) -> None:
        """Let every hung operation proceed, and stop hanging new ones."""
        self._released.set()

    def hung(self) -> list[dict[str, Any]]:
        """The operations hanging now: the calling process and the path of each."""
        with self._lock:
            return [{"pid": pid, "path": path} for pid, path in self._hung.values()]

    def enter(
        self, *paths: str | None, write_offset: int | None = None, caller: Callable[[], int] | None = None
    ) -> None:
        """Called at the start of every operation on `paths`; `write_offset` for a write, where it
        starts in the file; `caller` gives the calling process's pid (asked only when it hangs)."""
        if self.latency:
            time.sleep(self.latency)
        released = self._released
        if not _matches(self.hang, paths) or released.is_set():
            return
        after = self.hang_after_bytes
        if after is not None and (write_offset is None or write_offset < after):
            return  # only the writes past `after` bytes hang: the file is left torn, not empty
        # A hard NFS mount whose server stopped answering: the call neither fails nor returns.
        logger.info("hanging operation on %s", paths)
        key = threading.get_ident()
        with self._lock:
            self._hung[key] = (caller() if caller is not None else 0, next(p for p in paths if p))
        try:
            if not released.wait(self.hang_timeout):
                raise OSError(errno.EIO, f"nfslike: hang on {paths[0]} timed out")
        finally:
            with self._lock:
                del self._hung[key]

    def charge_write(self, size: int) -> int:
        """Bytes of a `size`-byte write that still fit in the budget; ENOSPC when none do."""
        with self._lock:
            if self.enospc_after is None:
                self._written += size
                return size
            allowed = min(size, self.enospc_after - self._written)
            if allowed <= 0 and size > 0:
                raise OSError(errno.ENOSPC, "nfslike: byte budget exhausted")
            self._written += max(allowed, 0)
            return max(allowed, 0)

    def refund_write(self, size: int) -> None:
        with self._lock:
            self._written -= size

    def check_fsync(self, *paths: str | None) -> None:
        if _matches(self.eio_on_fsync, paths):
            # NFS reports a failed write-back (server out of space, lost connection) at fsync/close.
            raise OSError(errno.EIO, f"nfslike: injected EIO on fsync of {paths[0]}")
