"""A back end that exists only for the tests: proof that a new kind of location plugs in by adding its own
classes, and nothing in ``safeio/``.

``markerdir:///some/dir`` is a local directory seen through fsspec that refuses to rename directories (as
a store without a directory rename would, e.g. a rename-less GCS bucket): saves there must commit by a
marker written last, like an object store. The whole back end is the fsspec filesystem below (the
storage itself) and one ``Backend`` subclass naming its protocol (``ObjectStoreBackend``'s, with the two
file operations a directory tree does differently); its behaviours are safeio's marker-committed ones.
Importing this module registers both (rank processes of a multi-rank test import it through the
function they run).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from safeio._promotion.backends import ObjectStoreBackend, register_backend

PROTOCOL = "markerdir"


class DirectoryRenameRefused(OSError):
    pass


class MarkerDirFileSystem(LocalFileSystem):
    """A local directory under ``markerdir://`` that refuses to move directories (files it copies)."""

    protocol: ClassVar[Any] = (PROTOCOL,)
    root_marker = "/"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(auto_mkdir=True, **kwargs)

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        text = str(path)
        if text.startswith(f"{PROTOCOL}://"):
            text = text[len(PROTOCOL) + 3 :]
        return super()._strip_protocol(text)

    def unstrip_protocol(self, name: str) -> str:
        return f"{PROTOCOL}://{self._strip_protocol(name)}"

    def mv(self, path1: Any, path2: Any, recursive: bool = False, **kwargs: Any) -> None:
        if os.path.isdir(self._strip_protocol(path1)):
            raise DirectoryRenameRefused(f"{PROTOCOL}: directories cannot be renamed ({path1})")
        super().mv(path1, path2, recursive=recursive, **kwargs)

    rename = move = mv


fsspec.register_implementation(PROTOCOL, MarkerDirFileSystem, clobber=True)


@register_backend
class MarkerDirectoryBackend(ObjectStoreBackend):
    """Directories committed by a marker written last, never renamed: the object store's behaviours
    (``CommitMarker``, ``UploadedFile``, ``ObjectSteps``, ``ObjectStoreReader``) over a directory tree,
    which needs its parents made and removes a file without a recursive walk."""

    protocols = (PROTOCOL,)

    def make_parent(self) -> None:
        os.makedirs(os.path.dirname(self.location.path), exist_ok=True)

    def remove_file(self, *, durable: bool) -> None:
        fs: Any = self.location.fs
        fs.rm(self.location.path)
