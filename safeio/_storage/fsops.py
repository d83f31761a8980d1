"""Local filesystem operations shared by promotion and recovery: removing a tree, never following a link."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time

from safeio._storage.dirfd import held_directory, remove_directory_at
from safeio._who import who

logger = logging.getLogger("safeio")

# NFS renames a removed-but-open file to .nfsXXXX ("silly rename"); its directory cannot be removed
# until the reader closes it. Retry briefly, then leave the remains to `safeio gc`.
_REMOVE_ATTEMPTS = 3


def remove_at(dir_fd: int, name: str, *, what: str = "leftover", shown: str | None = None) -> bool:
    """Remove ``name`` in ``dir_fd`` (a directory tree, file or link), never following a link.

    False if NFS silly-renamed files kept it alive (see ``remove_tree``).
    """
    for attempt in range(_REMOVE_ATTEMPTS):
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                remove_directory_at(dir_fd, name)  # never follows a link, at any depth
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
