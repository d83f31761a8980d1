"""Local filesystem operations shared by promotion and recovery: permissions and tree removal."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import time

from safeio._storage.posix import current_umask
from safeio._who import who

logger = logging.getLogger("safeio")

# NFS renames a removed-but-open file to .nfsXXXX ("silly rename"); its directory cannot be removed
# until the reader closes it. Retry briefly, then leave the remains to `safeio gc`.
_REMOVE_ATTEMPTS = 3


def normalize_permissions(root: str) -> None:
    """Give ``root`` and everything in it the modes a plain mkdir/open under the umask would give.

    The stage is created by safeio, but tools write into it with their own modes (safetensors writes
    weights 0600 through mkstemp); a replicated checkpoint must be readable by whoever could read a
    checkpoint written without safeio. A directory keeps its setgid bit, which mkdir inherits in a
    setgid project share: clearing it would make later writes there (DCP shards) lose the group.
    """
    umask = current_umask()
    dir_mode, file_mode = 0o777 & ~umask, 0o666 & ~umask
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            if stat.S_ISREG(st.st_mode):
                wanted = file_mode | (st.st_mode & 0o111 & ~umask)
                if stat.S_IMODE(st.st_mode) != wanted:
                    os.chmod(full, wanted)
        for name in dirnames:
            _chmod_directory(os.path.join(dirpath, name), dir_mode)
    _chmod_directory(root, dir_mode)


def _chmod_directory(path: str, mode: int) -> None:
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        return  # a symlink the body wrote stays a link; chmod would follow it
    wanted = mode | (st.st_mode & stat.S_ISGID)
    if stat.S_IMODE(st.st_mode) != wanted:
        os.chmod(path, wanted)


def remove_tree(path: str, *, what: str = "leftover") -> bool:
    """Remove ``path`` (directory, file or link). False if NFS silly-renamed files kept it alive."""
    for attempt in range(_REMOVE_ATTEMPTS):
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
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
        path,
    )
    return False
