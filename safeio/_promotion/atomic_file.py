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

from safeio._boundary import attach_cleanup_error, mapped, os_failure
from safeio._errors import InvalidTargetError, SafeIOError, TargetExistsError
from safeio._promotion.base import PhaseHook, Promoted
from safeio._promotion.leftovers import remove_dead_temporaries
from safeio._storage import claims
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
        self._stage_path = ""

    def phase(self, name: str) -> None:
        if self._on_phase is not None:
            self._on_phase(name)

    @abstractmethod
    def open_stage(self) -> str: ...

    def open_file(self, mode: str, encoding: str | None = None, newline: str | None = None) -> IO[Any]:
        """The staged file, open for writing (``mode`` "w" or "wb")."""
        return open(self._stage_path, mode, encoding=encoding, newline=newline)

    def write_whole(self, data: bytes) -> None:
        """Write ``data`` as the file's whole new content, or leave the old one (pointer files)."""
        stage = self.open_stage()
        try:
            with self.open_file("wb") as f:
                f.write(data)
        except BaseException as exc:
            try:
                self.discard(stage)
            except OSError as cleanup_error:
                attach_cleanup_error(exc, cleanup_error)
            raise
        self.finish(stage)

    @abstractmethod
    def finish(self, stage: str, *, result: Any = None) -> Promoted:
        """Put the staged file in place (a file records no ``result``: it has no manifest)."""

    @abstractmethod
    def discard(self, stage: str) -> None: ...


class AtomicFile(FilePromotion):
    """A local (POSIX, NFS included) file, replaced by rename(2), every step relative to the held parent.

    The temporary file is created ``O_EXCL|O_NOFOLLOW`` and written through the descriptor it was created
    with (``open_file``), so a name swapped for a link meanwhile is never written through.

    The step count is python-atomicwrites' (create, write, fsync, rename, fsync the directory) plus one
    ``lstat`` before (a directory or an existing target under ``"x"`` is refused up front) and one after
    (the replaced file's mode); ``atomic_open`` is measured against it in figure 2 of the benchmarks.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parent_fd = -1
        self._fd = -1
        self._name = ""
        self._target_name = ""
        self._file: IO[Any] | None = None

    def open_stage(self) -> str:
        target = self.location.path
        parent, name = os.path.split(target)  # resolve() gave an absolute, normalised path
        self._target_name = name
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
        self._name = claims.claim(sibling_name(name, "tmp"))  # released by _close()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            self._fd = os.open(self._name, flags, 0o666, dir_fd=self._parent_fd)
        except BaseException as exc:
            self._close()
            if isinstance(exc, OSError):
                raise os_failure(f"cannot create a temporary file for {target}", target, exc) from exc
            raise
        remove_dead_temporaries(parent, self._parent_fd, own=self._name)
        return os.path.join(parent, self._name)

    def open_file(self, mode: str, encoding: str | None = None, newline: str | None = None) -> IO[Any]:
        """The temporary file, open for writing through the descriptor that created it.

        The file object borrows the descriptor (``closefd=False``: no dup, the descriptor stays ours for
        the fsync) and is closed, so flushed, by ``finish``/``discard`` if the caller has not closed it.
        """
        # Not a context manager: the caller's ``with`` closes it, or finish/discard do.
        self._file = open(self._fd, mode, encoding=encoding, newline=newline, closefd=False)  # noqa: SIM115
        return self._file

    def finish(self, stage: str, *, result: Any = None) -> Promoted:
        try:
            self._replace()
        except BaseException as exc:
            # Here, while the parent is still held: a rival's file under "x", or a failed fsync, left the
            # temporary file behind once the descriptors were closed, and the caller's discard() found
            # nothing to remove it through.
            self._remove_temporary(exc)
            raise
        finally:
            self._close()
        return Promoted()

    def _replace(self) -> None:
        target, fd, name = self.location.path, self._parent_fd, self._target_name
        try:
            self.phase("fsync")
            if self._file is not None:
                self._file.close()  # a caller's unflushed buffer reaches the file before the fsync
            kept = kept_mode(lstat_at(fd, name))
            if kept is not None:
                os.fchmod(self._fd, kept)
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
        except SafeIOError:
            raise
        except OSError as exc:
            raise os_failure(f"could not write {target}", target, exc) from exc

    def _remove_temporary(self, error: BaseException) -> None:
        if self._parent_fd < 0 or not self._name:
            return
        try:
            os.unlink(self._name, dir_fd=self._parent_fd)
        except FileNotFoundError:
            pass  # renamed into place before the failure
        except OSError as cleanup_error:
            attach_cleanup_error(error, cleanup_error)

    def discard(self, stage: str) -> None:
        try:
            if self._file is not None:
                with contextlib.suppress(OSError, ValueError):  # the flush of a file being thrown away
                    self._file.close()
            if self._parent_fd >= 0 and self._name:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._name, dir_fd=self._parent_fd)
        finally:
            self._close()

    def _close(self) -> None:
        claims.release(self._name)  # renamed into place, removed, or a leftover for recovery
        fd, parent_fd = self._fd, self._parent_fd
        self._fd = self._parent_fd = -1
        self._file = None
        for value in (fd, parent_fd):
            if value >= 0:
                with contextlib.suppress(OSError):
                    os.close(value)


def kept_mode(replaced: os.stat_result | None) -> int | None:
    """The permission bits a new file takes from the one it replaces; None: the umask's default.

    Only from a regular file of this euid (a link is not followed: one planted at the name would choose
    our mode), and never its set-id or sticky bits: in a sticky share, another user's file planted 06777
    under the name root writes made root's new file root-owned 06777, a pickle root later loads that
    the planter could then rewrite.
    """
    if replaced is None or not stat.S_ISREG(replaced.st_mode) or replaced.st_uid != os.geteuid():
        return None
    return stat.S_IMODE(replaced.st_mode) & 0o777


class UploadedFile(FilePromotion):
    """An object-store key, written by one upload of a local temporary file."""

    @property
    def fs(self) -> Any:
        return self.location.fs

    def open_stage(self) -> str:
        url = self.location.url()
        with mapped(f"cannot reach {url}", url):
            if self.exclusive and self.fs.exists(self.location.path):
                raise TargetExistsError(f"{url} already exists and exclusive creation was asked", url)
        self._stage_path = os.path.join(tempfile.mkdtemp(prefix="safeio-upload-"), "data")
        return self._stage_path

    def finish(self, stage: str, *, result: Any = None) -> Promoted:
        url = self.location.url()
        try:
            self.phase("promote")
            with mapped(f"could not upload {url}", url):
                self.fs.put_file(stage, self.location.path)
        finally:
            self.discard(stage)
        return Promoted()

    def discard(self, stage: str) -> None:
        shutil.rmtree(os.path.dirname(stage), ignore_errors=True)
