"""The reading side of a target: its manifest, whether it is complete, which version a loader should read,
whether a checkpoint step is committed.

One reader per kind of location, like fsspec's one filesystem object per protocol: ``LocalReader`` for a
POSIX directory (NFS included), ``ObjectStoreReader`` for a prefix under a commit marker. The target's back
end (``safeio._promotion.backends``) makes them. Peers waiting for a save, ``safeio.verify``,
``is_complete``, ``snapshot``, ``Checkpoints``, the integrations and the ``safeio`` command all read
through them; the writing side is ``safeio._promotion``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from safeio._errors import InvalidTargetError
from safeio._storage import manifest
from safeio._storage.dirfd import FILE_FLAGS, held_directory, lstat_at
from safeio._storage.location import Location
from safeio._storage.metadata import MANIFEST_CAP, Damaged, load_manifest, parse_json, validate_manifest
from safeio._storage.names import is_version_pointee


def version_pointee(name: str, *, dir_fd: int | None = None) -> str | None:
    """What a versioned target's link names (a version directory beside it), or None if ``name`` is not
    such a link. The pointee is one component, parsed as a version of ``name``: never a path elsewhere."""
    try:
        pointee = os.readlink(name, dir_fd=dir_fd)
    except OSError:
        return None
    return pointee if is_version_pointee(pointee, os.path.basename(name)) else None


def is_version_link(path: str) -> bool:
    """Whether ``path`` is a symlink safeio made for a versioned target."""
    return version_pointee(path) is not None


NO_SUCH_TARGET = "no such file or directory"
NOT_A_DIRECTORY = "not a directory"


def why_not_a_directory(path: str) -> str | None:
    """Why ``path`` names no directory (``NO_SUCH_TARGET``, ``NOT_A_DIRECTORY``, no permission, a name
    too long or looping), or None when it names one. A failure of the filesystem itself (EIO, ESTALE) is
    raised: it says nothing about the path given."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return NO_SUCH_TARGET
    except PermissionError:
        return "permission denied (cannot reach it as this user)"
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP):
            return exc.strerror or str(exc)
        raise
    return None if stat.S_ISDIR(st.st_mode) else NOT_A_DIRECTORY


class TargetReader(ABC):
    """Reads what a promoted target holds, never changing it."""

    # Whether every version carries its manifest whatever the save's options (an object store's is the
    # commit marker), so that a peer recognises a save by it.
    marker_required = False

    def __init__(self, location: Location) -> None:
        self.location = location

    @abstractmethod
    def exists(self) -> bool:
        """Whether anything is at the target (a directory, or a prefix with objects)."""

    @abstractmethod
    def manifest(self) -> dict[str, Any] | None:
        """The target's manifest (commit marker), or None when absent or unreadable."""

    @abstractmethod
    def problems(self, record: dict[str, Any], *, check_hashes: bool) -> list[str]:
        """What at the target disagrees with ``record`` (empty when complete)."""

    @abstractmethod
    def no_manifest_problem(self) -> str:
        """How ``verify`` reports a target without a readable manifest."""

    @abstractmethod
    def is_step(self) -> bool:
        """Whether the target can be a committed checkpoint step at all (a real directory; a link
        planted under a step's name never is)."""

    @abstractmethod
    def file_exists(self) -> bool:
        """For a single-file target: whether it is there."""

    @abstractmethod
    def manifest_version(self) -> list[int] | None:
        """``manifest.version_of`` the manifest now, with one stat (None where that cannot be told)."""

    @abstractmethod
    def snapshot(self) -> str:
        """The directory (or URL) a reader loads from to see one consistent version."""

    @abstractmethod
    def unlisted(self, record: dict[str, Any]) -> list[str]:
        """Files present but not in ``record`` (a merge directory may hold other tools' files)."""

    def describe_missing_manifest(self) -> str:
        """What ``safeio verify`` says of a target without its manifest (the same as ``verify``)."""
        return self.no_manifest_problem()

    @abstractmethod
    def absence(self) -> str | None:
        """Why nothing is at the target to read (``NO_SUCH_TARGET``, ``NOT_A_DIRECTORY``, no permission),
        or None when something is: ``safeio verify`` reports a path that names nothing as bad input, as
        ``safeio ls`` and ``safeio gc`` do."""

    def verify(self, *, check_hashes: bool = True) -> list[str]:
        if not self.exists():
            return [f"missing: {self.location.url()} is not a directory"]
        record = self.manifest()
        if record is None:
            return [self.no_manifest_problem()]
        return self.problems(record, check_hashes=check_hashes)

    @abstractmethod
    def owner(self, record: dict[str, Any]) -> int | None:
        """The uid that wrote the manifest ``record`` of the target (a local manifest file's owner; on an
        object store, what the marker says), or None when it cannot be told."""

    def committed_marker(self, *, check_files: bool = True) -> dict[str, Any] | None:
        """The marker of a committed checkpoint step at the target: a manifest with an integer step that
        lists every file at its size (``check_files=False``: the marker alone, for ordering steps that
        were committed, not for resuming from one). None for anything else. The one answer to "is this
        step committed" (``Checkpoints``, the integrations, ``safeio ls`` and ``safeio verify`` ask it)."""
        if not self.is_step():
            return None
        record = self.manifest()
        step = record.get("step") if record is not None else None
        if record is None or isinstance(step, bool) or not isinstance(step, int):
            return None
        if check_files and self.problems(record, check_hashes=False):
            return None
        return record

    def committed_step(self) -> int | None:
        record = self.committed_marker()
        return int(record["step"]) if record is not None else None


