"""What a framework's adapter needs of safeio beyond the names of ``safeio`` itself.

The adapters in ``safeio.integrations`` (transformers, accelerate, Lightning) and any of your own are
built on this module and on ``safeio`` only, never on safeio's private modules: what they need is
named here for what it does, and kept stable with the rest of the public API.

- **Stages**: whether a path lies inside a safeio stage this thread is writing (``is_staged``: a
  framework's own call into it is left alone, nothing is staged twice), and a framework's own path
  made a view of a stage (``stage_view``: saves nested under it write into the stage).
- **A shared directory read as untrusted input** (``open_shared_directory``): others can write a share,
  so nothing planted in it is followed, blocks, or is read past a bound; another user's files are not
  read at all.
- **Files in a share**: a link replaced by one rename (``replace_link``), a file removed safely
  (``remove_file``), the parent of a target made (``make_parent_directory``), a target's URL
  (``target_url``).
- **Patches** of a framework's code (``Patch``): one base under safeio's three (``save_pretrained``,
  the Trainer's, accelerate's) owning install, uninstall, the count of installs and the exact restore;
  a patch supplies only what it replaces.
- **``SAFEIO_PATCH``'s words**: the parts it can patch (``PATCH_PARTS``; ``1`` means ``PATCH_ALL``) and
  what a value asks for (``patch_parts``).
- **Options and messages**: ``check_timeout`` refuses a bad timeout where it is given, not at the first
  save hours later; ``process_name`` names a process in a message as safeio's own do.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from safeio._autopatch import startup
from safeio._options import seconds
from safeio._promotion import active
from safeio._promotion.backends import backend_for
from safeio._saves.patches import Patch
from safeio._storage.claims import claimed
from safeio._storage.dirfd import held_directory, open_regular_file, walk_files
from safeio._storage.metadata import Damaged, read_json
from safeio._storage.names import sibling_name
from safeio._who import who

__all__ = [
    "PATCH_ALL",
    "PATCH_PARTS",
    "Patch",
    "SharedDirectory",
    "check_timeout",
    "is_staged",
    "make_parent_directory",
    "open_shared_directory",
    "patch_parts",
    "process_name",
    "remove_file",
    "replace_link",
    "stage_view",
    "target_url",
]


# -- stages -----------------------------------------------------------------------------------------


def is_staged(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is, or lies inside, a stage a safeio save of this thread is writing (or a view of
    one, ``stage_view``). A framework's call that writes there is part of that save: an adapter leaves
    it to the framework instead of staging it a second time."""
    return active.redirect(os.path.abspath(os.fspath(path))) is not None


@contextlib.contextmanager
def stage_view(view: str, stage: str) -> Iterator[None]:
    """While the block runs, ``view`` (a path the framework writes to: a link to ``stage`` the adapter
    made) stands for ``stage`` on this thread: a safeio save nested under ``view`` (a tokenizer's
    ``save_pretrained`` inside the Trainer's checkpoint, under ``SAFEIO_PATCH``) writes into the stage,
    as one nested under ``stage`` itself would, with no stage, lock or wait of its own."""
    covered = active.covering(stage)
    replicated, results = (covered[0], covered[1].results) if covered is not None else (None, None)
    entry = active.ActiveStage(view, stage, replicated=replicated, results=results)
    active.push(entry)
    try:
        yield
    finally:
        active.pop(entry)


# -- a shared directory, read as untrusted input ---------------------------------------------------------


class SharedDirectory:
    """A directory held open by its descriptor (``open_shared_directory``): every name is looked up in
    it, never through a path that may have been swapped for a link meanwhile."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path
        self.owner = os.fstat(fd).st_uid

    def names(self) -> list[str]:
        """The names in the directory (``os.listdir`` of the held directory)."""
        return os.listdir(self.fd)

    def lstat(self, name: str) -> os.stat_result | None:
        """``lstat`` of ``name`` (a link is not followed); None when it does not exist."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def open_regular_file(self, name: str) -> tuple[int, os.stat_result]:
        """A descriptor open for reading on ``name`` and its ``fstat``, the caller to close it. OSError
        unless it is a regular file: a link is not followed, a FIFO does not block the open."""
        return open_regular_file(self.fd, name)

    def read_json(self, name: str, max_bytes: int) -> object | None:
        """``name`` parsed as JSON, when it is a regular file of the directory's owner of at most
        ``max_bytes`` that parses within safeio's depth and memory bounds; None otherwise (absent,
        another user's, too large, a link, not JSON)."""
        found = read_json(self.fd, name, max_bytes, owner=self.owner)
        return None if isinstance(found, Damaged) else found

    def size(self) -> int:
        """The bytes of every regular file below the directory (no link followed); 0 if it cannot be
        listed."""
        try:
            return sum(st.st_size for _rel, _fd, _name, st in walk_files(self.fd))
        except OSError:
            return 0


