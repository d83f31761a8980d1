"""Where a target lives, decided once: one back end per kind of location makes everything that differs.

Like fsspec's one ``AbstractFileSystem`` per protocol, asked and never tested for its kind: the back end
made when a target or root is resolved gives the directory promotion, the single-file promotion, the
reader (versions, verification, committed steps, what a peer checks), and the few file operations the
integrations need. The steps of a ``Checkpoints`` root are registered for each back end in
``safeio._checkpoints.storage``, the checkpoint layer above. This module (with ``safeio._storage.location``,
which parses a path or URL) is the only place that branches on the kind of location;
``tests/test_layout.py`` pins it.

| location | back end | directories | steps |
| --- | --- | --- | --- |
| a local path (NFS, Lustre, FUSE too) | ``PosixBackend`` | ``LocalPromotion``, by mode | ``LocalSteps`` |
| any other fsspec URL (``s3://``...) | ``ObjectStoreBackend`` | ``CommitMarker`` | ``ObjectSteps`` |

Each promotion (``LocalPromotion``, ``ObjectPromotion``) is one flow handed its behaviour as an object.

On POSIX, the behaviour by mode (orbax's mode-to-class map):

| mode | behaviour |
| --- | --- |
| ``versioned``, or the target is already a version link | ``Versioned`` |
| ``merge`` | ``Merge`` |
| ``replace``, ``error`` | ``ExchangeRename``; ``RenameAside`` where exchange is refused or |
| | ``SAFEIO_NO_EXCHANGE=1`` |

A new kind of location is one subclass of ``Backend`` (its abstract methods say what it must make; a
forgotten one fails when it is instantiated) naming its fsspec ``protocols``, registered with
``@register_backend``, plus its behaviour classes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from abc import ABC, abstractmethod
from typing import Any, ClassVar, TypeVar

from safeio._errors import InvalidTargetError
from safeio._options import SaveOptions, exchange_disabled
from safeio._promotion import capabilities
from safeio._promotion.aside import RenameAside
from safeio._promotion.atomic_file import AtomicFile, FilePromotion, UploadedFile
from safeio._promotion.base import FilesCheck, PhaseHook, Promotion
from safeio._promotion.behaviour import Behaviour
from safeio._promotion.commit_marker import CommitMarker
from safeio._promotion.exchange import ExchangeRename
from safeio._promotion.leftovers import recover_target
from safeio._promotion.local import LocalPromotion
from safeio._promotion.merge import Merge
from safeio._promotion.object_store import ObjectPromotion
from safeio._promotion.versioned import Versioned
from safeio._storage.claims import claimed
from safeio._storage.dirfd import held_directory, identity, is_component, lstat_at, still_is
from safeio._storage.fsops import remove_at
from safeio._storage.location import Location, resolve
from safeio._storage.locking import lock_path_for
from safeio._storage.names import LATEST, ROOT_LOCK, SEQUENCE, sibling_name
from safeio._storage.posix import rename_noreplace
from safeio._storage.readers import LocalReader, ObjectStoreReader, TargetReader, is_version_link
from safeio._who import who

logger = logging.getLogger("safeio")


class Backend(ABC):
    """Everything that differs by where ``location`` lives."""

    # fsspec protocols this back end serves (``PosixBackend`` serves local paths, ``ObjectStoreBackend``
    # every protocol no other back end names).
    protocols: ClassVar[tuple[str, ...]] = ()

    def __init__(self, location: Location) -> None:
        self.location = location

    def url(self) -> str:
        return self.location.url()

    # -- the writing side ----------------------------------------------------------------------------

    @abstractmethod
    def promotion(
        self,
        options: SaveOptions,
        *,
        rank: int,
        call_id: str,
        on_phase: PhaseHook | None = None,
        check_files: FilesCheck | None = None,
    ) -> Promotion:
        """The writer's promotion of a directory target with ``options``."""

    @abstractmethod
    def file_promotion(
        self, *, exclusive: bool, durable: bool, on_phase: PhaseHook | None = None
    ) -> FilePromotion:
        """The writer's promotion of a single-file target."""

    @abstractmethod
    def make_parent(self) -> None:
        """Make the target's parent directory where directories exist (a file save needs one)."""

    @abstractmethod
    def remove_file(self, *, durable: bool) -> None:
        """Remove a single-file target (or link) so that no reader ever opens it half removed."""

    # -- the reading side ----------------------------------------------------------------------------

    @abstractmethod
    def reader(self, *, owner: int | None = None) -> TargetReader:
        """Reads what the target holds (manifest, completeness, committed step, version). ``owner``: a
        local target is read only as a directory of that uid, never through a link at its name (an entry
        of a directory others may write, judged that uid's); ignored where files have no owner."""

    @abstractmethod
    def holds_checkpoints(self) -> bool:
        """Whether the target looks like a ``Checkpoints`` root (``safeio verify`` checks every step)."""


_B = TypeVar("_B", bound=Backend)


