"""The NFS inode interlock between a truncation and other processes' I/O.

The failure this reproduces (a 32-rank job hung for 35 hours): every rank called save_pretrained
on one directory of a hard-mounted NFS share. One rank, truncating a file (O_TRUNC), sat in
do_truncate -> nfs_setattr holding the inode lock, waiting for I/O on the inode to drain; the other
ranks had the same file open and sat in nfs_start_io_read -> down_read behind that lock. Nobody
could proceed and no error was ever raised.

Here a truncation of an inode that another process holds open waits for those handles to close,
and reads and writes that other processes issue on the inode meanwhile wait behind it. Unlike the
kernel, the wait is bounded: the truncation then fails with EDEADLK, the I/O stuck behind it with
EIO, and each writes a hazard record, so a test sees the hazard instead of hanging.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from safeio.testing.nfslike._handles import HandleTable, InodeKey

logger = logging.getLogger("safeio.testing.nfslike")

TRUNCATE_BLOCKED = "truncate_blocked_by_open_file"
IO_BLOCKED = "io_blocked_behind_truncate"

# Slack past the truncater's own bound before blocked I/O gives up on its own.
_IO_SLACK = 1.0


@dataclasses.dataclass
class _Pending:
    truncater: int
    aborted: bool = False


class Interlock:
    def __init__(
        self, handles: HandleTable, timeout: float, record: Callable[[dict[str, Any]], None]
    ) -> None:
        self._handles = handles
        self._timeout = timeout
        self._record = record
        self._pending: dict[InodeKey, _Pending] = {}

    def _hazard(
        self, kind: str, op: str, path: str, truncater: int, others: list[int], waited: float
    ) -> None:
        record = {
            "kind": kind,
            "op": op,
            "path": path,
            "truncater": truncater,
            "others": others,
            "waited": round(waited, 3),
            "time": time.time(),
        }
        logger.warning("nfslike hazard: %s", record)
        self._record(record)

    @contextlib.contextmanager
    def truncating(self, key: InodeKey, pid: int, op: str, path: str) -> Iterator[None]:
        """Hold the inode for a truncation by `pid`; raises EDEADLK when the bound runs out."""
        cond = self._handles.cond
        start = time.monotonic()
        deadline = start + self._timeout
        with cond:
            # nfs_setattr serialises truncations on the inode lock: a second one queues behind.
            while key in self._pending:
                if not cond.wait(max(0.0, deadline - time.monotonic())) and key in self._pending:
                    other = self._pending[key].truncater
                    self._hazard(TRUNCATE_BLOCKED, op, path, pid, [other], time.monotonic() - start)
                    raise OSError(errno.EDEADLK, "nfslike: truncation deadlocked behind another truncation")
            pending = self._pending[key] = _Pending(pid)
            while others := self._handles.pids_holding(key, exclude=pid):
                if not cond.wait(max(0.0, deadline - time.monotonic())):
                    others = self._handles.pids_holding(key, exclude=pid)
                    if not others:
                        break
                    # Poison the I/O queued behind us before letting go of the inode.
                    pending.aborted = True
                    del self._pending[key]
                    cond.notify_all()
                    self._hazard(TRUNCATE_BLOCKED, op, path, pid, sorted(others), time.monotonic() - start)
                    raise OSError(
                        errno.EDEADLK,
                        f"nfslike: truncation of a file open in processes {sorted(others)} deadlocked",
                    )
        try:
            yield  # the truncation itself; I/O of other processes still waits behind it
        finally:
            with cond:
                if self._pending.get(key) is pending:
                    del self._pending[key]
                cond.notify_all()

    def before_io(self, key: InodeKey, pid: int, op: str, path: str) -> None:
        """Wait while another process's truncation holds the inode; EIO if that truncation failed."""
        cond = self._handles.cond
        with cond:
            pending = self._pending.get(key)
            if pending is None or pending.truncater == pid:
                return
            start = time.monotonic()
            deadline = start + self._timeout + _IO_SLACK
            while self._pending.get(key) is pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    pending.aborted = True
                    break
                cond.wait(remaining)
            if pending.aborted:
                self._hazard(IO_BLOCKED, op, path, pending.truncater, [pid], time.monotonic() - start)
                raise OSError(errno.EIO, "nfslike: I/O blocked behind a deadlocked truncation")
