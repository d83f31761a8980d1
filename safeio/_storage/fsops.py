"""Local filesystem operations shared by promotion and recovery: removing a tree, carrying one's files
into another, never following a link."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import time
from collections.abc import Callable

from safeio._storage.dirfd import (
    held_directory,
    identity,
    lstat_at,
    open_regular_file,
    open_relative_directory,
    remove_directory_at,
    walk,
)
from safeio._who import who

logger = logging.getLogger("safeio")

# NFS renames a removed-but-open file to .nfsXXXX ("silly rename"); its directory cannot be removed
# until the reader closes it. Retry briefly, then leave the remains to `safeio gc`.
_REMOVE_ATTEMPTS = 3


def remove_at(
    dir_fd: int,
    name: str,
    *,
    what: str = "leftover",
    shown: str | None = None,
    expected: tuple[int, int] | None = None,
) -> bool:
    """Remove ``name`` in ``dir_fd`` (a directory tree, file or link), never following a link.

    With ``expected`` (its ``identity`` when it was judged), only that entry: in a directory others can
    write without the sticky bit, another user may rename a tree of yours, which they may not delete, to
    the name between the judgement and the removal; then OSError (ESTALE), nothing removed.
    False if NFS silly-renamed files kept it alive (see ``remove_tree``).
    """
    for attempt in range(_REMOVE_ATTEMPTS):
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if expected is not None and identity(st) != expected:
                raise OSError(errno.ESTALE, "not the entry judged a moment before (swapped meanwhile)", name)
            if stat.S_ISDIR(st.st_mode):
                remove_directory_at(dir_fd, name, expected=expected)  # never follows a link, at any depth
            else:
                os.unlink(name, dir_fd=dir_fd)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EBUSY):
                raise
            time.sleep(0.05 * (attempt + 1))  # a reader may close its file in a moment
    logger.warning(
        "%s: could not remove %s %s yet: files in it are still open elsewhere (NFS silly-renamed .nfs*); "
        "`safeio gc` will remove it later",
        who(),
        what,
        shown or name,
    )
    return False


def remove_tree(path: str, *, what: str = "leftover") -> bool:
    """Remove ``path`` (a directory tree, file or link) relative to its held parent; see ``remove_at``."""
    try:
        with held_directory(os.path.dirname(path) or ".", follow=True) as parent:
            return remove_at(parent, os.path.basename(path), what=what, shown=path)
    except FileNotFoundError:
        return True


def discard_tree(path: str) -> None:
    """Remove a private scratch directory this process made, best effort (``shutil.rmtree(path,
    ignore_errors=True)`` recursed once per level: a body's deep tree raised RecursionError through it)."""
    with contextlib.suppress(OSError):
        remove_tree(path, what="scratch directory")


# os.link refused: another filesystem, or one without hard links (some FUSE and SMB mounts), or too many.
_NO_LINK = frozenset({errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS})


def carry_missing(source_fd: int, dest_fd: int, *, skip: Callable[[str], bool]) -> int:
    """Put into ``dest_fd`` every file, link and directory below ``source_fd`` that ``dest_fd`` does not
    have at the same relative path: regular files hard-linked (copied where links are refused), links
    recreated, never followed; a name ``skip`` refuses is passed over at any depth. What ``dest_fd``
    has already wins, and is never entered when it is not a directory. Returns how many were carried.

    Hard links, not copies: the files a save keeps from a directory it then replaces are as large as a
    checkpoint's, and nothing writes to them afterwards (the directory they came from goes at once)."""
    carried = 0
    for listing in walk(source_fd):
        listing.subdirs[:] = [name for name in listing.subdirs if not skip(name)]
        try:
            target_fd = open_relative_directory(dest_fd, listing.rel, create=True)
        except OSError:  # the save wrote a file (or link) where the source has a directory: it wins
            listing.subdirs.clear()
            continue
        try:
            for name, st in listing.entries:
                if skip(name) or lstat_at(target_fd, name) is not None:
                    continue
                if stat.S_ISREG(st.st_mode):
                    _link_or_copy(listing.fd, target_fd, name)
                elif stat.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(name, dir_fd=listing.fd), name, dir_fd=target_fd)
                else:
                    continue  # a FIFO, socket or device is no file of a checkpoint
                carried += 1
        finally:
            os.close(target_fd)
    return carried


def _link_or_copy(source_fd: int, dest_fd: int, name: str) -> None:
    try:
        os.link(name, name, src_dir_fd=source_fd, dst_dir_fd=dest_fd, follow_symlinks=False)
        return
    except OSError as exc:
        if exc.errno not in _NO_LINK:
            raise
    fd, st = open_regular_file(source_fd, name)
    with os.fdopen(fd, "rb") as source:
        out = os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, st.st_mode & 0o777, dir_fd=dest_fd
        )
        with os.fdopen(out, "wb") as dest:
            shutil.copyfileobj(source, dest, 1 << 20)
