"""The writer's side of one save, as its callers see it: ``open_stage``, ``finish``, ``discard``.

    open_stage()                  check the target, create the private stage
    finish(stage, result=...)     describe, sync, lock and promote the stage (phases "manifest",
                                  "fsync", "lock", "promote", "cleanup" as peers see them)
    discard(stage)                after a failure: the target is untouched

Each kind of place has one promotion, whose ``finish`` is one function reading top to bottom, and is
handed the storage behaviour as an object: on POSIX ``LocalPromotion`` (``local``) with a
``Behaviour`` (``behaviour``: exchange, rename aside, merge, versioned, a checkpoint step's rename); on
object stores ``ObjectPromotion`` (``object_store``) with an ``ObjectBehaviour`` (a commit marker, a
checkpoint step's marker). Both are picked by the target's back end (``safeio._promotion.backends``, or
the checkpoint layer's steps), never by an ``if`` in the flow. This module holds what both share.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from safeio._options import SaveOptions
from safeio._storage import manifest
from safeio._storage.location import Location

PhaseHook = Callable[[str], None]
# Called with the stage's files (relative names) before anything is promoted: the replicated layer
# refuses sharded state there (see safeio._saves.replicated).
FilesCheck = Callable[[list[str]], None]


@dataclass(frozen=True)
class Promoted:
    """What a finished promotion tells peers: the promoted manifest's ``manifest.version_of`` and the
    same of the version it replaced (None: none, or not known where the target lives), so that a peer
    confirms it sees that version with one stat, and tells a rival's later version from a stale view."""

    version: list[int] | None = None
    replaced: list[int] | None = None
    # What failed after the commit point without undoing it (a checkpoint's pointer, its retention): the
    # target is promoted; these say what to repair.
    warnings: tuple[str, ...] = ()


class Promotion(ABC):
    """One writer-side save of ``location`` with ``options``."""

    def __init__(
        self,
        location: Location,
        options: SaveOptions,
        *,
        rank: int,
        call_id: str,
        on_phase: PhaseHook | None = None,
        check_files: FilesCheck | None = None,
        marker: dict[str, Any] | None = None,
    ) -> None:
        self.location = location
        self.options = options
        self.rank = rank
        self.call_id = call_id
        # Fields the caller records in the manifest besides the files (a checkpoint's step, and its
        # place in commit order once given under the root's lock): data, which this flow only writes.
        self.marker: dict[str, Any] = dict(marker or {})
        self._on_phase = on_phase
        self._check_files = check_files
        # What the writer's ranks write under (the step's own prefix on an object store; set by
        # ``open_stage`` where the stage is a directory beside the target).
        self.stage_name = ""
        self._started = time.monotonic()  # peers' waits began about now (see lock_timeout)
        self._result: Any = None  # the body's result (JSON form), recorded in the manifest
        self.version: list[int] | None = None  # the promoted manifest's ``manifest.version_of``, if local
        self.replaced: list[int] | None = None  # the same of the version it replaced (None: none)

    @abstractmethod
    def open_stage(self) -> str:
        """Check the target and create the writer's private stage; return its local path."""

    @abstractmethod
    def finish(self, stage: str, *, result: Any = None) -> Promoted:
        """Describe, sync, lock and promote ``stage``; on return the target is the new version.
        ``result`` (the body's, JSON form) is recorded in the manifest for peers without a store."""

    @abstractmethod
    def discard(self, stage: str) -> None:
        """Remove ``stage`` after a failure (the target is untouched)."""

    # -- shared by behaviours ----------------------------------------------------------------------

    def check_staged(self, names: Iterable[str]) -> None:
        """Hand the stage's files to ``check_files`` once they are described."""
        if self._check_files is not None:
            self._check_files(list(names))

    def phase(self, name: str) -> None:
        if self._on_phase is not None:
            self._on_phase(name)

    def lock_timeout(self) -> float:
        """What is left of ``timeout`` for the lock, minus a margin to publish the outcome.

        Peers wait ``timeout`` from about when this save began; a writer that waited the full
        ``timeout`` for a rival's lock after its body would report LockTimeout after every peer had
        given up with a PeerTimeout that hides why (seen with 8 ranks and a rival holding the lock).
        """
        timeout = self.options.timeout
        margin = min(1.0, 0.05 * timeout)
        return max(0.01, timeout - (time.monotonic() - self._started) - margin)

    def manifest_record(
        self, entries: dict[str, dict[str, Any]], previous: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The manifest of this save; with ``previous`` (merge) the other objects' entries are kept; the
        ``marker`` fields (a checkpoint's step and sequence) are recorded in it."""
        record = manifest.build(
            entries, rank=self.rank, call=self.call_id, previous=previous, result=self._result
        )
        record.update(self.marker)
        return record
