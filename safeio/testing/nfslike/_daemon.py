"""Serving the filesystem: mfusepy's libfuse3 glue (with the arguments it drops restored) and
the daemon's main loop. Runs only inside the daemon process.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import mfusepy

from safeio.testing.nfslike._control import ControlServer
from safeio.testing.nfslike._fs import NfsLikeFS
from safeio.testing.nfslike._options import Options
from safeio.testing.nfslike._state import StateDir

logger = logging.getLogger("safeio.testing.nfslike")

_UTIME_NOW = (1 << 30) - 1
_UTIME_OMIT = (1 << 30) - 2


def _timespec_ns(ts: Any) -> int | None:
    if ts.tv_nsec == _UTIME_OMIT:
        return None
    if ts.tv_nsec == _UTIME_NOW:
        return time.time_ns()
    return int(ts.tv_sec) * 1_000_000_000 + int(ts.tv_nsec)


class _FUSE(mfusepy.FUSE):  # type: ignore[misc]  # mfusepy is untyped
    """mfusepy's libfuse3 glue with the arguments it drops passed through.

    mfusepy 3.1 calls `rename(old, new)` without renameat2's flags (so RENAME_EXCHANGE silently
    becomes a plain rename), and drops the file handle of ftruncate/fchmod/fchown/futimens (so an
    open but unlinked file cannot be reached) and UTIME_NOW/UTIME_OMIT. These overrides replace
    only those callbacks; mfusepy picks `<name>_fuse_3` methods by name when building the
    operations table.
    """

    def _decode(self, path: bytes | None) -> str | None:
        return None if path is None else path.decode(self.encoding, self.errors)

    @staticmethod
    def _fh(fip: Any) -> int | None:
        return int(fip.contents.fh) if fip else None

    def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
        self.operations.rename(self._decode(old), self._decode(new), flags)
        return 0

    def truncate_fuse_3(self, path: bytes | None, length: int, fip: Any) -> int:
        self.operations.truncate(self._decode(path), length, self._fh(fip))
        return 0

    def chmod_fuse_3(self, path: bytes | None, mode: int, fip: Any) -> int:
        self.operations.chmod(self._decode(path), mode, self._fh(fip))
        return 0

    def chown_fuse_3(self, path: bytes | None, uid: int, gid: int, fip: Any) -> int:
        # (uid_t)-1 / (gid_t)-1 mean "leave unchanged", as os.chown's -1 does.
        uid = -1 if uid == 0xFFFFFFFF else uid
        gid = -1 if gid == 0xFFFFFFFF else gid
        self.operations.chown(self._decode(path), uid, gid, self._fh(fip))
        return 0

    def utimens_fuse_3(self, path: bytes | None, buf: Any, fip: Any) -> int:
        if buf:
            times = (_timespec_ns(buf.contents.actime), _timespec_ns(buf.contents.modtime))
        else:
            now = time.time_ns()
            times = (now, now)
        self.operations.utimens(self._decode(path), times, self._fh(fip))
        return 0


def serve(
    backing: str, mountpoint: str, options: Options, state: StateDir, control: str, *, debug: bool = False
) -> None:
    """Mount and serve until unmounted or signalled; blocks."""
    if mfusepy.fuse_version_major != 3:
        raise RuntimeError(f"nfslike needs libfuse 3, found {mfusepy.fuse_version_major}")
    fs = NfsLikeFS(backing, options, state)
    server = ControlServer(control, fs.control_handlers())
    server.start()
    logger.info("serving %s at %s with %s", fs.root, mountpoint, options)
    try:
        _FUSE(fs, mountpoint, debug=debug, **options.fuse_kwargs())
    finally:
        server.close()
        state.write_ops(fs.counters.snapshot())
        logger.info("unmounted %s", mountpoint)
