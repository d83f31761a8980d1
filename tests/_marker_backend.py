"""A back end that exists only for the tests: proof that a new kind of location plugs in by adding its own
classes, and nothing in ``safeio/``.

``markerdir:///some/dir`` is a local directory seen through fsspec that refuses to rename directories (as
a store without a directory rename would, e.g. a rename-less GCS bucket): saves there must commit by a
marker written last, like an object store. The whole back end is the fsspec filesystem below (the
storage itself) and one ``Backend`` subclass naming its protocol; its behaviours are safeio's existing
marker-committed ones. Importing this module registers both (rank processes of a multi-rank test import
it through the function they run).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from safeio._options import SaveOptions
from safeio._promotion.atomic_file import FilePromotion, UploadedFile
from safeio._promotion.backends import Backend
from safeio._promotion.base import FilesCheck, PhaseHook, Promotion
from safeio._promotion.commit_marker import CommitMarker
from safeio._promotion.step_prefixes import ObjectSteps
from safeio._promotion.steps import StepNames, StepStorage
from safeio._storage.readers import ObjectStoreReader, TargetReader

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


class MarkerDirectoryBackend(Backend):
    """Directories committed by a marker written last, never renamed."""

    protocols = (PROTOCOL,)

    def promotion(
        self,
        options: SaveOptions,
        *,
        rank: int,
        call_id: str,
        on_phase: PhaseHook | None = None,
        check_files: FilesCheck | None = None,
    ) -> Promotion:
        return CommitMarker(
            self.location, options, rank=rank, call_id=call_id, on_phase=on_phase, check_files=check_files
        )

    def file_promotion(
        self, *, exclusive: bool, durable: bool, on_phase: PhaseHook | None = None
    ) -> FilePromotion:
        return UploadedFile(self.location, exclusive=exclusive, durable=durable, on_phase=on_phase)

    def steps(
        self, names: StepNames, options: SaveOptions, *, keep: int | None, megatron_tracker: bool = False
    ) -> StepStorage:
        return ObjectSteps(self.location, names, options, keep=keep, megatron_tracker=megatron_tracker)

    def make_parent(self) -> None:
        os.makedirs(os.path.dirname(self.location.path), exist_ok=True)

    def remove_file(self, *, durable: bool) -> None:
        fs: Any = self.location.fs
        fs.rm(self.location.path)

    def reader(self) -> TargetReader:
        return ObjectStoreReader(self.location)

    def holds_checkpoints(self) -> bool:
        return False
