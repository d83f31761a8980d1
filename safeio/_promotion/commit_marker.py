"""Object stores (any fsspec filesystem that is not local): promotion under a commit marker.

There is no rename to lean on, but there is no ``O_TRUNC`` either: a PUT replaces an object whole. The
stage is a private directory on node-local disk; promotion takes the old commit marker down (so the
prefix reads as incomplete while it changes), uploads every file to its final key, writes the manifest
last as the new commit marker, and then deletes keys of the old version the new manifest does not list
(``replace``; ``merge`` keeps them). ``safeio.is_complete`` and ``safeio verify`` read the marker.
Locks are not available on object stores: concurrent writer *jobs* on one prefix are not excluded.
Recovery needs no step of its own: a prefix without its marker is incomplete until the next save.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

from safeio._boundary import mapped
from safeio._errors import InvalidTargetError, TargetExistsError
from safeio._promotion.base import Promotion
from safeio._storage import manifest
from safeio._storage.dirfd import held_directory
from safeio._storage.fsops import discard_tree
from safeio._storage.readers import ObjectStoreReader
from safeio._who import who

logger = logging.getLogger("safeio")


class CommitMarker(Promotion):
    @property
    def fs(self) -> Any:
        return self.location.fs

    @property
    def prefix(self) -> str:
        return self.location.path

    def open_stage(self) -> str:
        url = self.location.url()
        if self.options.mode == "versioned":
            raise InvalidTargetError(
                f"mode='versioned' needs symlinks; object store targets such as {url} are "
                "made atomic by their commit marker instead (use mode='replace')",
                url,
            )
        with mapped(f"cannot reach {url}", url):
            if self.fs.isfile(self.prefix):
                raise InvalidTargetError(f"target {url} exists and is an object, not a prefix", url)
            exists = self.fs.exists(self.prefix)
        if self.options.mode == "error" and exists:
            raise TargetExistsError(f"target {url} already exists and mode='error'", url)
        return tempfile.mkdtemp(prefix="safeio-upload-")

    def discard(self, stage: str) -> None:
        discard_tree(stage)

    def _prepare(self, stage: str) -> dict[str, dict[str, Any]]:
        # The manifest is the commit marker: always written, whatever the manifest option says.
        with held_directory(stage) as stage_fd:  # our own private directory on node-local disk
            entries = manifest.describe_files(stage_fd, hashes=self.options.durable)
        self.check_staged(entries)
        return entries

    def _promote(self, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        try:
            previous = ObjectStoreReader(self.location).manifest()
            record = self.manifest_record(entries, previous if self.options.mode == "merge" else None)
            marker = f"{self.prefix}/{manifest.MANIFEST_NAME}"
            if previous is not None:
                self.fs.rm_file(marker)  # the prefix is incomplete from here until the new marker lands
            for rel in entries:
                self.fs.put_file(os.path.join(stage, *rel.split("/")), f"{self.prefix}/{rel}")
            self.fs.pipe_file(marker, manifest.dumps(record))
            if self.options.mode != "merge":
                self.phase("cleanup")
                self._delete_unlisted(record)
        finally:
            discard_tree(stage)
        logger.debug("%s: committed %s (%d files)", who(self.rank), self.location.url(), len(entries))

    def _delete_unlisted(self, record: dict[str, Any]) -> None:
        keep = {f"{self.prefix}/{rel}" for rel in record["files"]}
        keep.add(f"{self.prefix}/{manifest.MANIFEST_NAME}")
        stale = [key for key in self.fs.find(self.prefix) if key not in keep]
        if stale:
            self.fs.rm(stale)
