"""The commit of one checkpoint step, as the checkpoint layer drives it (``CheckpointSave``): the promotion
of its storage (``LocalPromotion``, ``ObjectPromotion``), handed the step's behaviour, and the step's
``RootCommit``, which the layer tells what it decides at the commit (the commit-point check, the ranks'
shares of the fsyncs) and reads the warnings from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from safeio._checkpoints.steps import RootCommit, SharedFsyncs
from safeio._promotion.base import Promoted, Promotion


class StepPromotion:
    """The commit of one step, as the checkpoint layer drives it: ``open_stage`` on the writer before the
    body, ``finish_step`` once every rank reported, ``discard`` when one failed. ``promotion`` is its
    storage's promotion, handed the step's behaviour (``LocalPromotion`` with ``StepRename``,
    ``ObjectPromotion`` with ``StepMarker``); ``root`` is what the commit needs from its root
    (``RootCommit``). The commit point is the step appearing under its name (a rename; an object store's
    marker): a failure before it commits nothing; after it (the ``latest`` pointer, retention) is a
    warning in ``Promoted.warnings``."""

    def __init__(
        self,
        promotion: Promotion,
        root: RootCommit,
        *,
        shares_fsyncs: bool = False,
        before_finish: Callable[[], None] | None = None,
    ) -> None:
        self.promotion = promotion
        self.root = root
        # Whether the commit syncs the stage's files (a durable commit on a POSIX filesystem), so that the
        # ranks can share the work out (``finish_step``'s ``fsyncs``).
        self.shares_fsyncs = shares_fsyncs
        self._before_finish = before_finish  # a directory the script saves into, adopted (POSIX)

    @property
    def stage_name(self) -> str:
        """What every rank writes under (set by ``open_stage``)."""
        return self.promotion.stage_name

    def open_stage(self) -> str:
        return self.promotion.open_stage()

    def discard(self, stage: str) -> None:
        self.promotion.discard(stage)

    def finish_step(
        self,
        stage: str,
        fsyncs: SharedFsyncs | None = None,
        *,
        commit_point: Callable[[], None] | None = None,
    ) -> Promoted:
        """Commit ``stage``; where the commit syncs files, ``fsyncs`` shares them out among the ranks;
        ``commit_point()`` is called right before the commit point and may raise to commit nothing."""
        self.root.commit_point, self.root.fsyncs = commit_point, fsyncs
        if self._before_finish is not None:
            self._before_finish()
        promoted = self.promotion.finish(stage)
        return dataclasses.replace(promoted, warnings=tuple(self.root.warnings))
