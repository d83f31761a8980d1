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
the checkpoint layer's steps), never by an ``if`` in the flow. This module is the interface they
share.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from safeio._options import SaveOptions
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


class Promotion(ABC):
    """One writer-side save of ``location`` with ``options``, as its callers use it. Each flow
    (``LocalPromotion``, ``ObjectPromotion``) sets these in its own constructor and has its own methods:
    no code of this module runs on a save's path."""

    location: Location
    options: SaveOptions
    # What the writer's ranks write under (the stage directory beside the target, set by ``open_stage``;
    # an object store's step prefix).
    stage_name: str
    # Fields recorded in the manifest besides the files (a checkpoint's step, and its place in commit
    # order once given under the root's lock): data, which the flow only writes.
    marker: dict[str, Any]

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

    @abstractmethod
    def phase(self, name: str) -> None:
        """Tell the caller's hook (peers, the watchdog) each phase of the commit: "manifest", "fsync",
        "lock", "promote", "cleanup"; a checkpoint's "pointer", "retention". Each flow's own method, so
        that a phase reaches peers without passing through this module."""
