"""The directory save on an object store (any fsspec filesystem that is not local): one flow, one
function, the shape of the POSIX one (``local``).

There is no rename to lean on, but there is no ``O_TRUNC`` either: a PUT replaces an object whole, so a
set of objects is committed by a marker written last. ``ObjectPromotion.finish`` describes what is to be
committed, then (no lock: object stores have none, and concurrent writer *jobs* on one prefix are not
excluded) hands it to the behaviour's ``commit``. The behaviour is an object the back end picks and
hands in: ``CommitMarker`` (``commit_marker``) for a directory save, the checkpoint layer's
``StepMarker`` for a step.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

from safeio._boundary import mapped
from safeio._options import SaveOptions
from safeio._promotion.base import FilesCheck, PhaseHook, Promoted, Promotion
from safeio._storage import manifest
from safeio._storage.location import Location
from safeio._who import who

logger = logging.getLogger("safeio")


class ObjectBehaviour(ABC):
    """How a save is staged, described and committed on an object store; ``ObjectPromotion`` calls it."""

    @abstractmethod
    def open_stage(self, p: ObjectPromotion) -> str:
        """Check the target and make the writer's stage; return its path."""

    @abstractmethod
    def describe(self, p: ObjectPromotion, stage: str) -> dict[str, dict[str, Any]]:
        """The manifest entries of what the commit makes the target's."""

    @abstractmethod
    def commit(self, p: ObjectPromotion, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        """Make ``entries`` the target: the commit marker is written last."""

    @abstractmethod
    def discard(self, p: ObjectPromotion, stage: str) -> None:
        """Remove ``stage`` (and what it left under the target) after a failure."""


class ObjectPromotion(Promotion):
    """One writer-side save of ``location`` on an object store, committed by ``behaviour``."""

    def __init__(
        self,
        location: Location,
        options: SaveOptions,
        *,
        rank: int,
        call_id: str,
        behaviour: ObjectBehaviour,
        on_phase: PhaseHook | None = None,
        check_files: FilesCheck | None = None,
        marker: dict[str, Any] | None = None,
    ) -> None:
        self.location, self.options = location, options
        self.rank, self.call_id = rank, call_id
        self.behaviour = behaviour
        self._on_phase = on_phase
        self.marker = dict(marker or {})
        self.stage_name = ""
        self._check_files = check_files
        self._result: Any = None  # the body's result (JSON form), recorded in the manifest

    def manifest_record(
        self, entries: dict[str, dict[str, Any]], previous: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The manifest of this save; with ``previous`` (merge) the other objects' entries are kept."""
        return manifest.build(
            entries,
            rank=self.rank,
            call=self.call_id,
            previous=previous,
            result=self._result,
            marker=self.marker,
        )

    @property
    def fs(self) -> Any:
        return self.location.fs

    @property
    def prefix(self) -> str:
        return self.location.path

    def phase(self, name: str) -> None:
        if self._on_phase is not None:
            self._on_phase(name)

    def open_stage(self) -> str:
        return self.behaviour.open_stage(self)

    def finish(self, stage: str, *, result: Any = None) -> Promoted:
        """Describe ``stage``, then commit it under its marker; on return the target is the new version.
        ``result`` (the body's, JSON form) is recorded in the manifest for peers without a store."""
        self._result = result
        target = self.location.url()
        with mapped(f"could not promote {target}", target):
            self.phase("manifest")
            entries = self.behaviour.describe(self, stage)
            if self._check_files is not None:
                self._check_files(list(entries))
            self.phase("lock")  # none on object stores; the phase is the one peers hear on POSIX too
            self.phase("promote")
            self.behaviour.commit(self, stage, entries)
        logger.debug("%s: promoted %s (mode %s)", who(self.rank), target, self.options.mode)
        return Promoted()  # no version a peer could stat: it reads the marker

    def discard(self, stage: str) -> None:
        self.behaviour.discard(self, stage)
