"""Files removed while open on this mount: NFS "silly rename", or local semantics.

libfuse's high-level API keeps a removed-but-open file reachable by hiding it: instead of
unlink(x) (or before renaming over an open x) it calls rename(x, ".fuse_hiddenNNNN") and, after the
last close, unlink(".fuse_hiddenNNNN"). Its alternative, `hard_remove`, forgets the name, and then
fstat() of the still-open file fails with ESTALE (the kernel sends GETATTR without a file handle),
which neither a local filesystem nor NFS does. So the filesystem lets libfuse hide, and maps the
hidden name to what it emulates:

- silly rename (NFS): the backing file becomes `.nfs<fileid:016x><counter:08x>` in the same
  directory (fs/nfs/unlink.c), so the directory is not empty (rmdir: ENOTEMPTY, the classic
  "Directory not empty" of rm -rf on NFS) and removing the `.nfs` file fails with EBUSY, until the
  last handle on this mount closes;
- otherwise (local semantics): the backing name is removed at once and the inode is held through
  an O_PATH descriptor until the last close.

libfuse hides the same way before renaming over an open file, and a hide that removed the name
would leave it missing until the rename: readers on this mount got ENOENT. A real NFS client holds
the directory locked across its silly rename and the rename, so its own readers never see that.
So when the caller is blocked in a rename syscall, the hide keeps the name (a hard link to the
silly name, or the held inode) and the rename that follows replaces it atomically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import platform
import threading
import time
from collections.abc import Iterator

from safeio.testing.nfslike._handles import HandleTable, InodeKey

logger = logging.getLogger("safeio.testing.nfslike")

HIDDEN_PREFIX = ".fuse_hidden"
_HELD_PREFIX = "/proc/self/fd/"


# rename, renameat, renameat2 (asm/unistd_64.h; asm-generic/unistd.h)
_RENAME_SYSCALLS = {"x86_64": {82, 264, 316}, "aarch64": {38, 276}}
# Seconds: on a loaded machine (load 100 on 2 cores) a woken task stayed runnable past 50 ms.
_RUNNING_FOR_AT_MOST = 2.0


def caller_is_renaming(tid: int) -> bool:
    """Whether thread `tid`, blocked in a syscall waiting for this filesystem, is in a rename.

    False when it cannot be told (unknown architecture, /proc unreadable): then a hide removes
    the name, which is always correct for an unlink and only loses atomicity for a rename.
    """
    numbers = _RENAME_SYSCALLS.get(platform.machine())
    if numbers is None:
        return False
    # The caller waits for this very request, but for a moment after a wake-up its task reads as
    # "running" (no syscall number): ask again, briefly. Taking that moment for "not a rename" would
    # remove the name before the rename, and a reader would get ENOENT. (The ENOENT that tests met
    # under load had another cause: a hidden file's location used after its release; see pinned.)
    deadline = time.monotonic() + _RUNNING_FOR_AT_MOST
    while True:
        try:
            with open(f"/proc/{tid}/syscall", encoding="ascii") as syscall:
                current = syscall.read().split(maxsplit=1)
        except OSError:
            return False
        if current and current[0].isdigit():
            return int(current[0]) in numbers
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)  # bounded poll: /proc offers nothing to wait on


def is_hidden(path: str | None) -> bool:
    """Whether `path` is one of libfuse's hidden names (internal, never shown to users)."""
    return path is not None and os.path.basename(path).startswith(HIDDEN_PREFIX)


def is_held(real: str) -> bool:
    """Whether a backing location is a held, unlinked inode (reach it following the link)."""
    return real.startswith(_HELD_PREFIX)


@dataclasses.dataclass(frozen=True)
class _Silly:
    key: InodeKey
    name: str
    dir_fd: int  # follows renames of the directory, for the delete at the last close


@dataclasses.dataclass(frozen=True)
class _Held:
    key: InodeKey
    fd: int


