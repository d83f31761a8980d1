"""Checkpoint steps on an object store (``s3://``, any fsspec URL): each step written in place, committed
by its marker, then ``latest``.

There is no rename on an object store, and no need for one: a PUT replaces an object whole and a
listing shows only whole objects. So every rank writes its part straight under the step's prefix
(``dcp.save`` to ``s3://bucket/run/step_5``); the writer's replicated files (tokenizer, trainer state)
are written to node-local scratch in the body and uploaded at the commit. The commit
(``ObjectPromotion.finish``, the promotion flow of any save on an object store, handed ``StepMarker`` as
its behaviour) lists the prefix, writes the manifest of every object last — the commit marker — and then
the ``latest`` pointer object. A step without its marker is never a
checkpoint: ``latest()`` ignores it.

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
from collections.abc import Iterable
from typing import Any

from safeio._boundary import mapped
from safeio._checkpoints.steps import (
    CommittedStep,
    ExistingDirectory,
    RootCommit,
    StepCommit,
    StepNames,
    StepStorage,
)
from safeio._errors import InvalidTargetError, TargetExistsError
from safeio._promotion.base import PhaseHook
from safeio._promotion.object_store import ObjectBehaviour, ObjectPromotion
from safeio._storage import manifest
from safeio._storage.dirfd import held_directory
from safeio._storage.fsops import discard_tree
from safeio._storage.location import Location
from safeio._storage.names import LATEST, MEGATRON_TRACKER, SEQUENCE
from safeio._storage.readers import POINTER_CAP, ObjectStoreReader
from safeio._who import who

logger = logging.getLogger("safeio")

IN_PROGRESS = ".safeio-in-progress"


class StepMarker(ObjectBehaviour):
    """One step's commit on an object store, the behaviour its ``ObjectPromotion`` is handed. Its
    ``stage`` is the writer's local scratch (replicated files, uploaded at the commit); every rank's
    sharded files are under the prefix already."""

    def __init__(self, root: ObjectRootCommit) -> None:
        self.root = root

    def open_stage(self, p: ObjectPromotion) -> str:
        p.stage_name = p.location.name  # written in place: the step's own prefix is its stage
        url = p.location.url()
        step = self.root.step
        with mapped(f"cannot open the stage of step {step} under {self.root.root_url}", url):
            objects = self.root.objects()
            if objects:
                if self.root.committed_in(objects):
                    # On POSIX the commit replaces it; here the new version would be written over the old
                    # one in place, which would be torn before the new marker commits anything.
                    raise TargetExistsError(
                        f"step {step} is already committed at {url}: on an object store a committed "
                        "step cannot be replaced whole (there is no rename); save another step, or remove "
                        "it first",
                        url,
                    )
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
                p.fs.rm(p.prefix, recursive=True)
            owner = {"host": os.uname().nodename, "pid": os.getpid(), "time": time.time()}
            p.fs.pipe_file(f"{p.prefix}/{IN_PROGRESS}", json.dumps(owner).encode())
        return url

    def describe(self, p: ObjectPromotion, stage: str) -> dict[str, dict[str, Any]]:
        if stage:  # the writer's replicated files, from its scratch
            with held_directory(stage) as fd:  # this rank's own scratch on node-local disk
                files = manifest.describe_files(fd, hashes=False)
            for rel in files:
                p.fs.put_file(os.path.join(stage, *rel.split("/")), f"{p.prefix}/{rel}")
        objects = self.root.objects()
        objects.pop(IN_PROGRESS, None)
        if manifest.MANIFEST_NAME in objects:
            url = p.location.url()
            raise TargetExistsError(f"step {self.root.step} got a commit marker meanwhile at {url}", url)
        return {rel: {"size": size} for rel, size in sorted(objects.items())}

    def commit(self, p: ObjectPromotion, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        root = self.root
        sequence = p.marker["sequence"] = root.next_sequence()
        record = p.manifest_record(entries, None)
        root.passing_commit_point()
        p.fs.pipe_file(f"{p.prefix}/{manifest.MANIFEST_NAME}", manifest.dumps(record))  # the commit
        root.warnings.extend(root.after_commit(sequence, p.phase))

    def discard(self, p: ObjectPromotion, stage: str) -> None:
        # Without its marker it is never a checkpoint; if this fails, the next save of the step removes it.
        with contextlib.suppress(OSError, ValueError):
            p.fs.rm(p.prefix, recursive=True)
        if stage:
            discard_tree(stage)


class ObjectSteps(StepStorage):
    """The steps of a checkpoint root on an object store."""

    in_place_replicated = False  # the writer's replicated files are uploaded at the commit

    def __init__(self, location: Location, names: StepNames, *args: Any, **kwargs: Any) -> None:
        super().__init__(names, *args, **kwargs)
        self.fs: Any = location.fs
        self.location = location
        self.prefix = location.path
        self.root_url = location.url()

    def url(self, name: str) -> str:
        return self.location.url(self._key(name))

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def _location(self, name: str) -> Location:
        return Location(self.url(name), self._key(name), self.fs)

    def reader(self, name: str, sizes: dict[str, int] | None = None) -> ObjectStoreReader:
        return ObjectStoreReader(self._location(name), sizes=sizes)

    def entry_names(self) -> list[str]:
        return list(self.listing())

    def read_pointer(self) -> str | None:
        return self._read_small(LATEST)

    def read_sequence(self) -> int | None:
        text = self._read_small(SEQUENCE)
        with contextlib.suppress(ValueError, TypeError):
            value = int(text or "", 10)
            if 0 <= value < 10**18:
                return value
        return None

    def _read_small(self, name: str) -> str | None:
        try:
            data = self.fs.cat_file(self._key(name), end=POINTER_CAP + 1)
        except (OSError, ValueError):
            return None
        return None if len(data) > POINTER_CAP else bytes(data).decode("utf-8", "replace").strip()

    def in_commit_order(self, *, check_files: bool = True) -> list[CommittedStep]:
        # One LIST gives every object's size: each step's marker is read, its files are not asked for.
        with mapped(f"cannot list {self.root_url}", self.root_url):
            found = [
                c
                for name, objects in self.listing().items()
                if (c := self.committed_step(name, self.reader(name, objects), check_files=check_files))
                is not None
            ]
        return sorted(found, key=lambda c: c.order)

    def listing(self) -> dict[str, dict[str, int]]:
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

    # -- the writer ----------------------------------------------------------------------------------

    def promotion(
        self,
        step: int,
        *,
        rank: int,
        protect: Iterable[str] = (),
        existing: ExistingDirectory | None = None,
        on_phase: PhaseHook | None = None,
    ) -> StepCommit:
        # ``existing`` is not used: objects written without safeio under the step's prefix are refused
        # (moving them aside on an object store is a copy and a delete of each, not one rename).
        del existing
        name = self.names.format(step)
        root = ObjectRootCommit(self, step, name, frozenset(protect))
        promotion = ObjectPromotion(
            self._location(name),
            self.options,
            rank=rank,
            call_id=f"checkpoint/{step}",
            behaviour=StepMarker(root),
            on_phase=on_phase,
            marker={"step": step},
        )
        return StepCommit(promotion, root)

    def _has(self, name: str) -> bool:
        try:
            return bool(self.fs.exists(self._key(name)))
        except (OSError, ValueError):
            return False

    # -- every rank ----------------------------------------------------------------------------------

    def is_stage_of(self, stage_name: str, step: int) -> bool:
        return stage_name == self.names.format(step)  # written in place: the step's own prefix

    def stage_visible(self, stage_name: str) -> bool:
        return True  # a prefix needs no directory to exist

    def step_visible(self, name: str) -> bool:
        """Whether this rank reads the step's marker (object stores are consistent after a PUT; the
        check is what makes a stale client cache impossible to return through)."""
        self.fs.invalidate_cache(self._key(name))
        return super().step_visible(name)


class ObjectRootCommit(RootCommit):
    """What the commit of one step on an object store needs from its root (see ``RootCommit``): the
    objects under the step's prefix, whether they are committed already, the next sequence number, and
    the pointer objects and retention after the marker."""

    def __init__(self, steps: ObjectSteps, step: int, name: str, protect: frozenset[str]) -> None:
        super().__init__(step, name, protect)
        self._steps = steps
        self.root_url = steps.root_url

    def objects(self) -> dict[str, int]:
        """The objects under the step's prefix (relative name -> size), listed now."""
        return self._steps.listing().get(self.name, {})

    def committed_in(self, objects: dict[str, int]) -> bool:
        """Whether ``objects`` (the step's, as listed) hold its commit marker."""
        return self._steps.reader(self.name, objects).committed_step() is not None

    def next_sequence(self) -> int:
        """The next number in commit order, recorded before the marker (see ``StepStorage``). No lock:
        two jobs committing into one root at once are not excluded on an object store."""
        steps = self._steps
        recorded = steps.read_sequence()
        number = steps.next_number(recorded)
        if steps.pointer or recorded is not None or steps._has(SEQUENCE):
            steps.fs.pipe_file(steps._key(SEQUENCE), str(number).encode())
        return number

    def after_commit(
        self, sequence: int, phase: PhaseHook, replaced: Iterable[str] = (), root_fd: int | None = None
    ) -> list[str]:
        """After the marker, best effort (see ``RootCommit.after_commit``); nothing is ever replaced."""
        del replaced, root_fd
        steps, committed = self._steps, self.committed(sequence)
        fs, key = steps.fs, steps._key
        warnings = []
        phase("pointer")
        try:
            fs.rm_file(f"{key(committed.name)}/{IN_PROGRESS}")
            if steps.pointer or steps._has(LATEST):
                fs.pipe_file(key(LATEST), committed.name.encode())
            if steps.megatron_tracker:
                fs.pipe_file(key(MEGATRON_TRACKER), str(committed.step).encode())
        except (OSError, ValueError) as exc:
            warnings.append(
                f"step {committed.step} is committed, but the pointer under {steps.root_url} was not updated "
                f"({exc}); latest() still finds the step, and the next save writes the pointer"
            )
        phase("retention")
        try:
            retired = steps.retired(committed, self.protect, self.retire_also)
            for step in retired:
                # The marker first: from then on the step is not a checkpoint, whatever is left of it.
                fs.rm_file(f"{key(step.name)}/{manifest.MANIFEST_NAME}")
        except (OSError, ValueError) as exc:
            warnings.append(
                f"step {committed.step} is committed, but retention under {steps.root_url} failed ({exc}); "
                "the next save retries it"
            )
            return warnings
        if retired:
            keys = [key(step.name) for step in retired]
            steps.delete_later(lambda: fs.rm(keys, recursive=True), f"{len(keys)} retired step(s)")
        return warnings
