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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

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


def still_is(dir_fd: int, name: str, made: tuple[int, int] | None) -> bool:
    """Whether ``name`` in ``dir_fd`` is still the entry whose ``identity`` is ``made`` (not moved away,
    nor swapped for another)."""
    st = lstat_at(dir_fd, name)
    return st is not None and identity(st) == made


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


# A relative path longer than PATH_MAX cannot be opened by name, nor listed in a manifest
# (``is_relative_name``): a walk that would go deeper reports it (ENAMETOOLONG) instead.
MAX_RELATIVE = 4096
# Directories a walk holds open at once: deeper ancestors are closed and reopened through ".." (their
# identity checked) on the way back up, so a 3,000-level tree needs no more descriptors than a shallow one.
HELD = 64
_GONE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP})  # removed, or swapped for a file or link


@dataclass
class Listing:
    """One directory of a walk: its path relative to the top, its descriptor (valid while the walk is at
    it), its entries that are not directories (sorted, with their lstat) and its subdirectories (sorted;
    a top-down caller may prune them, as with ``os.fwalk``)."""

    rel: str
    fd: int
    entries: list[tuple[str, os.stat_result]]
    subdirs: list[str]


@dataclass
class _Level:
    listing: Listing
    identity: tuple[int, int]
    pending: list[str] | None = None  # subdirectories still to visit, last first


def walk(
    dir_fd: int,
    *,
    bottom_up: bool = False,
    max_relative: int | None = MAX_RELATIVE,
    onerror: Callable[[OSError], None] | None = None,
) -> Iterator[Listing]:
    """Every directory below ``dir_fd``, itself included, never following a link: top-down (each before
    its subdirectories) or ``bottom_up`` (each after them).

    An explicit stack, not recursion (``os.fwalk`` and ``shutil.rmtree`` recurse once per level: a tree
    deeper than the recursion limit, about 1,000, made them raise RecursionError), holding at most HELD
    descriptors. A subdirectory removed or swapped for a link meanwhile is skipped. One that cannot be
    opened or listed raises OSError whose filename is its relative path (None ``max_relative``: the path
    is not tracked, only its name), or goes to ``onerror`` and is skipped; so does one whose relative path
    would be longer than ``max_relative`` (ENAMETOOLONG, "too deep", named by the top's entry holding it).
    """
    top = os.dup(dir_fd)
    stack: list[_Level] = []
    first_open = 1  # stack[1:first_open] had their descriptors closed (see HELD)
    try:
        stack.append(_Level(_listing(top, ""), identity(os.fstat(top))))
        while stack:
            level = stack[-1]
            listing = level.listing
            if level.pending is None:
                if not bottom_up:
                    yield listing
                level.pending = listing.subdirs[::-1]
            if level.pending:
                child = _open_child(listing, level.pending.pop(), max_relative, onerror)
                if child is not None:
                    stack.append(child)
                    if len(stack) - first_open > HELD:
                        os.close(stack[first_open].listing.fd)
                        stack[first_open].listing.fd = -1
                        first_open += 1
                continue
            if bottom_up:
                yield listing
            stack.pop()
            if stack and stack[-1].listing.fd < 0:
                _reopen_parent(stack[-1], listing)
                first_open = len(stack) - 1
            os.close(listing.fd)
            listing.fd = -1
    finally:
        for level in stack:
            if level.listing.fd >= 0:
                os.close(level.listing.fd)


def _open_child(
    listing: Listing, name: str, max_relative: int | None, onerror: Callable[[OSError], None] | None
) -> _Level | None:
    rel = "" if max_relative is None else (f"{listing.rel}/{name}" if listing.rel else name)
    try:
        if max_relative is not None and len(rel) > max_relative:
            raise OSError(errno.ENAMETOOLONG, f"too deep: a path below it is over {max_relative} characters")
        fd = open_directory(name, dir_fd=listing.fd)
    except OSError as exc:
        if exc.errno in _GONE:
            return None
        # Too deep: named by the entry of the walked directory that holds it (a path past PATH_MAX is
        # unreadable in a report).
        too_deep = exc.errno == errno.ENAMETOOLONG
        error = OSError(exc.errno, exc.strerror, rel.split("/", 1)[0] if too_deep else rel or name)
        if onerror is None:
            raise error from exc
        onerror(error)
        return None
    try:
        return _Level(_listing(fd, rel), identity(os.fstat(fd)))
    except OSError as exc:
        os.close(fd)
        error = OSError(exc.errno, exc.strerror, rel or name)
        if onerror is None:
            raise error from exc
        onerror(error)
        return None
    except BaseException:
        os.close(fd)
        raise


