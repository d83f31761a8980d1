"""The steps of a checkpoint root on a POSIX filesystem (local disk, NFS): ``LocalSteps`` reads them
(names, markers, the pointer files) and makes each commit: a ``LocalPromotion`` handed a ``StepRename``
(``step_rename``) as its behaviour, which is handed a ``LocalRootCommit``: what the commit needs from the
root (the next sequence number under the root's lock, then ``latest`` and retention), so that the commit
never reaches back into ``LocalSteps``.

Before a save's body, what stands at the step's name is judged: this user's commit of the step is
replaced by the commit; a directory written without safeio is moved aside (by the framework's own
judgement), replaced (a placeholder, or one the script saves into) or refused, naming it. Stages of
crashed saves are removed by this process's first save here (or ``safeio gc``), never one whose owner
may be alive.
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
from safeio._checkpoints.step_rename import StepRename, adopt_existing, nothing_to_recover
from safeio._checkpoints.steps import (
    CommittedStep,
    ExistingDirectory,
    RootCommit,
    StepCommit,
    StepNames,
    StepStorage,
)
from safeio._errors import InvalidTargetError, SafeIOError, TargetExistsError
from safeio._promotion.atomic_file import AtomicFile
from safeio._promotion.base import PhaseHook
from safeio._promotion.leftovers import recover_directory
from safeio._promotion.local import LocalPromotion
from safeio._storage import claims
from safeio._storage.dirfd import held_directory, identity, is_component, lstat_at, open_directory
from safeio._storage.fsops import remove_at
from safeio._storage.location import Location
from safeio._storage.manifest import MANIFEST_NAME
from safeio._storage.metadata import load_manifest
from safeio._storage.names import LATEST, MEGATRON_TRACKER, SEQUENCE, parse, sibling_name
from safeio._storage.posix import rename_noreplace
from safeio._storage.readers import LocalReader, read_pointer
from safeio._who import who

logger = logging.getLogger("safeio")

_SEQUENCE_CAP = 64  # bytes: a decimal number


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
        return LocalReader(Location(self.url(name), self.url(name)), follow=False)

    def own_reader(self, name: str) -> LocalReader:
        # The directory's owner, not only the marker's: where hard links of others' files are allowed
        # (fs.protected_hardlinks=0), another user's directory can hold a link to a marker of ours, one
        # of a step since deleted, beside their own files of the sizes it lists.
        return LocalReader(Location(self.url(name), self.url(name)), owner=os.geteuid())

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
    ) -> StepCommit:
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
        root = LocalRootCommit(self, step, final_name, frozenset(protect), existing)
        promotion = LocalPromotion(
            Location(final, final),
            self.options,
            rank=rank,
            call_id=f"checkpoint/{step}",
            recover=nothing_to_recover,
            behaviour=StepRename(root),
            on_phase=on_phase,
            marker={"step": step},
        )
        return StepCommit(
            promotion,
            root,
            shares_fsyncs=self.options.durable,
            adopt=(lambda: adopt_existing(promotion, root)) if existing.adopt else None,
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

    def _retire(self, root_fd: int, retired: list[CommittedStep], replaced: list[str]) -> None:
        """Each retired step renamed aside now, under the lock (a reader never finds a half-deleted
        checkpoint under its name), and deleted later without it, with the ``replaced`` old versions
        already aside. As a "tmp" sibling, not an "old" one: recovery restores an old version whose name
        is missing, and a retired checkpoint whose deletion was killed must go, never come back as a
        step (``safeio gc`` finishes it)."""
        aside: list[str] = list(replaced)
        steps: dict[str, CommittedStep] = {}  # aside name -> the retired step renamed to it
        try:
            for step in retired:
                name = claims.claim(sibling_name(step.name, "tmp"))  # released once deleted
                try:
                    os.rename(step.name, name, src_dir_fd=root_fd, dst_dir_fd=root_fd)
                except BaseException:
                    claims.release(name)
                    raise
                aside.append(name)
                steps[name] = step
        finally:
            if aside:
                self.delete_later(
                    lambda: self._delete(aside, steps),
                    f"{len(aside)} retired or replaced step(s) under {self.root}",
                )

    def _delete(self, aside: list[str], steps: dict[str, CommittedStep]) -> None:
        try:
            with held_directory(self.root, follow=True) as root_fd:
                for name in aside:
                    step = steps.get(name)
                    if step is None:
                        remove_at(root_fd, name, what="replaced checkpoint")
                    else:
                        self._remove_retired(root_fd, name, step)
        finally:
            for name in aside:
                claims.release(name)

    def _remove_retired(self, root_fd: int, name: str, step: CommittedStep) -> None:
        """Delete the retired ``step``, renamed aside to ``name``, if that is what stands there: the step's
        marker, this user's, read through the descriptor of the directory then removed (its identity).
        A root others can write without the sticky bit lets another user rename a tree of yours, which they
        may not delete, to the step's name between retention's judgement and its rename: that tree was
        deleted. Anything else at ``name`` is put back under the step's name, not deleted."""
        made = _committed_identity(root_fd, name, step.step)
        if made is not None:
            remove_at(root_fd, name, what="retired checkpoint", expected=made)
            return
        with contextlib.suppress(OSError):
            rename_noreplace(name, step.name, root_fd)
            name = step.name
        logger.warning(
            "%s: %s, renamed aside to be retired, is not the step committed there any more (renamed or "
            "replaced by another user meanwhile): not deleted, left as %s",
            who(),
            self.url(step.name),
            self.url(name),
        )

    # -- every rank ----------------------------------------------------------------------------------

    def is_stage_of(self, stage_name: str, step: int) -> bool:
        sibling = parse(stage_name) if is_component(stage_name) else None
        return sibling is not None and sibling.kind == "stage" and sibling.belongs_to(self.names.format(step))

    def stage_visible(self, stage_name: str) -> bool:
        try:
            return stat.S_ISDIR(os.lstat(self.url(stage_name)).st_mode)
        except OSError:
            return False


