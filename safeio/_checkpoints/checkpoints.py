"""``safeio.Checkpoints``: whole checkpoints under one root, saved, found and retired collectively.

``save(step)`` is ``CheckpointSave`` (``save``: the writer's side and the flow; ``peer``: every other
rank's); ``latest()``, ``at()`` and ``steps()`` are resolved by the writer and heard by every rank
(``agreement``). Where the steps live is the root's step storage, chosen for its back end (``storage``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from safeio._checkpoints.agreement import Agreement
from safeio._checkpoints.pending import PendingCommit
from safeio._checkpoints.save import CheckpointSave, CheckpointStage
from safeio._checkpoints.steps import ExistingDirectory, StepNames, check_step
from safeio._checkpoints.storage import steps_for
from safeio._coordination.group import Group, resolve_group
from safeio._errors import InvalidOptionError, InvalidTargetError, InvalidTypeError
from safeio._options import LockSetting, SaveOptions, flag
from safeio._promotion.backends import backend_for
from safeio._storage.names import LATEST, MEGATRON_TRACKER
from safeio._who import who

__all__ = ["DEFAULT_KEEP", "LATEST", "MEGATRON_TRACKER", "Checkpoint", "CheckpointStage", "Checkpoints"]

logger = logging.getLogger("safeio")


class _DefaultKeep(int):
    """``keep``'s default, 3, told apart from a caller's own ``keep=3`` by identity: an adapter of a
    framework with retention of its own (accelerate's ``total_limit``) applies the framework's when the
    user did not choose, instead of retiring the script's checkpoints at 3 without a word."""


DEFAULT_KEEP: int = _DefaultKeep(3)


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: its step and the directory (or object-store prefix) to load it from.
    ``committed`` is False only for one written without safeio that ``latest(unmarked=...)`` chose."""

    step: int
    path: str
    committed: bool = True


class Checkpoints:
    """Whole checkpoints under ``root``: ``save(step)``, ``latest()`` and ``steps()`` are collective
    (every rank of ``group`` calls them, in the same order).

    ``keep``: how many of the most recent commits retention keeps (default 3; None: all).
    ``keep_given`` says whether it was passed: the accelerate adapter applies the script's own
    ``total_limit`` to a ``Checkpoints`` given none. ``timeout`` bounds every wait; ``warn_after``
    (default ``SAFEIO_WARN_AFTER``, else 60 s) is when a rank stuck in one phase of a call logs a
    WARNING with its stack, and every rank waiting for it one naming it and its phase, repeated with
    backoff (see docs/no-silent-hangs.md).

    ``pointer=False`` (a framework's own directory, whose listing its users and tests read: the
    integrations pass it) creates no file in the root besides the steps: neither the ``latest`` pointer
    nor ``.checkpoints.safeio.sequence`` (commit order is then read from the steps' markers); where the
    root has them already, they are kept current."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep: int | None = DEFAULT_KEEP,
        name: str = "step_{step}",
        group: Any = None,
        timeout: float | None = None,
        durable: bool = True,
        lock: LockSetting = "auto",
        megatron_tracker: bool = False,
        warn_after: float | None = None,
        pointer: bool = True,
    ) -> None:
        backend = backend_for(root)
        _check_keep(keep, root)
        for option, value in (("megatron_tracker", megatron_tracker), ("pointer", pointer)):
            flag(value, option, backend.url())
        names = StepNames(name, backend.url())
        self.options = SaveOptions.of(timeout=timeout, durable=durable, lock=lock, warn_after=warn_after)
        self._steps = steps_for(
            backend, names, self.options, keep=keep, megatron_tracker=megatron_tracker, pointer=pointer
        )
        self.root = self._steps.root_url
        self.keep_given = keep is not DEFAULT_KEEP  # see DEFAULT_KEEP
        self.names = names
        self._group_arg = group
        self._pending: PendingCommit | None = None
        self._agreement = Agreement(self._steps, names, self.options, self.group)

    @property
    def keep(self) -> int | None:
        """How many of the most recent commits retention keeps (None: all). Setting it applies to the
        commits that follow."""
        return self._steps.keep

    @keep.setter
    def keep(self, keep: int | None) -> None:
        _check_keep(keep, self.root)
        self._steps.keep = keep

    def group(self) -> Group:
        return resolve_group(self._group_arg)

    def save(
        self,
        step: int,
        *,
        protect: Iterable[str] = (),
        unmarked: Callable[[str], bool] | None = None,
        placeholder: Callable[[str], bool] | None = None,
        adopt: bool = False,
    ) -> CheckpointSave:
        """``with ckpts.save(step) as ckpt`` on every rank. Retention after this commit never removes a
        checkpoint named in ``protect`` (directory names or paths: e.g. a Trainer's best model).

        A step this user committed already (a rollback, a re-run into the same root) is committed anew:
        on POSIX the new version replaces the old one at the commit (exchanged, or renamed aside where
        the filesystem refuses exchange), which stays whole until then; the new one is the latest. On an
        object store there is no rename to replace a step whole: ``TargetExistsError``, before the body.

        A directory of this user's without any safeio marker at the step's name is the framework's or
        the script's (see ``ExistingDirectory``): ``unmarked`` — the framework's judgement
        ``latest(unmarked=...)`` takes — moves it aside, kept, with a WARNING naming both paths:
        ``incomplete-<name>.<UTC time>`` (a killed save of the step from before safeio) or, complete,
        ``previous-<name>.<UTC time>``; ``placeholder(path)`` true: the framework made it to mark this
        save in progress and the commit replaces it; ``adopt``: the script saves into a directory of its
        own, whose files are kept in the committed step under what the save wrote. Anything else —
        without those, another user's, one with another step's marker — raises ``InvalidTargetError``
        naming it (safeio never deletes what it did not write). Object stores always refuse."""
        protected = [os.path.basename(os.fspath(p).rstrip("/")) for p in protect]
        adopt = flag(adopt, "adopt", self.root)
        existing = ExistingDirectory(unmarked=unmarked, placeholder=placeholder, adopt=adopt)
        return CheckpointSave(self, check_step(step, self.root), protected, existing)

    def wait(self) -> None:
        """Wait for the commit of an async save (``ckpt.commit_after``); raise if it failed. Every rank
        calls it before the job ends (``save``, ``latest()`` and ``steps()`` call it first)."""
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                pending.wait()
        finally:
            self._steps.join_deletions()  # retired steps' deletion, started after the last commit

    def _commit_later(self, pending: PendingCommit) -> None:
        """An async save's commit now runs on its own thread; the next collective call waits for it."""
        self._pending = pending

    # -- finding checkpoints -------------------------------------------------------------------------

    def committed(self) -> list[tuple[int, str]]:
        """(step, name) of every committed checkpoint, as this process sees the root (ascending). Not
        collective: each process reads the root itself."""
        return self._steps.committed()

    def path_of(self, name: str) -> str:
        """Where the step directory ``name`` is (a path, or a URL on object stores)."""
        if not isinstance(name, str):
            raise InvalidTypeError(
                f"{self.root}: name must be a str, got {type(name).__name__} {name!r}", self.root
            )
        return self._steps.url(name)

    def latest(self, *, unmarked: Callable[[str], bool] | None = None) -> Checkpoint | None:
        """The most recent commit (not the highest step number: after a rollback to step 10 and a save of
        15, it is 15), the same on every rank, visible from each when it returns; None when there is
        none. Only steps this user committed count.

        ``unmarked``: step directories written without safeio (no marker: a framework's own, from before
        safeio) are not ignored. ``unmarked(path)`` says whether one is complete by the framework's own
        marker; the complete one with the highest step wins when that step is above the latest commit's
        (a commit wins at an equal or higher step), returned with ``committed=False`` and a WARNING;
        each incomplete one above the answer is skipped with a WARNING naming it (logged by the rank
        that resolves, the writer)."""
        self.wait()

        def here() -> list[tuple[int, str]]:
            found = self._steps.latest()
            return [(found.step, found.name)] if found is not None else []

        committed = self._agreement.agree("latest()", here)
        newest = Checkpoint(committed[0][0], self._steps.url(committed[0][1])) if committed else None
        if unmarked is None:
            return newest
        above = newest.step if newest is not None else -1
        plain = self._agreement.agree(
            "latest() of unmarked steps",
            lambda: self._newest_unmarked(above, unmarked),
            visible=lambda name: self._steps.reader(name).exists(),
        )
        return Checkpoint(plain[0][0], self._steps.url(plain[0][1]), committed=False) if plain else newest

    def _newest_unmarked(self, above: int, complete: Callable[[str], bool]) -> list[tuple[int, str]]:
        for step, name in reversed(self._steps.unmarked()):
            if step <= above:
                break
            path = self._steps.url(name)
            if complete(path):
                logger.warning(
                    "%s: resuming from %s, which safeio did not commit (written without safeio; complete by "
                    "its framework's own marker)",
                    who(self.group().rank),
                    path,
                )
                return [(step, name)]
            logger.warning(
                "%s: skipping %s: written without safeio and incomplete by its framework's own marker; a "
                "save of step %d given the same judgement (save(unmarked=...), as the Trainer's is) moves it "
                "aside and keeps it; any other save of that step fails until it is moved away (safeio never "
                "deletes what it did not write)",
                who(self.group().rank),
                path,
                step,
            )
        return []

    def at(self, step: int, *, unmarked: Callable[[str], bool] | None = None) -> Checkpoint:
        """Committed step ``step``, to resume from on purpose (a rollback), agreed by every rank like
        ``latest()``; ``InvalidTargetError`` naming the committed steps when it is not one. Saving after
        it makes the new step the latest.

        ``unmarked``: a step directory of this user's written without safeio (no marker) is not refused
        when the framework's own judgement ``unmarked(path)`` says it is complete: returned with
        ``committed=False``, with a WARNING (logged by the writer, which judges it for every rank)."""
        self.wait()
        check_step(step, self.root)
        name = self.names.format(step)

        def not_committed() -> InvalidTargetError:
            steps = ", ".join(str(s) for s, _ in self._steps.committed()) or "none"
            written = " nor a complete one written without safeio" if unmarked is not None else ""
            return InvalidTargetError(
                f"step {step} is not a committed checkpoint under {self.root}{written} (committed steps: "
                f"{steps})",
                self._steps.url(name),
            )

        def here() -> list[tuple[int, str]]:
            if self._steps.committed_step(name) is not None:
                return [(step, name)]
            if unmarked is None:
                raise not_committed()
            return []

        if self._agreement.agree(f"at({step})", here):
            return Checkpoint(step, self._steps.url(name))
        assert unmarked is not None

        def judged_here() -> list[tuple[int, str]]:
            path = self._steps.url(name)
            if not (self._steps.unmarked_step(name) and unmarked(path)):
                raise not_committed()
            logger.warning(
                "%s: loading %s, which safeio did not commit (written without safeio; complete by its "
                "framework's own judgement)",
                who(self.group().rank),
                path,
            )
            return [(step, name)]

        self._agreement.agree(
            f"at({step}) of an unmarked step", judged_here, visible=lambda n: self._steps.reader(n).exists()
        )
        return Checkpoint(step, self._steps.url(name), committed=False)

    def steps(self) -> list[int]:
        """Every committed step of this user, by number (ascending), the same on every rank. The order of
        commits is ``latest()``'s business: after a rollback the newest commit need not be the last."""
        self.wait()
        return [step for step, _ in self._agreement.agree("steps()", self.committed)]


def _check_keep(keep: object, root: str | os.PathLike[str]) -> None:
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise InvalidOptionError(
            f"keep must be a number of checkpoints >= 1 or None, got {keep!r} (Checkpoints of {root})", root
        )
