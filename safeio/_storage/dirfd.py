"""Working inside a directory other users can write: relative to a held descriptor, never through a link.

safeio trusts the path the caller gave (its parent may be reached through symlinks the admin made:
``/shared -> /mnt/nfs``) and what this process created and still holds. Below the parent everything is
input: a planted symlink must never make safeio read, write, chmod, move or delete anything elsewhere. So
the parent is opened once, and every operation under it is an ``*at()`` call relative to a descriptor,
walking names component by component with ``O_NOFOLLOW``; names read from disk are checked to be single,
normalised components first.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

from safeio._storage.names import NAME_MAX

DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO someone planted under a metadata name must not wait for a writer.
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def is_component(name: object) -> bool:
    """One normalised path component: a non-empty str, no ``/`` or NUL, not ``.``/``..``, within NAME_MAX."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
        return False
    try:
        return len(name.encode("utf-8", "surrogateescape")) <= NAME_MAX
    except UnicodeEncodeError:
        return False


def is_relative_name(rel: object) -> bool:
    """A relative POSIX path of components (``a/b/c``), each one a normalised component."""
    return isinstance(rel, str) and 0 < len(rel) <= 4096 and all(is_component(p) for p in rel.split("/"))


def open_directory(path: str, *, dir_fd: int | None = None) -> int:
    """Open a directory (``O_NOFOLLOW``: the last component must not be a symlink)."""
    return os.open(path, DIRECTORY_FLAGS, dir_fd=dir_fd)


@contextlib.contextmanager
def held_directory(path: str, *, dir_fd: int | None = None, follow: bool = False) -> Iterator[int]:
    """Hold a directory open for the block; ``follow`` only for a path the caller gave (trusted)."""
    flags = DIRECTORY_FLAGS & ~os.O_NOFOLLOW if follow else DIRECTORY_FLAGS
    fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def open_relative_directory(dir_fd: int, rel: str, *, create: bool = False, mode: int = 0o777) -> int:
    """Open ``rel`` (``a/b``) below ``dir_fd`` one component at a time, following no symlink.

    With ``create``, missing directories are made (the umask applies, as for any mkdir). A component
    that is a symlink or a file raises OSError (ELOOP / ENOTDIR).
    """
    fd = os.dup(dir_fd)
    try:
        for part in rel.split("/") if rel else []:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, mode, dir_fd=fd)
            child = open_directory(part, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    """``lstat`` of ``name`` in ``dir_fd``, or None when it does not exist."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def open_regular_file(dir_fd: int, name: str) -> tuple[int, os.stat_result]:
    """Open a regular file for reading without following a link or blocking on a FIFO."""
    fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", name)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def walk_files(dir_fd: int) -> Iterator[tuple[str, int, str, os.stat_result]]:
    """Every entry below ``dir_fd`` that is not a directory: (relative dir, its fd, name, lstat).

    ``os.fwalk`` never follows symlinks to directories; entries are listed, links included, as links.
    """
    for dirpath, dirnames, filenames, fd in os.fwalk(".", dir_fd=dir_fd):
        dirnames.sort()
        rel_dir = "" if dirpath == "." else dirpath[2:]
        for name in sorted(filenames):
            st = lstat_at(fd, name)
            if st is not None:
                yield rel_dir, fd, name, st


def walk_directories(dir_fd: int) -> Iterator[tuple[str, int]]:
    """Every directory below ``dir_fd``, children before parents: (relative path, its fd)."""
    for dirpath, _dirnames, _filenames, fd in os.fwalk(".", dir_fd=dir_fd, topdown=False):
        yield ("" if dirpath == "." else dirpath[2:]), fd


def fsync_fd_tree(dir_fd: int, *, root: bool = True) -> None:
    """fsync every regular file and directory below ``dir_fd`` (children before their directory);
    ``root=False`` leaves ``dir_fd`` itself to the caller (who adds entries to it first)."""
    for _rel, fd, name, st in walk_files(dir_fd):
        if stat.S_ISREG(st.st_mode):
            file_fd, _ = open_regular_file(fd, name)
            try:
                os.fsync(file_fd)
            finally:
                os.close(file_fd)
    for rel, fd in walk_directories(dir_fd):
        if rel or root:
            os.fsync(fd)