def _committed_identity(root_fd: int, name: str, step: int) -> tuple[int, int] | None:
    """The identity of the directory ``name`` if it holds this user's marker of a commit of ``step``
    (read through its descriptor, following no link), else None."""
    try:
        fd = open_directory(name, dir_fd=root_fd)
    except OSError:
        return None
    try:
        marker = lstat_at(fd, MANIFEST_NAME)
        if marker is None or marker.st_uid != os.geteuid():
            return None
        record = load_manifest(fd, MANIFEST_NAME)
        found = record.get("step") if isinstance(record, dict) else None
        if isinstance(found, bool) or found != step:
            return None
        return identity(os.fstat(fd))
    except OSError:
        return None
    finally:
        os.close(fd)


class LocalRootCommit(RootCommit):
    """What the commit of one step on POSIX needs from its root (see ``RootCommit``): the next sequence
    number, the pointer files, retention (retired steps renamed aside under the lock, deleted after it),
    and whether what stands at the step's name may be replaced. Made by ``LocalSteps.promotion``, which
    it reads the root through."""

    def __init__(
        self, steps: LocalSteps, step: int, name: str, protect: frozenset[str], existing: ExistingDirectory
    ) -> None:
        super().__init__(step, name, protect)
        self._steps = steps
        self._existing = existing

    def may_replace(self, found: os.stat_result) -> bool:
        return self._steps.replaceable(self.name, found, self._existing)

    def next_sequence(self) -> int:
        """Under the root's lock, before the commit: the next number in commit order. Recorded first
        where the root keeps the record (see ``StepStorage``), so that no two commits share one even if
        a pointer is never written; without it, one past the highest a step's marker holds, which the
        lock keeps unique (the next commit reads this one's marker)."""
        steps = self._steps
        recorded = steps.read_sequence()
        number = steps.next_number(recorded)
        if steps.pointer or recorded is not None or os.path.lexists(steps.url(SEQUENCE)):
            self._write(SEQUENCE, str(number))
        return number

    def after_commit(
        self, sequence: int, phase: PhaseHook, replaced: Iterable[str] = (), root_fd: int | None = None
    ) -> list[str]:
        assert root_fd is not None, "a commit on POSIX holds its root open"
        steps, committed = self._steps, self.committed(sequence)
        steps.remember(committed)  # its marker need not be read back for retention
        warnings = []
        phase("pointer")
        try:
            if steps.pointer or os.path.lexists(steps.url(LATEST)):
                self._write(LATEST, committed.name)
            if steps.megatron_tracker:
                self._write(MEGATRON_TRACKER, str(committed.step))
        except (OSError, SafeIOError) as exc:
            warnings.append(
                f"step {committed.step} is committed, but the pointer in {steps.root} was not updated "
                f"({exc}); latest() still finds the step, and the next save writes the pointer"
            )
        phase("retention")
        try:
            retired = steps.retired(committed, self.protect, self.retire_also)
            steps._retire(root_fd, retired, list(replaced))
        except (OSError, SafeIOError) as exc:
            warnings.append(
                f"step {committed.step} is committed, but retention under {steps.root} failed ({exc}); the "
                "next save retries it"
            )
        return warnings

    def _write(self, name: str, text: str) -> None:
        path = self._steps.url(name)
        AtomicFile(Location(path, path), exclusive=False, durable=self._steps.options.durable).write_whole(
            text.encode()
        )


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