class LocalReader(TargetReader):
    """``follow=False``: a checkpoint step, never a link, is read where it was found a directory. Its name
    is under a root others may write: the step was judged a directory by ``lstat`` (``is_step``), then
    read by path, and a link put in its place in between (its owner's own entry, even in a sticky root)
    made ``latest()`` choose another run's step of this user's through it.

    ``owner``: besides, only a directory of that uid is read, each read through one descriptor: another
    user who renamed a step of root's away in a root without the sticky bit and put a link, or a directory
    of theirs, in its place once ``safeio verify`` had judged it made root's verify hash what they chose
    (a manifest listing a sparse 1 TiB file: hours)."""

    def __init__(self, location: Location, *, follow: bool = True, owner: int | None = None) -> None:
        super().__init__(location)
        self._follow = follow and owner is None
        self._owner = owner

    @contextlib.contextmanager
    def _held(self) -> Iterator[int]:
        """The target held open for one read: with ``owner``, only a directory of that uid (OSError)."""
        with held_directory(self.location.path, follow=self._follow) as fd:
            if self._owner is not None and os.fstat(fd).st_uid != self._owner:
                raise OSError(errno.EPERM, f"not a directory of uid {self._owner}", self.location.path)
            yield fd

    def exists(self) -> bool:
        return os.path.isdir(self.location.path) if self._follow else self.is_step()

    def verify(self, *, check_hashes: bool = True) -> list[str]:
        if self._owner is not None and os.path.lexists(self.location.path) and not self.is_step():
            return [self._not_owned()]
        return super().verify(check_hashes=check_hashes)

    def absence(self) -> str | None:
        return why_not_a_directory(self.location.path)

    def manifest(self) -> dict[str, Any] | None:
        if self._owner is None:
            return manifest.read(self.location.path, follow=self._follow)
        try:
            with self._held() as fd:
                record = load_manifest(fd, manifest.MANIFEST_NAME)
        except OSError:
            return None
        return None if isinstance(record, Damaged) else record

    def problems(self, record: dict[str, Any], *, check_hashes: bool) -> list[str]:
        path = self.location.path
        if self._owner is None:
            return manifest.problems(path, record, check_hashes=check_hashes, follow=self._follow)
        try:
            with self._held() as fd:
                return manifest.problems_at(fd, record, check_hashes=check_hashes)
        except OSError:
            return [self._not_owned()]

    def no_manifest_problem(self) -> str:
        if self._owner is not None and not self.is_step():
            return self._not_owned()
        return f"no readable {manifest.MANIFEST_NAME} in {self.location.path}"

    def _not_owned(self) -> str:
        return (
            f"{self.location.path} is no longer a directory of uid {self._owner} (a link, or another user's "
            "directory, was put in its place): not read"
        )

    def is_step(self) -> bool:
        try:
            found = os.lstat(self.location.path)
        except OSError:
            return False
        return stat.S_ISDIR(found.st_mode) and self._owner in (None, found.st_uid)

    def owner(self, record: dict[str, Any]) -> int | None:
        # The manifest file's owner: another user cannot make a file that is ours, whatever it says.
        try:
            if self._follow:
                return os.lstat(os.path.join(self.location.path, manifest.MANIFEST_NAME)).st_uid
            with held_directory(self.location.path) as fd:
                marker = lstat_at(fd, manifest.MANIFEST_NAME)
            return marker.st_uid if marker is not None else None
        except OSError:
            return None

    def file_exists(self) -> bool:
        return os.path.exists(self.location.path)

    def manifest_version(self) -> list[int] | None:
        # By path: a peer holds no handle on the share. Only metadata is read, and a link planted on
        # the way can only show a version that is not the promoted one, which a full check judges.
        with contextlib.suppress(OSError):
            return manifest.version_of(os.lstat(os.path.join(self.location.path, manifest.MANIFEST_NAME)))
        return None

    def snapshot(self) -> str:
        pointee = version_pointee(self.location.path)
        return os.path.join(self.location.parent, pointee) if pointee is not None else self.location.path

    def unlisted(self, record: dict[str, Any]) -> list[str]:
        listed = set(record["files"])
        with self._held() as fd:
            return [rel for rel in manifest.content_files(fd) if rel not in listed]


