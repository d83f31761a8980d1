"""For readers: is a target complete, and which single version should a loader read."""

from __future__ import annotations

import os

from safeio import manifest
from safeio.names import parse
from safeio.remote import read_remote_manifest, remote_problems
from safeio.storage import resolve


def verify(path: str | os.PathLike[str], *, check_hashes: bool = True) -> list[str]:
    """Everything wrong with a promoted target against its manifest (empty when it is complete)."""
    location = resolve(path)
    if location.is_local:
        if not os.path.isdir(location.path):
            return [f"missing: {location.path} is not a directory"]
        record = manifest.read(location.path)
        if record is None:
            return [f"no readable {manifest.MANIFEST_NAME} in {location.path}"]
        return manifest.problems(location.path, record, check_hashes=check_hashes)
    record = read_remote_manifest(location.fs, location.path)
    if record is None:
        return [f"no commit marker ({manifest.MANIFEST_NAME}) under {location.url()}: incomplete"]
    return remote_problems(location.fs, location.path, record)


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
    if location.is_local and os.path.islink(location.path):
        pointee = os.readlink(location.path)
        sibling = parse(pointee)
        if sibling is not None and sibling.kind == "v" and "/" not in pointee:
            return os.path.join(location.parent, pointee)
    return location.path if location.is_local else location.url()
