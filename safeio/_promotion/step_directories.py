"""Checkpoint steps on a POSIX filesystem (local disk, NFS): a stage directory beside the step, one rename.

The writer makes ``.step_N.safeio-stage-<owner>`` beside the step's final name (``StepRename.open_stage``,
the same stage any directory save makes); every rank writes its part there. The commit is that
promotion's ``finish``: the stage is checked to be the directory the writer made, its modes settled, the
manifest of every file written last with the step in it (the marker), fsynced as configured, and under
the root's lock (``.checkpoints.safeio.lock``, the ``lock`` option) renamed to ``step_N``; then
``latest`` is pointed at the newest committed step and retention applied, still under the lock. Stages
of crashed saves are removed by the next save (or ``safeio gc``), never one whose owner may be alive.
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Callable, Iterable
from typing import Any

from safeio._boundary import os_failure
from safeio._errors import InvalidTargetError, TargetExistsError
from safeio._promotion.atomic_file import AtomicFile
from safeio._promotion.leftovers import recover_directory, recover_target
from safeio._promotion.local import LocalPromotion
from safeio._promotion.steps import LATEST, MEGATRON_TRACKER, StepNames, StepPromotion, StepStorage
from safeio._storage.claims import claimed
from safeio._storage.dirfd import held_directory, lstat_at
from safeio._storage.fsops import remove_at
from safeio._storage.location import Location
from safeio._storage.names import sibling_name
from safeio._storage.readers import LocalReader

ROOT_LOCK = "checkpoints"  # one promotion lock per root: ``.checkpoints.safeio.lock``


class StepRename(LocalPromotion, StepPromotion):
    """One step's commit: the stage renamed to the step's name, which must not exist."""

    hashes_when_durable = False

    def __init__(
        self, location: Location, *, after_commit: Callable[[int, tuple[int, str]], None], **save: Any
    ) -> None:
        super().__init__(location, recover=recover_target, **save)
        self._after_commit = after_commit  # latest and retention, under the root's lock

    def check_target(self) -> None:
        if self._target_stat() is not None:
            raise TargetExistsError(f"step {self.step} appeared at {self.target} meanwhile", self.target)

    def lock_name(self) -> str:
        return ROOT_LOCK  # the root's entries (latest, retention) change with every commit

    def _promote_unlocked(self, stage: str, entries: dict[str, dict[str, Any]]) -> bool:
        return False  # latest and retention need the root's lock even for a new step

    def _promote(self, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        super()._promote(stage, entries)
        self._after_commit(self.parent_fd, (int(self.step or 0), self.name))

    def _replace_existing(self, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        raise TargetExistsError(f"step {self.step} appeared at {self.target} meanwhile", self.target)


class LocalSteps(StepStorage):
    """The steps of a checkpoint root on a POSIX filesystem."""

    in_place_replicated = True  # the writer's replicated files go straight into the shared stage

    def __init__(self, location: Location, names: StepNames, *args: Any, **kwargs: Any) -> None:
        super().__init__(names, *args, **kwargs)
        self.location = location
        self.root = location.path
        self.root_url = location.path

    def url(self, name: str) -> str:
        return os.path.join(self.root, name)

    def reader(self, name: str) -> LocalReader:
        return LocalReader(Location(self.url(name), self.url(name)))

    def committed(self) -> list[tuple[int, str]]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        found = []
        for entry in names:
            step = self.names.parse(entry)
            if step is not None and self.reader(entry).committed_step() is not None:
                found.append((step, entry))
        return sorted(found)

    # -- the writer ----------------------------------------------------------------------------------

    def promotion(self, step: int, *, rank: int, protect: Iterable[str] = ()) -> StepPromotion:
        final_name = self.names.format(step)
        final = self.url(final_name)
        try:
            os.makedirs(self.root, exist_ok=True)
            with held_directory(self.root, follow=True) as root_fd:
                # What crashed saves left (stages of dead owners, never a live one) goes first.
                recover_directory(self.root, parent_fd=root_fd, keep_going=True, durable=self.options.durable)
                if lstat_at(root_fd, final_name) is not None:
                    if self.reader(final_name).committed_step() is not None:
                        raise TargetExistsError(f"step {step} is already committed at {final}", final)
                    raise InvalidTargetError(
                        f"{final} exists and is not a committed checkpoint (safeio never deletes "
                        "what it did not write): move it away, or save another step",
                        final,
                    )
        except OSError as exc:
            raise os_failure(
                f"cannot open the stage of step {step} under {self.root}", self.root, exc
            ) from exc
        return StepRename(
            Location(final, final),
            options=self.options,
            rank=rank,
            call_id=f"checkpoint/{step}",
            step=step,
            after_commit=functools.partial(self._point_and_retain, protect=frozenset(protect)),
        )

    def _point_and_retain(
        self, root_fd: int, just_committed: tuple[int, str], *, protect: frozenset[str]
    ) -> None:
        committed = self.committed()
        # latest first, then retention: a crash in between leaves a pointer to a whole step.
        self._point_latest(committed[-1] if committed else just_committed)
        self._retain(root_fd, self.retired(committed, protect))

    def _point_latest(self, newest: tuple[int, str]) -> None:
        self._write_pointer(LATEST, newest[1])
        if self.megatron_tracker:
            self._write_pointer(MEGATRON_TRACKER, str(newest[0]))

    def _write_pointer(self, name: str, text: str) -> None:
        path = self.url(name)
        AtomicFile(Location(path, path), exclusive=False, durable=self.options.durable).write_whole(
            text.encode()
        )

    def _retain(self, root_fd: int, retired: list[str]) -> None:
        for entry in retired:
            # Renamed aside first: a reader never finds a half-deleted checkpoint under its name. As a
            # "tmp" sibling, not an "old" one: recovery restores an old version whose name is missing,
            # and a retired checkpoint killed half deleted must go, never come back as a step.
            with claimed(sibling_name(entry, "tmp")) as aside:
                os.rename(entry, aside, src_dir_fd=root_fd, dst_dir_fd=root_fd)
                remove_at(root_fd, aside, what="retired checkpoint")

    # -- every rank ----------------------------------------------------------------------------------

    def stage_visible(self, stage_name: str) -> bool:
        try:
            return stat.S_ISDIR(os.lstat(self.url(stage_name)).st_mode)
        except OSError:
            return False

    def step_visible(self, name: str) -> bool:
        return self.reader(name).committed_step() is not None