def _listing(fd: int, rel: str) -> Listing:
    """One ``scandir`` and one ``fstatat`` per entry."""
    with os.scandir(fd) as found:
        entries = sorted(found, key=lambda entry: entry.name)
    files: list[tuple[str, os.stat_result]] = []
    subdirs: list[str] = []
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode):
            subdirs.append(entry.name)
        else:
            files.append((entry.name, st))
    return Listing(rel, fd, files, subdirs)


def _reopen_parent(parent: _Level, child: Listing) -> None:
    """Reopen ``parent``'s closed descriptor through ``..`` of ``child``: the same directory, or the walk
    fails (it was moved meanwhile, and ``..`` is now elsewhere)."""
    fd = os.open("..", DIRECTORY_FLAGS, dir_fd=child.fd)
    if identity(os.fstat(fd)) != parent.identity:
        os.close(fd)
        raise OSError(errno.ESTALE, "moved while it was walked", parent.listing.rel or ".")
    parent.listing.fd = fd


def skip_unreadable(error: OSError) -> None:
    """``os.fwalk``'s way: a subdirectory that cannot be opened or listed is passed over. Not one too deep
    to name: that is raised, never a silent omission (a manifest without the files below it)."""
    if error.errno == errno.ENAMETOOLONG:
        raise error


def walk_files(dir_fd: int) -> Iterator[tuple[str, int, str, os.stat_result]]:
    """Every entry below ``dir_fd`` that is not a directory: (relative dir, its fd, name, lstat), links
    included, as links."""
    for listing in walk(dir_fd, onerror=skip_unreadable):
        for name, st in listing.entries:
            yield listing.rel, listing.fd, name, st


def remove_directory_at(dir_fd: int, name: str, *, expected: tuple[int, int] | None = None) -> None:
    """Remove the directory ``name`` in ``dir_fd`` and everything in it, following no link, at any depth
    (``shutil.rmtree`` recursed once per level). With ``expected`` (an ``identity``), only that directory:
    another one renamed to ``name`` meanwhile raises OSError (ESTALE) with nothing removed."""
    fd = open_directory(name, dir_fd=dir_fd)
    try:
        if expected is not None and identity(os.fstat(fd)) != expected:
            raise OSError(errno.ESTALE, "not the directory judged a moment before (swapped meanwhile)", name)
        for listing in walk(fd, bottom_up=True, max_relative=None):
            for entry, _st in listing.entries:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry, dir_fd=listing.fd)
            for subdir in listing.subdirs:  # emptied already: children come first
                try:
                    os.rmdir(subdir, dir_fd=listing.fd)
                except FileNotFoundError:
                    pass
                except NotADirectoryError:  # swapped for a file or link meanwhile: never entered
                    os.unlink(subdir, dir_fd=listing.fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def fsync_files_below(dir_fd: int) -> None:
    """fsync every regular file below ``dir_fd``."""
    for _rel, fd, name, st in walk_files(dir_fd):
        if stat.S_ISREG(st.st_mode):
            file_fd, _ = open_regular_file(fd, name)
            try:
                os.fsync(file_fd)
            finally:
                os.close(file_fd)


def fsync_files(dir_fd: int, names: Iterable[str]) -> list[str]:
    """fsync the regular files ``names`` (relative paths) below ``dir_fd``, following no link; return
    those that could not be (missing, not a regular file, an error), for someone else to sync."""
    by_directory: dict[str, list[str]] = {}
    for rel in names:
        head, _, name = rel.rpartition("/")
        by_directory.setdefault(head, []).append(name)
    left: list[str] = []
    for head, members in sorted(by_directory.items()):
        shown = [f"{head}/{n}" if head else n for n in members]
        try:
            fd = open_relative_directory(dir_fd, head)
        except OSError:
            left.extend(shown)
            continue
        try:
            for name, rel in zip(members, shown, strict=True):
                try:
                    file_fd, _ = open_regular_file(fd, name)
                    try:
                        os.fsync(file_fd)
                    finally:
                        os.close(file_fd)
                except OSError:
                    left.append(rel)
        finally:
            os.close(fd)
    return left
