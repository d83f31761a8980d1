"""The writer's side of one save: the flow every storage behaviour shares.

``Promotion`` owns the order of the steps and the phases peers see (like filelock's ``BaseFileLock``
owning ``acquire``); each behaviour fills in four hooks for its storage:

    open_stage()                       check the target, create the private stage
    finish(stage, result=...):
      phase "manifest"  _prepare          permissions, what goes in the manifest, the files checked;
                                          phase "fsync" where it makes the stage durable
      phase "promote"   _promote_unlocked a promotion that needs no lock (a fresh target), if it can
      phase "lock"      _locked           the promotion lock (none on object stores)
      phase "promote"   _promote          the behaviour itself (rename, exchange, merge, link swap,
                                          upload, a step's commit), and making it durable
    discard(stage)                     after a failure: the target is untouched

``finish`` returns what peers need to recognise the promoted version (``Promoted``). On POSIX one
class, ``LocalPromotion``, fills them in, and the storage behaviour (exchange, rename aside, merge,
versioned) is an object it is handed (``local.Behaviour``: ``commit`` and ``recover``); on object stores
``CommitMarker``. Both are picked by the target's back end (``safeio._promotion.backends``), never by an
``if`` in this flow.
"""

from __future__ import annotations

import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from safeio._boundary import mapped
from safeio._options import SaveOptions
from safeio._storage import manifest
from safeio._storage.location import Location
from safeio._who import who

logger = logging.getLogger("safeio")

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
        self._started = time.monotonic()  # peers' waits began about now (see lock_timeout)
        self._result: Any = None  # the body's result (JSON form), recorded in the manifest
        self.version: list[int] | None = None  # the promoted manifest's ``manifest.version_of``, if local
        self.replaced: list[int] | None = None  # the same of the version it replaced (None: none)

    # -- the flow ----------------------------------------------------------------------------------

    @abstractmethod
    def open_stage(self) -> str:
        """Check the target and create the writer's private stage; return its local path."""

    def finish(self, stage: str, *, result: Any = None) -> Promoted:
        """Describe, sync, lock and promote ``stage``; on return the target is the new version.
        ``result`` (the body's, JSON form) is recorded in the manifest for peers without a store."""
        self._result = result
        target = self.location.url()
        with mapped(f"could not promote {target}", target):
            self.phase("manifest")  # describing the stage reads (and, if durable, hashes) every file
            entries = self._prepare(stage)
            if not self._promote_unlocked(stage, entries):
                self.phase("lock")
                with self._locked():
                    self.phase("promote")
                    self._promote(stage, entries)
        logger.debug("%s: promoted %s (mode %s)", who(self.rank), target, self.options.mode)
        return Promoted(self.version, self.replaced)

    @abstractmethod
    def discard(self, stage: str) -> None:
        """Remove ``stage`` after a failure (the target is untouched)."""

    # -- hooks -------------------------------------------------------------------------------------

    @abstractmethod
    def _prepare(self, stage: str) -> dict[str, dict[str, Any]]:
        """Check the stage, make it durable where asked, and return the manifest entries of its files
        (none when the manifest is off)."""

    def _promote_unlocked(self, stage: str, entries: dict[str, dict[str, Any]]) -> bool:
        """Promote without the lock where that is safe (True), else leave it to the locked way (False)."""
        return False

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the promotion lock for the block (none by default)."""
        yield

    @abstractmethod
    def _promote(self, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        """Make ``stage`` the target (under the lock, where there is one), durably when asked."""

    # -- shared by behaviours ----------------------------------------------------------------------

    def check_staged(self, names: Iterable[str]) -> None:
        """Hand the stage's files to ``check_files`` (behaviours call it from ``_prepare``)."""
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
