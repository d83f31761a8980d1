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
from typing import IO, Any

from safeio._boundary import mapped
from safeio._errors import InvalidTargetError, TargetExistsError
from safeio._promotion.base import PhaseHook
from safeio._storage.dirfd import lstat_at
from safeio._storage.location import Location
from safeio._storage.names import sibling_name


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
        self._stage_path = ""

    def phase(self, name: str) -> None:
        if self._on_phase is not None:
            self._on_phase(name)

    @abstractmethod
    def open_stage(self) -> str: ...

    def open_file(self, mode: str, encoding: str | None = None, newline: str | None = None) -> IO[Any]:
        """The staged file, open for writing (``mode`` "w" or "wb")."""
        return open(self._stage_path, mode, encoding=encoding, newline=newline)

    @abstractmethod
    def finish(self, stage: str) -> None: ...

    @abstractmethod
    def discard(self, stage: str) -> None: ...


class AtomicFile(FilePromotion):
    """A local (POSIX, NFS included) file, replaced by rename(2), every step relative to the held parent.

    The temporary file is created ``O_EXCL|O_NOFOLLOW`` and written through the descriptor it was created
    with (``open_file``), so a name swapped for a link meanwhile is never written through.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parent_fd = -1
        self._fd = -1
        self._name = ""

    def open_stage(self) -> str:
        target, parent, name = self.location.path, self.location.parent, self.location.name
        try:
            self._parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise InvalidTargetError(
                f"cannot write {target}: its directory {parent} does not exist", target
            ) from exc
        st = lstat_at(self._parent_fd, name)
        if st is not None and stat.S_ISDIR(st.st_mode):
            self._close()
            raise InvalidTargetError(f"cannot write the file {target}: it is a directory", target)
        if self.exclusive and st is not None:
            self._close()
            raise TargetExistsError(f"{target} already exists and exclusive creation was asked", target)
        self._name = sibling_name(name, "tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with mapped(f"cannot create a temporary file for {target}", target):
            try:
                self._fd = os.open(self._name, flags, 0o666, dir_fd=self._parent_fd)
            except BaseException:
                self._close()
                raise
        return os.path.join(parent, self._name)

    def open_file(self, mode: str, encoding: str | None = None, newline: str | None = None) -> IO[Any]:
        """The temporary file, open for writing through the descriptor that created it."""
        return os.fdopen(os.dup(self._fd), mode, encoding=encoding, newline=newline)

    def finish(self, stage: str) -> None:
        target, fd, name = self.location.path, self._parent_fd, self.location.name
        try:
            with mapped(f"could not write {target}", target):
                self.phase("fsync")
                with contextlib.suppress(FileNotFoundError):
                    current = os.stat(name, dir_fd=fd)  # the replaced file's mode is kept
                    os.fchmod(self._fd, stat.S_IMODE(current.st_mode))
                if self.durable:
                    os.fsync(self._fd)
                self.phase("promote")
                if self.exclusive:
                    try:  # EEXIST if a rival created it meanwhile; never overwrites
                        os.link(self._name, name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
                    except FileExistsError as exc:
                        raise TargetExistsError(
                            f"{target} was created by someone else meanwhile", target
                        ) from exc
                    os.unlink(self._name, dir_fd=fd)
                else:
                    os.replace(self._name, name, src_dir_fd=fd, dst_dir_fd=fd)
                if self.durable:
                    os.fsync(fd)
        finally:
            self._close()

    def discard(self, stage: str) -> None:
        try:
            if self._parent_fd >= 0 and self._name:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._name, dir_fd=self._parent_fd)
        finally:
            self._close()

    def _close(self) -> None:
        for attribute in ("_fd", "_parent_fd"):
            value = getattr(self, attribute)
            if value >= 0:
                setattr(self, attribute, -1)
                with contextlib.suppress(OSError):
                    os.close(value)


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
        self._stage_path = os.path.join(tempfile.mkdtemp(prefix="safeio-upload-"), "data")
        return self._stage_path

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