class HiddenFiles:
    def __init__(self, handles: HandleTable, *, silly: bool) -> None:
        self.silly = silly
        self._handles = handles
        self._lock = threading.Lock()
        self._counter = itertools.count(1)
        # Keyed by the hidden base name: libfuse's path of the hidden file follows renames of its
        # directory, so the directory part is resolved at each use, as the NFS client's dentry does.
        self._hidden: dict[str, _Silly | _Held] = {}
        self._silly_names: set[str] = set()

    def hide(self, real: str, hidden_path: str, *, keep_name: bool) -> str | None:
        """libfuse hides the backing file `real`; returns the silly name, if one was made.

        With `keep_name` (a rename over `real` follows) the name stays for that rename to replace.
        """
        directory = os.path.dirname(real)
        entry: _Silly | _Held
        name = None
        if self.silly:
            st = os.lstat(real)
            name = f".nfs{st.st_ino:016x}{next(self._counter) & 0xFFFFFFFF:08x}"
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                self._silly_rename(real, os.path.join(directory, name), keep_name=keep_name)
            except OSError:
                os.close(dir_fd)
                raise
            entry = _Silly((st.st_dev, st.st_ino), name, dir_fd)
        else:
            fd = os.open(real, os.O_PATH | os.O_NOFOLLOW)
            try:
                st = os.fstat(fd)
                if not keep_name:
                    os.unlink(real)
            except OSError:
                os.close(fd)
                raise
            entry = _Held((st.st_dev, st.st_ino), fd)
        with self._lock:
            self._hidden[os.path.basename(hidden_path)] = entry
            if name is not None:
                self._silly_names.add(name)
        logger.debug("hid %s as %s (%s, name kept: %s)", real, hidden_path, entry, keep_name)
        if not self._handles.is_open(entry.key):
            self.release(entry.key)  # the last handle closed while we were hiding it
        return name

    @staticmethod
    def _silly_rename(real: str, silly: str, *, keep_name: bool) -> None:
        if keep_name:
            try:
                os.link(real, silly, follow_symlinks=False)
                return
            except OSError as exc:  # no hard links here: fall back to the client's two steps
                logger.debug("cannot link %s to %s (%s); renaming it", real, silly, exc)
        os.rename(real, silly)

    @contextlib.contextmanager
    def pinned(self, hidden_path: str, real_dir: str) -> Iterator[str | None]:
        """The backing location of a hidden file, or None if it is not one of ours (any more).

        The location stays valid until the block ends: the last close's `release`, which closes
        the held descriptor or deletes the silly name, waits for it. Without that, a reader that
        opened the old file through a lookup made just before a rename got ENOENT (the held
        descriptor closed between locating and opening), or, had its number been reused, another
        file. Keep one system call in the block: every hide and release waits for it.
        """
        with self._lock:
            entry = self._hidden.get(os.path.basename(hidden_path))
            if entry is None:
                yield None
            elif isinstance(entry, _Held):
                yield f"{_HELD_PREFIX}{entry.fd}"
            else:
                yield os.path.join(real_dir, entry.name)

    def drop(self, hidden_path: str) -> None:
        """libfuse removes a hidden file after the last close of its node.

        Nothing to do: the inode may still be open through another name (a `.nfs` file opened
        by name), so `release` removes it when the inode's last handle on this mount closes, as
        the NFS client's silly delete runs when the inode is released.
        """

    def release(self, key: InodeKey) -> None:
        """The last handle on inode `key` closed: remove what hides it."""
        with self._lock:
            gone = [(base, entry) for base, entry in self._hidden.items() if entry.key == key]
            for base, entry in gone:
                del self._hidden[base]
                if isinstance(entry, _Silly):
                    self._silly_names.discard(entry.name)
        for _, entry in gone:
            if isinstance(entry, _Held):
                os.close(entry.fd)
            else:
                self._delete_silly(entry)

    @staticmethod
    def _delete_silly(entry: _Silly) -> None:
        try:
            st = os.lstat(entry.name, dir_fd=entry.dir_fd)
            if (st.st_dev, st.st_ino) == entry.key:  # unless someone renamed it away meanwhile
                os.unlink(entry.name, dir_fd=entry.dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("could not remove silly-renamed %s: %s", entry.name, exc)
        finally:
            os.close(entry.dir_fd)

    def is_silly_name(self, real: str) -> bool:
        """Whether `real` names a silly-renamed file that is still open."""
        with self._lock:
            return os.path.basename(real) in self._silly_names
