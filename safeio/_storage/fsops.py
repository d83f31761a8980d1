"""Local filesystem operations shared by promotion and recovery: permissions and tree removal."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import time

from safeio._storage.dirfd import held_directory, open_regular_file, walk_directories, walk_files
from safeio._storage.posix import current_umask
from safeio._who import who

logger = logging.getLogger("safeio")

# NFS renames a removed-but-open file to .nfsXXXX ("silly rename"); its directory cannot be removed
# until the reader closes it. Retry briefly, then leave the remains to `safeio gc`.
_REMOVE_ATTEMPTS = 3


def normalize_permissions(stage_fd: int) -> None:
    """Give the stage and everything in it the modes a plain mkdir/open under the umask would give.

    The stage is created by safeio, but tools write into it with their own modes (safetensors writes
    weights 0600 through mkstemp); a replicated checkpoint must be readable by whoever could read a
    checkpoint written without safeio. A directory keeps its setgid bit, which mkdir inherits in a
    setgid project share: clearing it would make later writes there (DCP shards) lose the group. Files
    are changed through a descriptor opened without following links, so a link the body wrote (or one
    planted in a group-writable stage) is never followed to chmod something elsewhere.
    """
    umask = current_umask()
    dir_mode, file_mode = 0o777 & ~umask, 0o666 & ~umask
    for _rel, fd, name, st in walk_files(stage_fd):
        if not stat.S_ISREG(st.st_mode):
            continue
        wanted = file_mode | (st.st_mode & 0o111 & ~umask)
        if stat.S_IMODE(st.st_mode) != wanted:
            file_fd, _ = open_regular_file(fd, name)
            try:
                os.fchmod(file_fd, wanted)
            finally:
                os.close(file_fd)
    for _rel, fd in walk_directories(stage_fd):
        mode = os.fstat(fd).st_mode
        wanted = dir_mode | (mode & stat.S_ISGID)
        if stat.S_IMODE(mode) != wanted:
            os.fchmod(fd, wanted)


def remove_at(dir_fd: int, name: str, *, what: str = "leftover", shown: str | None = None) -> bool:
    """Remove ``name`` in ``dir_fd`` (a directory tree, file or link), never following a link.

    False if NFS silly-renamed files kept it alive (see ``remove_tree``).
    """
    for attempt in range(_REMOVE_ATTEMPTS):
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=dir_fd)  # the fd-based rmtree: it never follows links
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