@contextlib.contextmanager
def open_shared_directory(path: str | os.PathLike[str], *, follow: bool = False) -> Iterator[SharedDirectory]:
    """Hold the directory ``path`` open for the block. ``follow``: its last component may be a link
    (only for a path the user gave, not one found in a share). OSError when it is no directory."""
    where = os.fspath(path)
    with held_directory(where, follow=follow) as fd:
        yield SharedDirectory(fd, where)


# -- files in a share ---------------------------------------------------------------------------------


def replace_link(link: str | os.PathLike[str], target: str | os.PathLike[str]) -> bool:
    """``link`` becomes a relative symbolic link to ``target`` by one rename over what stood there:
    readers see the old entry or the new link, never none (removing and re-creating it left a moment,
    and after a crash there, with no link at all). Made through the parent directory's handle: nothing
    planted in the share is followed. Returns False, nothing changed, when the filesystem refuses links
    (SMB/CIFS and FAT shares, Windows without the privilege: EPERM, EOPNOTSUPP, ENOSYS); the rename's
    own OSError otherwise (IsADirectoryError: a directory stands at ``link``)."""
    parent = os.path.dirname(os.path.abspath(os.fspath(link)))
    name = os.path.basename(os.fspath(link))
    with held_directory(parent, follow=True) as parent_fd, claimed(sibling_name(name, "tmp")) as temporary:
        try:
            os.symlink(os.path.relpath(os.fspath(target), parent), temporary, dir_fd=parent_fd)
        except OSError:
            return False
        try:
            os.replace(temporary, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        except BaseException:
            os.unlink(temporary, dir_fd=parent_fd)
            raise
        os.fsync(parent_fd)
    return True


def remove_file(path: str | os.PathLike[str], *, durable: bool = True) -> None:
    """Remove the file at ``path`` (a local path or an fsspec URL), renamed aside first so that no reader
    opens a half-removed file by its name; ``durable``: the removal is on disk when this returns. A link
    is removed, never what it points to. Locally, only the entry found at ``path`` is removed: another
    entry renamed to its name meanwhile (by another user of a directory without the sticky bit) is put
    back, with a WARNING."""
    backend_for(path).remove_file(durable=durable)


def make_parent_directory(path: str | os.PathLike[str]) -> None:
    """Make the directory that will hold ``path`` (and its parents) where the store has directories."""
    backend_for(path).make_parent()


def target_url(path: object) -> str:
    """``path`` (a local path or an fsspec URL) as safeio names it in messages; InvalidTargetError naming
    what was passed when it is none (None, a number, an empty path, a NUL byte)."""
    return backend_for(path).url()  # type: ignore[arg-type]  # refused there, named


# -- options and messages --------------------------------------------------------------------------------


def check_timeout(value: object, name: str) -> float:
    """``value`` as a finite positive number of seconds; InvalidOptionError naming ``name`` otherwise."""
    return seconds(value, name)


def process_name(rank: int | None = None) -> str:
    """How safeio names a process in a message: ``rank R (host pid P)``."""
    return who(rank)


# -- SAFEIO_PATCH ----------------------------------------------------------------------------------------

PATCH_PARTS: tuple[str, ...] = startup.PARTS
"""What ``SAFEIO_PATCH`` can patch, one word each."""
PATCH_ALL: tuple[str, ...] = startup.EVERYTHING
"""What ``SAFEIO_PATCH=1`` (or ``all``) patches."""


def patch_parts(value: str) -> tuple[list[str], list[str]]:
    """The parts ``SAFEIO_PATCH=value`` asks for (in ``PATCH_PARTS`` order), and the words it does not
    know: a comma-separated list read left to right, ``-part`` removing one, ``0`` all."""
    return startup.parts(value)
