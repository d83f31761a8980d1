"""Checkpoint steps on a POSIX filesystem (local disk, NFS): a stage directory beside the step, one rename.

The writer makes ``.step_N.safeio-stage-<owner>`` beside the step's final name (``StepRename.open_stage``,
the same stage any directory save makes); every rank writes its part there. The commit is that
promotion's ``finish``: the stage is checked to be the directory the writer made, its modes settled, and
under the root's lock (the ``lock`` option: a flock on the root directory itself locally, a lease marker
``.checkpoints.safeio.lock`` on a network filesystem) the next sequence number is given (recorded in
``.checkpoints.safeio.sequence`` where the root keeps pointers), the manifest of every file written last
with the step and the sequence in it (the marker), fsynced as configured, and the stage renamed to
``step_N`` — exchanged with what stands there when the step is committed already, or renamed aside where
exchange is refused: the commit point. Then, still under the lock, ``latest`` is pointed at it and
retired steps (and a replaced old version) are renamed aside; they are deleted after, on a background
thread, without the lock. A failure after the rename is a warning: the step is committed. Stages of
crashed saves are removed by the next save (or ``safeio gc``), never one whose owner may be alive.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from safeio._boundary import os_failure
from safeio._checkpoints.steps import (
    CommittedStep,
    ExistingDirectory,
    SharedFsyncs,
    StepNames,
    StepPromotion,
    StepStorage,
)
from safeio._errors import InvalidTargetError, PromotionError, SafeIOError, TargetExistsError
from safeio._options import exchange_disabled
from safeio._promotion.aside import RenameAside
from safeio._promotion.atomic_file import AtomicFile
from safeio._promotion.base import PhaseHook, Promoted
from safeio._promotion.exchange import ExchangeRename
from safeio._promotion.leftovers import recover_directory
from safeio._storage import claims, manifest
from safeio._storage.dirfd import fsync_files, held_directory, is_component, lstat_at
from safeio._storage.fsops import carry_missing, remove_at
from safeio._storage.location import Location
from safeio._storage.locking import held, lock_path_for, make_lock
from safeio._storage.names import LATEST, MEGATRON_TRACKER, ROOT_LOCK, SEQUENCE, parse, sibling_name
from safeio._storage.posix import rename_noreplace
from safeio._storage.readers import LocalReader, read_pointer
from safeio._who import who

logger = logging.getLogger("safeio")

_SEQUENCE_CAP = 64  # bytes: a decimal number


class StepRename(ExchangeRename, StepPromotion):
    """One step's commit: the stage renamed to the step's name. What stands there already — this user's
    commit of the same step (a rollback, a re-run into the same root), or a directory the caller's
    ``ExistingDirectory`` lets the commit replace — is swapped out at the commit, as a directory save
    replaces its target (``renameat2`` exchange, or renamed aside where the filesystem refuses it): the
    old version stays whole under the name until the new one takes it, and is then deleted like a
    retired step, after the lock."""

    hashes_when_durable = False

    def __init__(
        self,
        location: Location,
        *,
        steps: LocalSteps,
        protect: frozenset[str],
        existing: ExistingDirectory,
        **save: Any,
    ) -> None:
        # No recovery of the step's own siblings under the lock: the only ones a step has are stages,
        # and the root's dead ones were recovered when this process opened its first stage there.
        super().__init__(location, recover=_nothing_to_recover, **save)
        self._steps = steps
        self._protect = protect
        self._existing = existing
        self._renamed = False
        self._fsyncs: SharedFsyncs | None = None
        self.shares_fsyncs = self.options.durable
        self._replaced: list[str] = []  # old versions renamed aside, deleted after the commit
        self.retire_also: set[str] = set()  # steps the framework's own retention chose (see retire())

    def finish_step(
        self,
        stage: str,
        fsyncs: SharedFsyncs | None = None,
        *,
        commit_point: Callable[[], None] | None = None,
    ) -> Promoted:
        self._fsyncs = fsyncs
        if self._existing.adopt:
            self._adopt_existing()
        return super().finish_step(stage, fsyncs, commit_point=commit_point)

    def _adopt_existing(self) -> None:
        """``ExistingDirectory.adopt``: the files of the directory the script saves into are kept in the
        committed step, where the save wrote nothing of the same name (its files win) — also when it is
        an earlier commit of the step: a tokenizer the script wrote there before its first save stays."""
        found = lstat_at(self.parent_fd, self.name)
        if found is None or not self._steps.replaceable(self.name, found, self._existing):
            return
        with held_directory(self.name, dir_fd=self.parent_fd) as existing_fd:
            carried = carry_missing(existing_fd, self.stage_fd, skip=_not_content)
        logger.debug("%s: %d file(s) of %s kept in step %s", who(self.rank), carried, self.target, self.step)

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
        found = self._target_stat()
        if found is None:
            return
        if self._steps.replaceable(self.name, found, self._existing):
            return
        raise TargetExistsError(
            f"{self.target} appeared meanwhile and is not a step safeio may replace (a commit of this "
            "user's, or a directory the save was told it may replace); nothing was committed",
            self.target,
        )

    def lock_name(self) -> str:
        return ROOT_LOCK  # the root's entries (the sequence, latest, retention) change with every commit

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # The root directory itself is locked (a flock on it, locally): no lock file is left in a
        # framework's own directory, whose listing its users and tests read. Network filesystems take a
        # lease, whose marker stands only while the commit holds it.
        lock = make_lock(
            lock_path_for(self.parent, self.lock_name()),
            self.options.lock,
            self.lock_timeout(),
            self.options.lease_seconds,
            parent_fd=self.parent_fd,
            on_directory=True,
        )
        with held(lock, self.target, self.rank):
            yield

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
        self.warnings.extend(
            self._steps.after_commit(
                self.parent_fd, committed, self._protect, self.phase, self.retire_also, self._replaced
            )
        )

    def before_rename(self) -> None:
        self.passing_commit_point()  # the manifest is written and sealed; the rename is the commit

    def _put_in_place(self, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        super()._put_in_place(stage, entries)
        self._renamed = True  # the commit point

    def _swap(self) -> None:
        # NFS and FUSE refuse RENAME_EXCHANGE (EINVAL): asking would cost a round trip, and its fallback a
        # WARNING on the first rollback (or just-in-time checkpoint) of every job. A step replaced there is
        # missing for an instant, never torn: latest() meanwhile names the previous commit.
        if exchange_disabled() or not self._noreplace_flag():
            RenameAside._swap(self)
        else:
            super()._swap()

    def remove_old_version(self, name: str) -> None:
        """The version the commit replaced (at ``name``: the stage's after an exchange, the aside one
        otherwise) is renamed aside as a retired step is, and deleted with them after the lock: a step's
        gigabytes are not deleted while every later commit of the root waits."""
        aside = claims.claim(sibling_name(self.name, "tmp"))  # released once deleted
        try:
            os.rename(name, aside, src_dir_fd=self.parent_fd, dst_dir_fd=self.parent_fd)
        except OSError as exc:
            claims.release(aside)
            self.warnings.append(
                f"step {self.step} is committed, but its previous version {os.path.join(self.parent, name)} "
                f"could not be set aside for deletion ({exc}); `safeio gc {self.parent}` removes it"
            )
            return
        self._replaced.append(aside)


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
        existing: ExistingDirectory | None = None,
        on_phase: PhaseHook | None = None,
    ) -> StepPromotion:
        existing = existing or ExistingDirectory()
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
                    self._judge_existing(root_fd, final_name, found, existing)
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
            existing=existing,
            on_phase=on_phase,
        )

    def _judge_existing(
        self, root_fd: int, name: str, found: os.stat_result, existing: ExistingDirectory
    ) -> None:
        """Before the body: what stands at a step's name is replaced by the commit (this user's commit of
        the step, or what ``existing`` lets it replace), moved aside (written without safeio, judged by
        the framework), or refused, naming it."""
        path = self.url(name)
        if self.replaceable(name, found, existing):
            if self._committed_here(name, found):
                logger.info(
                    "%s: step %s at %s is committed already: the commit replaces it", who(), name, path
                )
            return
        if self._moved_aside(root_fd, name, found, existing.unmarked):
            return
        if self.reader(name).committed_marker(check_files=False) is not None:
            raise TargetExistsError(
                f"{path} is a step another user committed (or its marker is of another step): safeio never "
                "replaces it; save another step, or into another root",
                path,
            )
        raise InvalidTargetError(
            f"{path} exists and is not a committed checkpoint (safeio never deletes what it did not "
            "write): move it away, or save another step",
            path,
        )

    def _committed_here(self, name: str, found: os.stat_result) -> bool:
        return (
            stat.S_ISDIR(found.st_mode)
            and found.st_uid == os.geteuid()
            and self.committed_step(name, check_files=False) is not None
        )

    def replaceable(self, name: str, found: os.stat_result, existing: ExistingDirectory) -> bool:
        """Whether a commit of step ``name`` may replace what stands there: this user's commit of it, or
        a directory of this user's without any safeio step marker that ``existing`` hands over (the
        framework's placeholder of this save, or one the script saves into)."""
        if self._committed_here(name, found):
            return True
        if not self.adoptable(name, found):
            return False
        return existing.adopt or (existing.placeholder is not None and existing.placeholder(self.url(name)))

    def adoptable(self, name: str, found: os.stat_result) -> bool:
        """A directory of this user's (not a link) without any safeio step marker."""
        return (
            stat.S_ISDIR(found.st_mode)
            and found.st_uid == os.geteuid()
            and self.reader(name).committed_marker(check_files=False) is None
        )

    def _moved_aside(
        self, root_fd: int, name: str, found: os.stat_result, unmarked: Callable[[str], bool] | None
    ) -> bool:
        """A step directory written without safeio at the name a save needs, judged by that framework's
        own marker: renamed to a visible sibling and kept, never deleted, so that the step can be
        committed. Incomplete (a killed plain save of the step the run now reaches again):
        ``incomplete-<name>.<time>``; complete (a plain run's checkpoint, and this run re-saves its step:
        a rollback, or a re-run into the same directory, where the framework would have written over
        it): ``previous-<name>.<time>``. Only this user's directory, with no safeio marker at all (a
        damaged commit is refused), and only when the caller gave the framework's judgement."""
        if (
            unmarked is None
            or not stat.S_ISDIR(found.st_mode)
            or found.st_uid != os.geteuid()
            or self.reader(name).committed_marker(check_files=False) is not None
        ):
            return False
        complete = unmarked(self.url(name))
        # Not named like a step (and not starting like one: transformers' rotation globs
        # "checkpoint-*" and would delete it as an old checkpoint), nor like a safeio leftover.
        kind = "previous" if complete else "incomplete"
        aside = _unused_name(root_fd, f"{kind}-{name}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        if aside is None:
            return False
        rename_noreplace(name, aside, root_fd)
        logger.warning(
            "%s: %s was written without safeio and is %s by its framework's own marker; moved aside to %s "
            "(kept: remove it when it is no longer needed) so that step %d can be committed",
            who(),
            self.url(name),
            "complete" if complete else "incomplete",
            self.url(aside),
            self.names.parse(name),
        )
        return True

    def next_sequence(self, root_fd: int) -> int:
        """Under the root's lock, before the commit: the next number in commit order. Recorded first
        where the root keeps the record (see ``StepStorage``), so that no two commits share one even if
        a pointer is never written; without it, one past the highest a step's marker holds, which the
        lock keeps unique (the next commit reads this one's marker)."""
        del root_fd
        recorded = self.read_sequence()
        number = self.next_number(recorded)
        if self.pointer or recorded is not None or os.path.lexists(self.url(SEQUENCE)):
            self._write(SEQUENCE, str(number))
        return number

    def after_commit(
        self,
        root_fd: int,
        committed: CommittedStep,
        protect: frozenset[str],
        phase: PhaseHook,
        retire_also: Iterable[str] = (),
        replaced: Iterable[str] = (),
    ) -> list[str]:
        """Everything after the commit point, best effort: each failure is a warning saying how it is
        repaired, never an error (the step is committed and every rank is told so). ``replaced``: old
        versions of the step, already renamed aside, deleted with the retired steps."""
        warnings = []
        phase("pointer")
        try:
            if self.pointer or os.path.lexists(self.url(LATEST)):
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
            self._retire(root_fd, self.retired(committed, protect, retire_also), list(replaced))
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

    def _retire(self, root_fd: int, retired: list[CommittedStep], replaced: list[str]) -> None:
        """Each retired step renamed aside now, under the lock (a reader never finds a half-deleted
        checkpoint under its name), and deleted later without it, with the ``replaced`` old versions
        already aside. As a "tmp" sibling, not an "old" one: recovery restores an old version whose name
        is missing, and a retired checkpoint whose deletion was killed must go, never come back as a
        step (``safeio gc`` finishes it)."""
        aside: list[str] = list(replaced)
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
                    lambda: self._delete(aside), f"{len(aside)} retired or replaced step(s) under {self.root}"
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


def _not_content(name: str) -> bool:
    """What a directory a save adopts holds that is no file of the checkpoint: a safeio marker (an earlier
    save's manifest: the commit writes its own) or a safeio leftover."""
    return name == manifest.MANIFEST_NAME or parse(name) is not None


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
