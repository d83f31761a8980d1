"""A storage behaviour on POSIX: how a settled, described stage replaces a target that exists, and how a
crash in the middle of it is put right.

``LocalPromotion`` (``local``) is one class for every POSIX directory save: stage, settle and describe,
lock, then a rename when the target is missing, else the behaviour's ``commit``, then sync. The
behaviour is an object the back end picks (``ExchangeRename``, ``RenameAside``, ``Merge``,
``Versioned``; a checkpoint step's ``StepReplace``) and hands in: it never subclasses the flow. Its
``recover`` (a static method) is what ``safeio._promotion.leftovers`` calls for what it left.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from safeio._promotion.local import LocalPromotion


class Behaviour(ABC):
    """How a POSIX stage replaces the target (``commit``) and what recovery does with what a writer killed
    in it left (``recover``, a static method the leftovers' judge calls). Chosen by the back end
    (``safeio._promotion.backends``); ``LocalPromotion`` calls it under the lock, once the stage is settled
    and described, and syncs after it."""

    # A target that does not exist yet becomes the stage by one rename (every behaviour but Versioned).
    renames_fresh_target: ClassVar[bool] = True
    # Behaviours that remove the old version refuse a target holding the process's own ground.
    guards_own_ground: ClassVar[bool] = False

    @abstractmethod
    def commit(self, p: LocalPromotion, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        """Promote the stage of ``p`` over a target that exists (a directory safeio may replace); one
        that does not ``renames_fresh_target`` is called for a missing target too."""

    def keeps_failed_stage(self, p: LocalPromotion, stage: str) -> bool:
        """After a failure: whether the stage must stay for recovery to finish (a merge part-way)."""
        del p, stage
        return False
