"""Object stores (any fsspec filesystem that is not local): a directory save committed by its marker
(``CommitMarker``, the behaviour ``ObjectPromotion`` is handed for a directory save).

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
from safeio._promotion.object_store import ObjectBehaviour, ObjectPromotion
from safeio._storage import manifest
from safeio._storage.dirfd import held_directory
from safeio._storage.fsops import discard_tree
from safeio._storage.readers import ObjectStoreReader
from safeio._who import who

logger = logging.getLogger("safeio")


class CommitMarker(ObjectBehaviour):
    """A directory save: staged on node-local disk, uploaded under the prefix at the commit."""

    def open_stage(self, p: ObjectPromotion) -> str:
        url = p.location.url()
        if p.options.mode == "versioned":
            raise InvalidTargetError(
                f"mode='versioned' needs symlinks; object store targets such as {url} are "
                "made atomic by their commit marker instead (use mode='replace')",
                url,
            )
        with mapped(f"cannot reach {url}", url):
            if p.fs.isfile(p.prefix):
                raise InvalidTargetError(f"target {url} exists and is an object, not a prefix", url)
            exists = p.fs.exists(p.prefix)
        if p.options.mode == "error" and exists:
            raise TargetExistsError(f"target {url} already exists and mode='error'", url)
        return tempfile.mkdtemp(prefix="safeio-upload-")

    def discard(self, p: ObjectPromotion, stage: str) -> None:
        discard_tree(stage)

    def describe(self, p: ObjectPromotion, stage: str) -> dict[str, dict[str, Any]]:
        # The manifest is the commit marker: always written, whatever the manifest option says.
        with held_directory(stage) as stage_fd:  # our own private directory on node-local disk
            return manifest.describe_files(stage_fd, hashes=p.options.durable)

    def commit(self, p: ObjectPromotion, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        fs, prefix = p.fs, p.prefix
        try:
            previous = ObjectStoreReader(p.location).manifest()
            record = p.manifest_record(entries, previous if p.options.mode == "merge" else None)
            marker = f"{prefix}/{manifest.MANIFEST_NAME}"
            if previous is not None:
                fs.rm_file(marker)  # the prefix is incomplete from here until the new marker lands
            for rel in entries:
                fs.put_file(os.path.join(stage, *rel.split("/")), f"{prefix}/{rel}")
            fs.pipe_file(marker, manifest.dumps(record))
            if p.options.mode != "merge":
                p.phase("cleanup")
                _delete_unlisted(fs, prefix, record)
        finally:
            discard_tree(stage)
        logger.debug("%s: committed %s (%d files)", who(p.rank), p.location.url(), len(entries))


def _delete_unlisted(fs: Any, prefix: str, record: dict[str, Any]) -> None:
    keep = {f"{prefix}/{rel}" for rel in record["files"]}
    keep.add(f"{prefix}/{manifest.MANIFEST_NAME}")
    stale = [key for key in fs.find(prefix) if key not in keep]
    if stale:
        fs.rm(stale)
