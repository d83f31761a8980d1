"""Operation counters per client process.

FUSE reports the calling *thread* id (the kernel fills the request header from task_pid(current)),
so threads of one process (a Rust writer in `tokenizers`, torch's workers) are folded into their
process id through /proc/<tid>/status.
"""

from __future__ import annotations

import threading
from collections import Counter

# Operation names. "open_*" classify every open and create by its flags (one of read/write, plus
# trunc when it truncated an existing file, plus create when it made the file).
OPS = (
    "open_read",
    "open_write",
    "open_trunc",
    "open_create",
    "read",
    "read_bytes",
    "write",
    "write_bytes",
    "fsync",
    "fsyncdir",
    "truncate",
    "rename",
    "unlink",
    "mkdir",
    "rmdir",
    "silly_rename",
    "flock",
    "lock",
)

_TGID_CACHE_MAX = 4096


def _read_tgid(tid: int) -> int:
    try:
        with open(f"/proc/{tid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return tid  # the thread is gone (or pid 0 for kernel-initiated requests): keep what we have


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[int, Counter[str]] = {}
        self._tgid: dict[int, int] = {}

    def process_of(self, tid: int) -> int:
        tgid = self._tgid.get(tid)
        if tgid is None:
            tgid = _read_tgid(tid)
            if len(self._tgid) >= _TGID_CACHE_MAX:
                self._tgid.clear()  # thread ids get reused; a bounded cache bounds staleness too
            self._tgid[tid] = tgid
        return tgid

    def add(self, pid: int, op: str, n: int = 1) -> None:
        with self._lock:
            counts = self._counts.get(pid)
            if counts is None:
                counts = self._counts[pid] = Counter()
            counts[op] += n

    def snapshot(self) -> dict[int, dict[str, int]]:
        with self._lock:
            return {pid: {op: n for op, n in counts.items() if n} for pid, counts in self._counts.items()}

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()
