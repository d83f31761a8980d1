"""The reading side of a target: its manifest, whether it is complete, which version a loader should read.

One reader per kind of location, like fsspec's one filesystem object per protocol: ``LocalReader`` for a
POSIX directory (NFS included), ``ObjectStoreReader`` for a prefix under a commit marker. Peers waiting for
a save, ``safeio.verify``, ``is_complete``, ``snapshot`` and the ``safeio verify`` command all read through
them; the writing side is ``safeio._promotion``.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any

from safeio._storage import manifest
from safeio._storage.location import Location, resolve
from safeio._storage.metadata import MANIFEST_CAP, Damaged, parse_json, validate_manifest
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


class TargetReader(ABC):
    """Reads what a promoted target holds, never changing it."""

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

    def verify(self, *, check_hashes: bool = True) -> list[str]:
        if not self.exists():
            return [f"missing: {self.location.url()} is not a directory"]
        record = self.manifest()
        if record is None:
            return [self.no_manifest_problem()]
        return self.problems(record, check_hashes=check_hashes)


class LocalReader(TargetReader):
    def exists(self) -> bool:
        return os.path.isdir(self.location.path)

    def manifest(self) -> dict[str, Any] | None:
        return manifest.read(self.location.path)

    def problems(self, record: dict[str, Any], *, check_hashes: bool) -> list[str]:
        return manifest.problems(self.location.path, record, check_hashes=check_hashes)

    def no_manifest_problem(self) -> str:
        return f"no readable {manifest.MANIFEST_NAME} in {self.location.path}"


class ObjectStoreReader(TargetReader):
    @property
    def fs(self) -> Any:
        return self.location.fs

    def _key(self, rel: str) -> str:
        return f"{self.location.path}/{rel}"

    def exists(self) -> bool:
        # A prefix "exists" on an object store only through its keys; a missing marker is reported as
        # an incomplete commit rather than a missing directory.
        return True

    def manifest(self) -> dict[str, Any] | None:
        key = self._key(manifest.MANIFEST_NAME)
        try:
            if self.fs.size(key) > MANIFEST_CAP:
                return None
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
            try:
                size = self.fs.size(self._key(rel))
            except (OSError, ValueError):
                found.append(f"missing: {rel}")
                continue
            if size != entry.get("size"):
                found.append(f"size mismatch: {rel} is {size} bytes, manifest says {entry.get('size')}")
        return found

    def no_manifest_problem(self) -> str:
        return f"no commit marker ({manifest.MANIFEST_NAME}) under {self.location.url()}: incomplete"


def reader_for(location: Location) -> TargetReader:
    return LocalReader(location) if location.is_local else ObjectStoreReader(location)


def verify(path: str | os.PathLike[str], *, check_hashes: bool = True) -> list[str]:
    """Everything wrong with a promoted target against its manifest (empty when it is complete)."""
    return reader_for(resolve(path)).verify(check_hashes=check_hashes)


def is_complete(path: str | os.PathLike[str]) -> bool:
    """True when the target has its manifest (the commit marker) and every file it lists, at its size."""
    return not verify(path, check_hashes=False)


def snapshot(path: str | os.PathLike[str]) -> str:
    """The directory a reader should load from to see one consistent version.

    For a ``mode="versioned"`` target this resolves the link once, to an immutable version directory
    that stays for the grace period even if a writer publishes a newer one meanwhile; any other target
    is returned as it is.
    """
    location = resolve(path)
    if not location.is_local:
        return location.url()
    pointee = version_pointee(location.path)
    return os.path.join(location.parent, pointee) if pointee is not None else location.path
