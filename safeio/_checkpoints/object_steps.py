"""Checkpoints on an object store (``s3://``, any fsspec URL): each step written in place, committed by its
marker, then ``latest``.

There is no rename on an object store, and no need for one: a PUT replaces an object whole and a
listing shows only whole objects. So every rank writes its part straight under the step's prefix
(``dcp.save`` to ``s3://bucket/run/step_5``); the writer's replicated files (tokenizer, trainer state)
are written to node-local scratch in the body and uploaded at the commit. The commit lists the prefix,
writes the manifest of every object last — the commit marker — and then the ``latest`` pointer object.
A step without its marker is never a checkpoint: ``latest()`` ignores it.

An in-progress object (``.safeio-in-progress``) written first says the prefix is this layer's own work:
a save of the same step after a crash removes the leftovers of the interrupted one; a prefix holding
objects without it is someone else's, and is refused. Retention takes a step's marker down first (the
step stops being a checkpoint at once), then deletes its objects. Object stores have no locks: two jobs
saving into one root at the same time are not excluded (as for every object-store save of safeio).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Any

from safeio._boundary import mapped
from safeio._checkpoints.committed import poll_until
from safeio._checkpoints.naming import StepNames
from safeio._checkpoints.steps import LATEST, MEGATRON_TRACKER, StepStorage
from safeio._errors import InvalidTargetError, TargetExistsError
from safeio._options import SaveOptions
from safeio._storage import manifest
from safeio._storage.dirfd import held_directory
from safeio._storage.location import Location
from safeio._storage.metadata import MANIFEST_CAP, Damaged, parse_json, validate_manifest
from safeio._who import who

logger = logging.getLogger("safeio")

IN_PROGRESS = ".safeio-in-progress"


class ObjectSteps(StepStorage):
    """The steps of a checkpoint root on an object store."""

    in_place_replicated = False  # the writer's replicated files are uploaded at the commit

    def __init__(
        self,
        location: Location,
        names: StepNames,
        options: SaveOptions,
        keep: int | None,
        megatron_tracker: bool,
    ) -> None:
        assert location.fs is not None, "an object-store location"
        super().__init__(names, options, keep, megatron_tracker)
        self.fs: Any = location.fs
        self.location = location
        self.prefix = location.path
        self.root_url = location.url()

    def url(self, name: str) -> str:
        return self.location.url(f"{self.prefix}/{name}")

    def _key(self, name: str, rel: str = "") -> str:
        return f"{self.prefix}/{name}/{rel}" if rel else f"{self.prefix}/{name}"

    def _listing(self) -> dict[str, dict[str, int]]:
        """step name -> {relative key: size} of everything under the root (one LIST, fresh)."""
        self.fs.invalidate_cache(self.prefix)
        steps: dict[str, dict[str, int]] = {}
        try:
            found = self.fs.find(self.prefix, detail=True)
        except FileNotFoundError:
            return steps
        for key, info in found.items():
            rel = key[len(self.prefix) + 1 :] if key.startswith(self.prefix + "/") else ""
            name, _, inner = rel.partition("/")
            if inner and info.get("type", "file") == "file":
                steps.setdefault(name, {})[inner] = int(info.get("size") or 0)
        return steps

    def _marker(self, name: str) -> dict[str, Any] | None:
        """The validated commit marker of step directory ``name``, or None (absent, damaged, too big)."""
        key = self._key(name, manifest.MANIFEST_NAME)
        try:
            raw = self.fs.cat_file(key, end=MANIFEST_CAP + 1)
        except (OSError, ValueError):
            return None
        parsed = parse_json(raw, manifest.MANIFEST_NAME, MANIFEST_CAP)
        record = validate_manifest(parsed) if not isinstance(parsed, Damaged) else parsed
        if isinstance(record, Damaged) or not isinstance(record.get("step"), int):
            return None
        return record

    def _is_committed(self, name: str, objects: dict[str, int]) -> bool:
        if manifest.MANIFEST_NAME not in objects:
            return False
        record = self._marker(name)
        if record is None:
            return False
        return all(objects.get(rel) == entry["size"] for rel, entry in record["files"].items())

    def committed(self) -> list[tuple[int, str]]:
        with mapped(f"cannot list {self.root_url}", self.root_url):
            listing = self._listing()
            found = []
            for name, objects in listing.items():
                step = self.names.parse(name)
                if step is not None and self._is_committed(name, objects):
                    found.append((step, name))
        return sorted(found)

    # -- the writer ----------------------------------------------------------------------------------

    def open_stage(self, step: int, final_name: str) -> str:
        url = self.url(final_name)
        with mapped(f"cannot open the stage of step {step} under {self.root_url}", url):
            objects = self._listing().get(final_name, {})
            if objects:
                if self._is_committed(final_name, objects):
                    raise TargetExistsError(f"step {step} is already committed at {url}", url)
                if IN_PROGRESS not in objects:
                    raise InvalidTargetError(
                        f"{url} holds objects and is not a committed checkpoint (safeio never deletes "
                        "what it did not write): move them away, or save another step",
                        url,
                    )
                # An interrupted save of this very step (this layer's in-progress object, no marker).
                logger.warning(
                    "%s: removing %d object(s) an interrupted save of step %d left under %s",
                    who(),
                    len(objects),
                    step,
                    url,
                )
                self.fs.rm(self._key(final_name), recursive=True)
            owner = {"host": os.uname().nodename, "pid": os.getpid(), "time": time.time()}
            self.fs.pipe_file(self._key(final_name, IN_PROGRESS), json.dumps(owner).encode())
        return final_name  # written in place: the step's own prefix is its stage

    def commit(self, stage_name: str, final_name: str, step: int, rank: int, replicated: str | None) -> None:
        url = self.url(final_name)
        with mapped(f"cannot commit step {step} at {url}", url):
            if replicated is not None:
                self._upload(replicated, final_name)
            objects = self._listing().get(final_name, {})
            objects.pop(IN_PROGRESS, None)
            if manifest.MANIFEST_NAME in objects:
                raise TargetExistsError(f"step {step} got a commit marker meanwhile at {url}", url)
            entries = {rel: {"size": size} for rel, size in sorted(objects.items())}
            record = manifest.build(entries, rank=rank, call=f"checkpoint/{step}")
            record["step"] = step
            self.fs.pipe_file(self._key(final_name, manifest.MANIFEST_NAME), manifest.dumps(record))
            self.fs.rm_file(self._key(final_name, IN_PROGRESS))
            committed = self.committed()
            newest = committed[-1] if committed else (step, final_name)
            # latest first, then retention: a crash in between leaves a pointer to a whole step.
            self.fs.pipe_file(self._key(LATEST), newest[1].encode())
            if self.megatron_tracker:
                self.fs.pipe_file(self._key(MEGATRON_TRACKER), str(newest[0]).encode())
            self._retain(committed)

    def _upload(self, local_dir: str, final_name: str) -> None:
        with held_directory(local_dir) as fd:  # this rank's own scratch on node-local disk
            files = manifest.describe_files(fd, hashes=False)
        for rel in files:
            self.fs.put_file(os.path.join(local_dir, *rel.split("/")), self._key(final_name, rel))

    def _retain(self, committed: list[tuple[int, str]]) -> None:
        for name in self.retired(committed):
            # The marker first: from then on the step is not a checkpoint, whatever is left of it.
            self.fs.rm_file(self._key(name, manifest.MANIFEST_NAME))
            self.fs.rm(self._key(name), recursive=True)

    def abandon(self, stage_name: str) -> None:
        # Without its marker it is never a checkpoint; if this fails, the next save of the step removes it.
        with contextlib.suppress(OSError, ValueError):
            self.fs.rm(self._key(stage_name), recursive=True)

    # -- every rank ----------------------------------------------------------------------------------

    def wait_stage(self, stage_name: str, deadline: float, rank: int, what: str) -> None:
        del stage_name, deadline, rank, what  # a prefix needs no directory to exist

    def wait_committed(self, name: str, deadline: float, rank: int, what: str) -> None:
        """Return once this rank reads the step's marker (object stores are consistent after a PUT; the
        check is what makes a stale client cache impossible to return through)."""
        key = self._key(name, manifest.MANIFEST_NAME)

        def visible() -> bool:
            self.fs.invalidate_cache(self._key(name))
            try:
                return bool(self.fs.exists(key))
            except (OSError, ValueError):
                return False

        poll_until(
            visible, deadline, f"rank {rank}: {what} at {self.url(name)} is still not visible here", key
        )
