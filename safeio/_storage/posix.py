"""POSIX primitives Python lacks: ``renameat2`` (exchange, no-replace), and which filesystems refuse it."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from functools import lru_cache
from typing import Any

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100


@lru_cache(maxsize=1)
def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def renameat2(
    src: str, dst: str, flags: int, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None
) -> None:
    """``renameat2(2)``, names relative to the directory descriptors if given (like ``os.rename``).

    Raises OSError (EINVAL/ENOSYS/EOPNOTSUPP where unsupported, as on NFS). Python has no wrapper, so
    this is the one ctypes call in safeio; tests exercise exchange and noreplace on tmpfs.
    """
    libc = _libc()
    func = getattr(libc, "renameat2", None)
    if func is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available in this C library", src)
    src_fd = _AT_FDCWD if src_dir_fd is None else src_dir_fd
    dst_fd = _AT_FDCWD if dst_dir_fd is None else dst_dir_fd
    result = func(src_fd, os.fsencode(src), dst_fd, os.fsencode(dst), ctypes.c_uint(flags))
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), src, None, dst)


EXCHANGE_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})
_noreplace_refused: set[int] = set()  # devices whose filesystem refused RENAME_NOREPLACE


def rename_noreplace(src: str, dst: str, dir_fd: int, *, flag: bool = True) -> None:
    """Rename ``src`` to ``dst`` in ``dir_fd`` unless ``dst`` exists (then EEXIST).

    Where the filesystem lacks the flag (NFS and FUSE answer EINVAL; remembered per device), or with
    ``flag=False`` (the caller knows it lacks it), a plain rename: a directory then still never replaces a
    non-empty directory (ENOTEMPTY) or a link (ENOTDIR), only an empty directory.
    """
    device = os.fstat(dir_fd).st_dev if flag else None
    if device is not None and device not in _noreplace_refused:
        try:
            renameat2(src, dst, RENAME_NOREPLACE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return
        except OSError as exc:
            if exc.errno not in EXCHANGE_UNSUPPORTED:
                raise
            _noreplace_refused.add(device)
    os.rename(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
