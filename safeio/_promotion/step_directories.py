"""Checkpoint steps on a POSIX filesystem (local disk, NFS): a stage directory beside the step, one rename.

The writer makes ``.step_N.safeio-stage-<owner>`` beside the step's final name (``StepRename.open_stage``,
the same stage any directory save makes); every rank writes its part there. The commit is that
promotion's ``finish``: the stage is checked to be the directory the writer made, its modes settled, and
under the root's lock (``.checkpoints.safeio.lock``, the ``lock`` option) the next sequence number is
given (``.checkpoints.safeio.sequence``), the manifest of every file written last with the step and the
sequence in it (the marker), fsynced as configured, and the stage renamed to ``step_N``: the commit
point. Then, still under the lock, ``latest`` is pointed at it and retired steps are renamed aside; they
are deleted after, on a background thread, without the lock. A failure after the rename is a warning:
the step is committed. Stages of crashed saves are removed by the next save (or ``safeio gc``), never
one whose owner may be alive.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import Callable, Iterable
from typing import Any

from safeio._boundary import os_failure
from safeio._errors import InvalidTargetError, PromotionError, SafeIOError, TargetExistsError
from safeio._promotion.atomic_file import AtomicFile
from safeio._promotion.base import PhaseHook, Promoted
from safeio._promotion.leftovers import recover_directory
from safeio._promotion.local import LocalPromotion
from safeio._promotion.steps import (
    LATEST,
    MEGATRON_TRACKER,
    SEQUENCE,
    CommittedStep,
    SharedFsyncs,
    StepNames,
    StepPromotion,
    StepStorage,
)
from safeio._storage import claims
from safeio._storage.dirfd import fsync_files, held_directory, is_component, lstat_at
from safeio._storage.fsops import remove_at
from safeio._storage.location import Location
from safeio._storage.names import parse, sibling_name
from safeio._storage.posix import rename_noreplace
from safeio._storage.readers import LocalReader, read_pointer
from safeio._who import who

logger = logging.getLogger("safeio")

ROOT_LOCK = "checkpoints"  # one promotion lock per root: ``.checkpoints.safeio.lock``
_SEQUENCE_CAP = 64  # bytes: a decimal number


class StepRename(LocalPromotion, StepPromotion):
    """One step's commit: the stage renamed to the step's name, which must not exist."""

    hashes_when_durable = False

    def __init__(
        self, location: Location, *, steps: LocalSteps, protect: frozenset[str], **save: Any
    ) -> None:
        # No recovery of the step's own siblings under the lock: the only ones a step has are stages,
        # and the root's dead ones were recovered when this process opened its first stage there.
        super().__init__(location, recover=_nothing_to_recover, **save)
        self._steps = steps
        self._protect = protect
        self._renamed = False
        self._fsyncs: SharedFsyncs | None = None
        self.shares_fsyncs = self.options.durable

    def finish_step(
        self,
        stage: str,
        fsyncs: SharedFsyncs | None = None,
        *,
        commit_point: Callable[[], None] | None = None,
    ) -> Promoted:
        self._fsyncs = fsyncs
        return super().finish_step(stage, fsyncs, commit_point=commit_point)

    def _files_synced_in_walk(self) -> bool:
        return self._fsyncs is None or not self.options.manifest  # else shared out: _sync_files

    def _sync_files(self) -> None:
        # Each rank syncs its share of the files at the same time; the writer its own, then whatever
        # another rank could not (see CheckpointSave). The manifest and the directories stay the writer's.
        if self._fsyncs is None or not self.options.manifest:  # no manifest entries: no list to share
            super()._sync_files()
            return
        sizes = {rel: int(entry.get("size", 0)) for rel, entry in self.contents.entries.items()}
        own = self._fsyncs.hand_out(sizes)
        left = fsync_files(self.stage_fd, own)
        left += self._fsyncs.left_over()
        unsynced = fsync_files(self.stage_fd, left)
        if unsynced:
            raise PromotionError(
                f"could not sync {', '.join(unsynced[:5])} of the stage of step {self.step} "
                f"({len(unsynced)} file(s)): they vanished or cannot be opened; nothing was committed",
                self.target,
            )

    def check_target(self) -> None:
        if self._target_stat() is not None:
            raise TargetExistsError(f"step {self.step} appeared at {self.target} meanwhile", self.target)

    def lock_name(self) -> str:
        return ROOT_LOCK  # the root's entries (the sequence, latest, retention) change with every commit

    def _promote_unlocked(self, stage: str, entries: dict[str, dict[str, Any]]) -> bool:
        return False  # the sequence, latest and retention need the root's lock even for a new step

    def _promote(self, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        self.sequence = self._steps.next_sequence(self.parent_fd)
        try:
            super()._promote(stage, entries)
        except (OSError, SafeIOError) as exc:
            if not self._renamed:
                raise  # before the commit point: nothing is committed
            self.warnings.append(f"the root {self.parent} could not be synced after the commit ({exc})")
        committed = CommittedStep(int(self.step or 0), self.name, self.sequence)
        self._steps.remember(committed)
        self.warnings.extend(self._steps.after_commit(self.parent_fd, committed, self._protect, self.phase))

    def before_rename(self) -> None:
        self.passing_commit_point()  # the manifest is written and sealed; the rename is the commit

    def _put_in_place(self, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        super()._put_in_place(stage, entries)
        self._renamed = True  # the commit point

    def _replace_existing(self, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        raise TargetExistsError(f"step {self.step} appeared at {self.target} meanwhile", self.target)


def _nothing_to_recover(parent: str, parent_fd: int, target_name: str, durable: bool, own_stage: str) -> None:
    del parent, parent_fd, target_name, durable, own_stage


class LocalSteps(StepStorage):
    """The steps of a checkpoint root on a POSIX filesystem."""

    in_place_replicated = True  # the writer's replicated files go straight into the shared stage

    def __init__(self, location: Location, names: StepNames, *args: Any, **kwargs: Any) -> None:
        super().__init__(names, *args, **kwargs)
        self.location = location
        self.root = location.path
        self.root_url = location.path
        # What crashed saves left is recovered by this process's first save here: leftovers come from
        # crashed jobs (a failed save of this one removes its stage), and a listing of the root at every
        # save would make a commit's cost grow with the steps kept.
        self._recovered = False

    def url(self, name: str) -> str:
        return os.path.join(self.root, name)

    def reader(self, name: str) -> LocalReader:
        return LocalReader(Location(self.url(name), self.url(name)))

    def entry_names(self) -> list[str]:
        try:
            return os.listdir(self.root)
        except FileNotFoundError:
            return []

    def read_pointer(self) -> str | None:
        return _pointer_or_none(self.url(LATEST))

    def identity(self, name: str) -> object | None:
        # A directory: (device, inode, owner). Renamed into place once and never changed after.
        try:
            st = os.lstat(self.url(name))
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_uid) if stat.S_ISDIR(st.st_mode) else None

    def entry_owner(self, name: str) -> int | None:
        try:
            return os.lstat(self.url(name)).st_uid
        except OSError:
            return None

    def read_sequence(self) -> int | None:
        return _parse_sequence(_pointer_or_none(self.url(SEQUENCE)))

    # -- the writer ----------------------------------------------------------------------------------

    def promotion(
        self,
        step: int,
        *,
        rank: int,
        protect: Iterable[str] = (),
        unmarked: Callable[[str], bool] | None = None,
        on_phase: PhaseHook | None = None,
    ) -> StepPromotion:
        final_name = self.names.format(step)
        final = self.url(final_name)
        try:
            os.makedirs(self.root, exist_ok=True)
            with held_directory(self.root, follow=True) as root_fd:
                if not self._recovered:  # stages of dead owners, never a live one
                    recover_directory(
                        self.root, parent_fd=root_fd, keep_going=True, durable=self.options.durable
                    )
                    self._recovered = True
                found = lstat_at(root_fd, final_name)
                if found is not None:
                    if self.reader(final_name).committed_step() is not None:
                        raise TargetExistsError(f"step {step} is already committed at {final}", final)
                    if not self._moved_aside(root_fd, final_name, found, unmarked):
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
            steps=self,
            protect=frozenset(protect),
            on_phase=on_phase,
        )

    def _moved_aside(
        self, root_fd: int, name: str, found: os.stat_result, unmarked: Callable[[str], bool] | None
    ) -> bool:
        """A step directory written without safeio at the name a save needs, which that framework's own
        marker says is unfinished (a killed plain save of the step the run now reaches again): renamed
        to a visible sibling and kept, never deleted. Only this user's directory, with no safeio marker at
        all (a damaged commit is refused), and only when the caller gave the framework's judgement; a
        complete one is refused like anything else safeio did not write."""
        if (
            unmarked is None
            or not stat.S_ISDIR(found.st_mode)
            or found.st_uid != os.geteuid()
            or self.reader(name).committed_marker(check_files=False) is not None
            or unmarked(self.url(name))
        ):
            return False
        # Not named like a step (and not starting like one: transformers' rotation globs
        # "checkpoint-*" and would delete it as an old checkpoint), nor like a safeio leftover.
        aside = _unused_name(root_fd, f"incomplete-{name}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        if aside is None:
            return False
        rename_noreplace(name, aside, root_fd)
        logger.warning(
            "%s: %s was written without safeio and is incomplete by its framework's own marker; moved "
            "aside to %s (kept: remove it when it is no longer needed) so that step %d can be committed",
            who(),
            self.url(name),
            self.url(aside),
            self.names.parse(name),
        )
        return True

    def next_sequence(self, root_fd: int) -> int:
        """Under the root's lock, before the commit: the next number in commit order, recorded first, so
        that no two commits share one even if a pointer is never written. Without a readable record
        (a root from before sequences, or a damaged one), one past the highest a step's marker holds."""
        last = self.read_sequence()
        if last is None:
            last = max((c.sequence for c in self.in_commit_order()), default=0)
        self._write(SEQUENCE, str(last + 1))
        return last + 1

    def after_commit(
        self, root_fd: int, committed: CommittedStep, protect: frozenset[str], phase: PhaseHook
    ) -> list[str]:
        """Everything after the commit point, best effort: each failure is a warning saying how it is
        repaired, never an error (the step is committed and every rank is told so)."""
        warnings = []
        phase("pointer")
        try:
            self._write(LATEST, committed.name)
            if self.megatron_tracker:
                self._write(MEGATRON_TRACKER, str(committed.step))
        except (OSError, SafeIOError) as exc:
            warnings.append(
                f"step {committed.step} is committed, but the pointer in {self.root} was not updated "
                f"({exc}); latest() still finds the step, and the next save writes the pointer"
            )
        phase("retention")
        try:
            self._retire(root_fd, self.retired(committed, protect))
        except (OSError, SafeIOError) as exc:
            warnings.append(
                f"step {committed.step} is committed, but retention under {self.root} failed ({exc}); the "
                "next save retries it"
            )
        return warnings

    def _write(self, name: str, text: str) -> None:
        path = self.url(name)
        AtomicFile(Location(path, path), exclusive=False, durable=self.options.durable).write_whole(
            text.encode()
        )

    def _retire(self, root_fd: int, retired: list[CommittedStep]) -> None:
        """Each retired step renamed aside now, under the lock (a reader never finds a half-deleted
        checkpoint under its name), and deleted later without it. As a "tmp" sibling, not an "old" one:
        recovery restores an old version whose name is missing, and a retired checkpoint whose deletion
        was killed must go, never come back as a step (``safeio gc`` finishes it)."""
        aside: list[str] = []
        try:
            for step in retired:
                name = claims.claim(sibling_name(step.name, "tmp"))  # released once deleted
                try:
                    os.rename(step.name, name, src_dir_fd=root_fd, dst_dir_fd=root_fd)
                except BaseException:
                    claims.release(name)
                    raise
                aside.append(name)
        finally:
            if aside:
                self.delete_later(
                    lambda: self._delete(aside), f"{len(aside)} retired step(s) under {self.root}"
                )

    def _delete(self, aside: list[str]) -> None:
        try:
            with held_directory(self.root, follow=True) as root_fd:
                for name in aside:
                    remove_at(root_fd, name, what="retired checkpoint")
        finally:
            for name in aside:
                claims.release(name)

    # -- every rank ----------------------------------------------------------------------------------

    def is_stage_of(self, stage_name: str, step: int) -> bool:
        sibling = parse(stage_name) if is_component(stage_name) else None
        return sibling is not None and sibling.kind == "stage" and sibling.belongs_to(self.names.format(step))

    def stage_visible(self, stage_name: str) -> bool:
        try:
            return stat.S_ISDIR(os.lstat(self.url(stage_name)).st_mode)
        except OSError:
            return False


def _unused_name(root_fd: int, base: str) -> str | None:
    for n in range(100):
        candidate = f"{base}.{n}" if n else base
        if lstat_at(root_fd, candidate) is None:
            return candidate
    return None


def _pointer_or_none(path: str) -> str | None:
    """A pointer file's text; None, with a WARNING naming it, when something else stands there (the steps
    are then scanned: a bogus ``latest`` is never followed nor waited on)."""
    try:
        return read_pointer(path)
    except InvalidTargetError as exc:
        logger.warning("%s: %s; ignored: the committed steps are scanned instead", who(), exc)
        return None


def _parse_sequence(text: str | None) -> int | None:
    with contextlib.suppress(ValueError, TypeError):
        value = int(text or "", 10)
        if 0 <= value < 10**18 and len(text or "") <= _SEQUENCE_CAP:
            return value
    return None
