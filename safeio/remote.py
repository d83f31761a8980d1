"""Promotion to object stores (any fsspec filesystem that is not local) under a commit marker.

There is no rename to lean on, but there is no ``O_TRUNC`` either: a PUT replaces an object whole. The
stage is a private directory on node-local disk; promotion takes the old commit marker down (so the
prefix reads as incomplete while it changes), uploads every file to its final key, writes the manifest
last as the new commit marker, and then deletes keys of the old version the new manifest does not list
(``replace``; ``merge`` keeps them). ``safeio.is_complete`` and ``safeio verify`` read the marker.
Locks are not available on object stores: concurrent writer *jobs* on one prefix are not excluded.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from typing import Any

from safeio import manifest
from safeio._who import who
from safeio.errors import InvalidTargetError, PromotionError, SafeIOError, TargetExistsError
from safeio.promote import Promoter

logger = logging.getLogger("safeio")


def read_remote_manifest(fs: Any, prefix: str) -> dict[str, Any] | None:
    try:
        data = json.loads(fs.cat_file(f"{prefix}/{manifest.MANIFEST_NAME}"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), dict) else None


def remote_problems(fs: Any, prefix: str, record: dict[str, Any]) -> list[str]:
    found = []
    for rel, entry in record["files"].items():
        try:
            size = fs.size(f"{prefix}/{rel}")
        except (OSError, ValueError):
            found.append(f"missing: {rel}")
            continue
        if size != entry.get("size"):
            found.append(f"size mismatch: {rel} is {size} bytes, manifest says {entry.get('size')}")
    return found


class RemotePromoter(Promoter):
    @property
    def fs(self) -> Any:
        return self.location.fs

    @property
    def prefix(self) -> str:
        return self.location.path

    def open_stage(self) -> str:
        if self.mode == "versioned":
            raise InvalidTargetError(
                f"mode='versioned' needs symlinks; object store targets such as {self.location.url()} are "
                "made atomic by their commit marker instead (use mode='replace')",
                self.location.url(),
            )
        try:
            if self.fs.isfile(self.prefix):
                raise InvalidTargetError(
                    f"target {self.location.url()} exists and is an object, not a prefix", self.location.url()
                )
            exists = self.fs.exists(self.prefix)
        except SafeIOError:
            raise
        except OSError as exc:
            raise PromotionError(f"cannot reach {self.location.url()}: {exc}", self.location.url()) from exc
        if self.mode == "error" and exists:
            raise TargetExistsError(
                f"target {self.location.url()} already exists and mode='error'", self.location.url()
            )
        return tempfile.mkdtemp(prefix="safeio-upload-")

    def discard(self, stage: str) -> None:
        shutil.rmtree(stage, ignore_errors=True)

    def finish(self, stage: str) -> None:
        url = self.location.url()
        try:
            entries = self.describe(stage)
            previous = read_remote_manifest(self.fs, self.prefix)
            record = manifest.build(
                entries,
                rank=self.rank,
                call=self.call_id,
                previous=previous if self.mode == "merge" else None,
                result=self.result,
            )
            self.phase("promote")
            marker = f"{self.prefix}/{manifest.MANIFEST_NAME}"
            if previous is not None:
                self.fs.rm_file(marker)  # the prefix is incomplete from here until the new marker lands
            for rel in entries:
                self.fs.put_file(os.path.join(stage, *rel.split("/")), f"{self.prefix}/{rel}")
            self.fs.pipe_file(marker, manifest.dumps(record))
            if self.mode != "merge":
                self.phase("cleanup")
                self._delete_unlisted(record)
        except SafeIOError:
            raise
        except (OSError, ValueError) as exc:
            raise PromotionError(f"could not upload {url}: {exc}", url) from exc
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        logger.debug("%s: committed %s (%d files)", who(self.rank), url, len(entries))

    def _delete_unlisted(self, record: dict[str, Any]) -> None:
        keep = {f"{self.prefix}/{rel}" for rel in record["files"]}
        keep.add(f"{self.prefix}/{manifest.MANIFEST_NAME}")
        stale = [key for key in self.fs.find(self.prefix) if key not in keep]
        if stale:
            self.fs.rm(stale)

    def landed(self) -> bool:
        record = read_remote_manifest(self.fs, self.prefix)
        return (
            record is not None
            and self.is_newer(record.get("call"))
            and not remote_problems(self.fs, self.prefix, record)
        )

    def recorded_result(self) -> Any:
        record = read_remote_manifest(self.fs, self.prefix)
        return record.get("result") if record else None

    def current_call(self) -> object:
        record = read_remote_manifest(self.fs, self.prefix)
        return record.get("call") if record else None
