"""One file promoted atomically: a temporary sibling, fsync, rename, fsync the directory.

The file counterpart of the directory behaviours, used by ``safeio.atomic_open`` (any caller) and by
``safeio.torch_save`` (through the replicated flow). Like python-atomicwrites: the previous content stays
readable under the name until the rename; on any error the temporary file is removed and the target is
untouched. Object stores get one upload of a local temporary file (a PUT replaces an object whole).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from abc import ABC, abstractmethod
from typing import Any

from safeio._boundary import mapped
from safeio._errors import InvalidTargetError, TargetExistsError
from safeio._promotion.base import PhaseHook
from safeio._storage.location import Location
from safeio._storage.names import sibling_name
from safeio._storage.posix import fsync_path


class FilePromotion(ABC):
    """One file: ``open_stage`` gives the path to write, ``finish`` puts it in place, ``discard`` drops it."""

    def __init__(
        self, location: Location, *, exclusive: bool, durable: bool, on_phase: PhaseHook | None = None
    ) -> None:
        self.location = location
        self.exclusive = exclusive
        self.durable = durable
        self._on_phase = on_phase
        self.result: Any = None  # the replicated flow hands it to peers; a file records none

    def phase(self, name: str) -> None:
        if self._on_phase is not None:
            self._on_phase(name)

    @abstractmethod
    def open_stage(self) -> str: ...

    @abstractmethod
    def finish(self, stage: str) -> None: ...

    @abstractmethod
    def discard(self, stage: str) -> None: ...


class AtomicFile(FilePromotion):
    """A local (POSIX, NFS included) file, replaced by rename(2)."""

    def open_stage(self) -> str:
        target, parent = self.location.path, self.location.parent
        if os.path.isdir(target) and not os.path.islink(target):
            raise InvalidTargetError(f"cannot write the file {target}: it is a directory", target)
        if not os.path.isdir(parent):
            raise InvalidTargetError(f"cannot write {target}: its directory {parent} does not exist", target)
        if self.exclusive and os.path.lexists(target):
            raise TargetExistsError(f"{target} already exists and exclusive creation was asked", target)
        temp = os.path.join(parent, sibling_name(self.location.name, "tmp"))
        with mapped(f"cannot create a temporary file for {target}", target):
            os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
        return temp

    def finish(self, stage: str) -> None:
        target = self.location.path
        with mapped(f"could not write {target}", target):
            self.phase("fsync")
            fd = os.open(stage, os.O_RDONLY | os.O_CLOEXEC)
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))  # keep the replaced file's mode
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            self.phase("promote")
            if self.exclusive:
                try:
                    os.link(stage, target)  # EEXIST if a rival created it meanwhile; never overwrites
                except FileExistsError as exc:
                    raise TargetExistsError(
                        f"{target} was created by someone else meanwhile", target
                    ) from exc
                os.unlink(stage)
            else:
                os.replace(stage, target)
            if self.durable:
                fsync_path(self.location.parent, directory=True)

    def discard(self, stage: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stage)


class UploadedFile(FilePromotion):
    """An object-store key, written by one upload of a local temporary file."""

    def open_stage(self) -> str:
        url = self.location.url()
        with mapped(f"cannot reach {url}", url):
            if (
                self.exclusive
                and self.location.fs is not None
                and self.location.fs.exists(self.location.path)
            ):
                raise TargetExistsError(f"{url} already exists and exclusive creation was asked", url)
        return os.path.join(tempfile.mkdtemp(prefix="safeio-upload-"), "data")

    def finish(self, stage: str) -> None:
        url = self.location.url()
        try:
            self.phase("promote")
            with mapped(f"could not upload {url}", url):
                assert self.location.fs is not None
                self.location.fs.put_file(stage, self.location.path)
        finally:
            self.discard(stage)

    def discard(self, stage: str) -> None:
        shutil.rmtree(os.path.dirname(stage), ignore_errors=True)


def file_promotion_for(
    location: Location, *, exclusive: bool, durable: bool, on_phase: PhaseHook | None = None
) -> FilePromotion:
    kind = AtomicFile if location.is_local else UploadedFile
    return kind(location, exclusive=exclusive, durable=durable, on_phase=on_phase)