class ObjectStoreReader(TargetReader):
    """A prefix under a commit marker. ``sizes``: relative key -> size of every object under the prefix,
    from a listing the caller made already (``Checkpoints`` lists a root once for all its steps); else
    each is asked for."""

    marker_required = True

    def __init__(self, location: Location, *, sizes: dict[str, int] | None = None) -> None:
        super().__init__(location)
        self._sizes = sizes

    @property
    def fs(self) -> Any:
        return self.location.fs

    def _size(self, rel: str) -> int | None:
        if self._sizes is not None:
            return self._sizes.get(rel)
        try:
            return int(self.fs.size(self._key(rel)))
        except (OSError, ValueError):
            return None

    def _key(self, rel: str) -> str:
        return f"{self.location.path}/{rel}"

    def exists(self) -> bool:
        # A prefix "exists" on an object store only through its keys; a missing marker is reported as
        # an incomplete commit rather than a missing directory.
        return True

    def manifest(self) -> dict[str, Any] | None:
        key = self._key(manifest.MANIFEST_NAME)
        size = self._size(manifest.MANIFEST_NAME)
        if size is None or size > MANIFEST_CAP:
            return None
        try:
            raw = self.fs.cat_file(key, end=MANIFEST_CAP + 1)
        except (OSError, ValueError):
            return None
        parsed = parse_json(raw, manifest.MANIFEST_NAME, MANIFEST_CAP)
        record = validate_manifest(parsed) if not isinstance(parsed, Damaged) else parsed
        return None if isinstance(record, Damaged) else record

    def problems(self, record: dict[str, Any], *, check_hashes: bool) -> list[str]:
        # Object stores keep their own checksums; sizes are what a half-finished upload gets wrong.
        found = []
        for rel, entry in record["files"].items():
            size = self._size(rel)
            if size is None:
                found.append(f"missing: {rel}")
                continue
            if size != entry.get("size"):
                found.append(f"size mismatch: {rel} is {size} bytes, manifest says {entry.get('size')}")
        return found

    def no_manifest_problem(self) -> str:
        return f"no commit marker ({manifest.MANIFEST_NAME}) under {self.location.url()}: incomplete"

    def _objects(self) -> list[str]:
        try:
            return [key for key in self.fs.find(self.location.path) if not key.endswith("/")]
        except (OSError, ValueError):
            return []

    def absence(self) -> str | None:
        return None if self._objects() else NO_SUCH_TARGET

    def describe_missing_manifest(self) -> str:
        # No marker: either nothing was ever committed there, or an upload stopped before its last step.
        objects = self._objects()
        if not objects:
            return f"missing: nothing under {self.location.url()}"
        return (
            f"incomplete commit: {len(objects)} object(s) under {self.location.url()} but no commit marker "
            f"({manifest.MANIFEST_NAME}); the upload did not finish or is still running"
        )

    def is_step(self) -> bool:
        return True  # a prefix is whatever its marker says

    def owner(self, record: dict[str, Any]) -> int | None:
        # Object stores have no uids of their own; the marker records its writer's (as the local ones
        # do), which tells this job's steps from another user's in a shared bucket.
        writer = record.get("writer")
        uid = writer.get("uid") if isinstance(writer, dict) else None
        return uid if isinstance(uid, int) and not isinstance(uid, bool) else None

    def file_exists(self) -> bool:
        return bool(self.fs.exists(self.location.path))

    def manifest_version(self) -> list[int] | None:
        return None  # no inode to stat: a peer reads the marker

    def snapshot(self) -> str:
        return self.location.url()

    def unlisted(self, record: dict[str, Any]) -> list[str]:
        return []  # a commit's upload deletes what its marker does not list (replace mode)


def read_pointer(path: str | os.PathLike[str]) -> str | None:
    """The text of a pointer file (``latest``), or None when there is none.

    Anything else under its name is refused with InvalidTargetError naming it, never followed or read
    whole: opened ``O_NOFOLLOW`` (a link to ``/etc/passwd``, which DeepSpeed-style loaders follow, is
    not) and ``O_NONBLOCK`` (a FIFO never hangs), a regular file by ``fstat``, of at most POINTER_CAP
    bytes before anything is read (a 1 GiB file is not).
    """
    shown = os.fspath(path)
    try:
        fd = os.open(path, FILE_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        what = "a symbolic link" if exc.errno == errno.ELOOP else f"unreadable ({exc.strerror or exc})"
        raise _bad_pointer(shown, what) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _bad_pointer(shown, "not a regular file")
        if st.st_size > POINTER_CAP:
            raise _bad_pointer(shown, f"{st.st_size} bytes, over the {POINTER_CAP}-byte limit")
        data = os.read(fd, POINTER_CAP + 1)
    except OSError as exc:
        raise _bad_pointer(shown, f"unreadable ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)
    if len(data) > POINTER_CAP:
        raise _bad_pointer(shown, f"over the {POINTER_CAP}-byte limit")
    return data.decode("utf-8", "replace").strip()


def _bad_pointer(path: str, what: str) -> InvalidTargetError:
    return InvalidTargetError(f"the pointer file {path} is {what}: not a pointer safeio wrote", path)


POINTER_CAP = 4096
