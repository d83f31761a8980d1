"""Injected faults: a byte budget (ENOSPC), EIO on fsync, latency, and hangs on a path pattern.

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
from typing import Any

logger = logging.getLogger("safeio.testing.nfslike")

FAULT_NAMES = ("enospc_after", "eio_on_fsync", "latency", "hang", "hang_timeout")


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
    ) -> None:
        self._lock = threading.Lock()
        self._written = 0
        self._released = threading.Event()
        self.enospc_after = enospc_after
        self.eio_on_fsync = eio_on_fsync
        self.latency = latency
        self.hang = hang
        self.hang_timeout = hang_timeout

    def update(self, settings: dict[str, Any]) -> None:
        unknown = set(settings) - set(FAULT_NAMES)
        if unknown:
            raise ValueError(f"unknown nfslike faults: {sorted(unknown)}")
        with self._lock:
            for name, value in settings.items():
                setattr(self, name, value)
            if "hang" in settings:
                self._released.clear()  # a new hang pattern is armed until released again
            if "enospc_after" in settings:
                self._written = 0
        logger.info("faults updated: %s", settings)

    def release(self) -> None:
        """Let every hung operation proceed, and stop hanging new ones."""
        self._released.set()

    def enter(self, *paths: str | None) -> None:
        """Called at the start of every operation on `paths`."""
        if self.latency:
            time.sleep(self.latency)
        if _matches(self.hang, paths) and not self._released.is_set():
            # A hard NFS mount whose server stopped answering: the call neither fails nor returns.
            logger.info("hanging operation on %s", paths)
            if not self._released.wait(self.hang_timeout):
                raise OSError(errno.EIO, f"nfslike: hang on {paths[0]} timed out")

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