class PosixBackend(Backend):
    """A local POSIX path: local disk, tmpfs, NFS, Lustre, FUSE. Staged beside the target, renamed."""

    def promotion(
        self,
        options: SaveOptions,
        *,
        rank: int,
        call_id: str,
        on_phase: PhaseHook | None = None,
        check_files: FilesCheck | None = None,
    ) -> Promotion:
        return LocalPromotion(
            self.location,
            options,
            rank=rank,
            call_id=call_id,
            recover=recover_target,
            behaviour=self.directory_behaviour(options.mode)(),
            on_phase=on_phase,
            check_files=check_files,
        )

    def directory_behaviour(self, mode: str) -> type[Behaviour]:
        if mode == "versioned" or is_version_link(self.location.path):
            return Versioned
        if mode == "merge":
            return Merge
        if exchange_disabled() or self._exchange_known_refused():
            return RenameAside
        return ExchangeRename

    def _exchange_known_refused(self) -> bool:
        with contextlib.suppress(OSError):
            return capabilities.exchange_refused(os.stat(self.location.parent).st_dev)
        return False  # the parent does not exist yet: ExchangeRename measures once it does

    def file_promotion(
        self, *, exclusive: bool, durable: bool, on_phase: PhaseHook | None = None
    ) -> FilePromotion:
        return AtomicFile(self.location, exclusive=exclusive, durable=durable, on_phase=on_phase)

    def make_parent(self) -> None:
        try:
            os.makedirs(self.location.parent, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:  # a file where a directory goes: bad input
            raise InvalidTargetError(
                f"cannot save {self.location.path}: {exc.filename} is not a directory", self.location.path
            ) from exc

    def remove_file(self, *, durable: bool) -> None:
        name = self.location.name
        with held_directory(self.location.parent, follow=True) as parent_fd:
            st = lstat_at(parent_fd, name)
            if st is None:
                return
            # Renamed aside first: a reader (a resume, an evaluation job) never opens a half-removed file
            # under its name; what a crash leaves is a leftover `safeio gc` removes. Then only the entry
            # judged is removed (a link, never what it points to): in a directory others can write
            # without the sticky bit, another user may rename a tree or file of yours, which they may
            # not delete, to the name in between. That is put back, not deleted.
            with claimed(sibling_name(name, "tmp")) as aside:
                os.rename(name, aside, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
                if still_is(parent_fd, aside, identity(st)):
                    remove_at(parent_fd, aside, what="removed checkpoint", expected=identity(st))
                else:
                    self._put_back(parent_fd, aside)
            if durable:
                os.fsync(parent_fd)

    def _put_back(self, parent_fd: int, aside: str) -> None:
        name, left = self.location.name, aside
        with contextlib.suppress(OSError):
            rename_noreplace(aside, name, parent_fd)
            left = name
        logger.warning(
            "%s: %s was replaced by another entry (renamed there by another user) as it was being removed: "
            "not removed, left as %s",
            who(),
            self.location.path,
            os.path.join(self.location.parent, left),
        )

    def reader(self, *, owner: int | None = None) -> TargetReader:
        return LocalReader(self.location, owner=owner)

    def holds_checkpoints(self) -> bool:
        path = self.location.path
        # Anything under ``latest`` (a FIFO, a link planted there): the root's check reports it.
        if any(os.path.lexists(p) for p in (os.path.join(path, LATEST), os.path.join(path, SEQUENCE))):
            return True
        if os.path.lexists(lock_path_for(path, ROOT_LOCK)):
            return True
        # A root kept without pointer files (a framework's own directory): a step marker below it.
        try:
            names = os.listdir(path)
        except OSError:
            return False
        for name in names:
            sub = os.path.join(path, name)
            step = LocalReader(Location(sub, sub), follow=False)  # a link there is no step
            if is_component(name) and step.committed_marker(check_files=False):
                return True
        return False


class ObjectStoreBackend(Backend):
    """Any fsspec filesystem that is not local: no rename, but a PUT replaces an object whole, so a set
    of objects is committed by a marker written last."""

    def promotion(
        self,
        options: SaveOptions,
        *,
        rank: int,
        call_id: str,
        on_phase: PhaseHook | None = None,
        check_files: FilesCheck | None = None,
    ) -> Promotion:
        return ObjectPromotion(
            self.location,
            options,
            rank=rank,
            call_id=call_id,
            behaviour=CommitMarker(),
            on_phase=on_phase,
            check_files=check_files,
        )

    def file_promotion(
        self, *, exclusive: bool, durable: bool, on_phase: PhaseHook | None = None
    ) -> FilePromotion:
        return UploadedFile(self.location, exclusive=exclusive, durable=durable, on_phase=on_phase)

    def make_parent(self) -> None:
        pass  # prefixes need no directory

    def remove_file(self, *, durable: bool) -> None:
        del durable  # a DELETE is as durable as the store makes it
        fs: Any = self.location.fs
        if fs.exists(self.location.path):
            fs.rm(self.location.path, recursive=True)

    def reader(self, *, owner: int | None = None) -> TargetReader:
        del owner  # an object store's keys have no owner to check; its marker says who committed
        return ObjectStoreReader(self.location)

    def holds_checkpoints(self) -> bool:
        return False  # ``safeio verify`` checks one prefix at a time on object stores


# Back ends that name protocols, the latest registered first (a test's back end for a protocol wins over
# the one it refines). Listed, not found through ``__subclasses__()``: what serves a protocol is a choice
# a reader can see here, not a side effect of which modules happen to be imported.
_REGISTERED: list[type[Backend]] = []


def register_backend(kind: type[_B]) -> type[_B]:
    """Serve ``kind.protocols`` by ``kind`` (a class decorator); ``ObjectStoreBackend`` serves the rest."""
    if not kind.protocols:
        raise ValueError(f"{kind.__name__} names no protocols to serve")
    if kind in _REGISTERED:
        _REGISTERED.remove(kind)
    _REGISTERED.insert(0, kind)
    return kind


def backend_for(target: str | os.PathLike[str] | Location) -> Backend:
    """The back end of ``target`` (a path, ``pathlib.Path``, fsspec URL, or a resolved Location)."""
    location = target if isinstance(target, Location) else resolve(target)
    if location.fs is None:
        return PosixBackend(location)
    protocols = location.fs.protocol
    served = {protocols} if isinstance(protocols, str) else set(protocols)
    for kind in _REGISTERED:
        if served & set(kind.protocols):
            return kind(location)
    return ObjectStoreBackend(location)
