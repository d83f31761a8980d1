"""The steps of a ``safeio.Checkpoints`` root: their names, their pointer files, and what every kind of
place holding them shares (``StepStorage``). One subclass per storage behaviour, registered for the
root's back end (``storage``): ``LocalSteps`` (a stage directory and a rename, ``step_directories``) and
``ObjectSteps`` (in place under the step's prefix, committed by its marker, ``step_prefixes``). A commit
(``StepCommit``) is a promotion of the step's stage through its storage's ``Promotion.finish``, like
any directory save, handed the step's behaviour (``StepRename``, ``StepMarker``) and its ``RootCommit``;
the checkpoint layer above says who commits and when.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from safeio._errors import InvalidOptionError
from safeio._options import SaveOptions
from safeio._promotion.base import PhaseHook, Promotion
from safeio._stalls import Cadence, seconds, thread_stack
from safeio._storage.dirfd import is_component
from safeio._storage.readers import TargetReader
from safeio._threads import start_background
from safeio._who import who

logger = logging.getLogger("safeio")


class StepNames:
    """A name pattern with exactly one ``{step}``; formats a step and parses a directory name back."""

    def __init__(self, pattern: str, root: str) -> None:
        if not isinstance(pattern, str) or pattern.count("{step}") != 1:
            raise InvalidOptionError(f"name must contain '{{step}}' exactly once, got {pattern!r}", root)
        before, after = pattern.split("{step}")
        if not is_component(before + "0" + after) or pattern.startswith("."):
            raise InvalidOptionError(
                f"name must make one visible file name (no '/', not starting with '.'), got {pattern!r}", root
            )
        self.pattern = pattern
        self._regex = re.compile(re.escape(before) + r"(0|[1-9][0-9]{0,17})" + re.escape(after))

    def format(self, step: int) -> str:
        return self.pattern.replace("{step}", str(step))

    def parse(self, name: str) -> int | None:
        match = self._regex.fullmatch(name)
        return int(match[1]) if match else None


def check_step(step: object, root: str) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**18:
        raise InvalidOptionError(f"step must be an int from 0 to 10**18, got {step!r}", root)
    return step


class SharedFsyncs(Protocol):
    """A durable commit's fsyncs of the stage's files, shared out among the checkpoint's ranks, which
    sync their shares at the same time (as DCP's ranks each sync their own files), not one after another
    on the writer. Made by the checkpoint layer, which knows the ranks."""

    def hand_out(self, sizes: dict[str, int]) -> list[str]:
        """The writer: give every rank its share of the files (relative name -> size); returns the
        writer's own."""

    def left_over(self) -> list[str]:
        """The writer, once it synced its own share: the files other ranks did not sync (a rank that
        never answered, a file it could not open), which the writer syncs itself."""


class RootCommit(ABC):
    """What the commit of one step needs from its root, handed to the commit as one object when it is
    made: the step and its directory's name, the commit-point check, the next place in commit order
    (given under the root's lock, before the commit), and what follows the commit point (the pointer
    files, retention). The commit calls these and nothing else of the root: it never reaches into the
    root's step storage, which made this object for it. The checkpoint layer sets what it decides at the
    commit (``commit_point``, ``fsyncs``, ``retire_also``); the commit records ``warnings``."""

    def __init__(self, step: int, name: str, protect: frozenset[str]) -> None:
        self.step = step
        self.name = name
        self.protect = protect  # never retired after this commit
        # Committed steps the framework's own retention chose, retired after this commit with keep's
        # (``CheckpointStage.retire``).
        self.retire_also: set[str] = set()
        # Called right before the commit point (the rename, the marker); it raises to commit nothing (a
        # rank gave up waiting: it was told the step is not committed).
        self.commit_point: Callable[[], None] | None = None
        # A durable commit's fsyncs of the stage's files, shared out among the ranks (None: the writer's).
        self.fsyncs: SharedFsyncs | None = None
        # What failed after the commit point without undoing it (the pointer, retention): the step is
        # committed; these say what to repair, and every rank hears them.
        self.warnings: list[str] = []

    def passing_commit_point(self) -> None:
        if self.commit_point is not None:
            self.commit_point()

    @abstractmethod
    def next_sequence(self) -> int:
        """Before the commit (under the root's lock, where there is one): the next place in commit order,
        recorded first where the root keeps the record."""

    @abstractmethod
    def after_commit(
        self, sequence: int, phase: PhaseHook, replaced: Iterable[str] = (), root_fd: int | None = None
    ) -> list[str]:
        """Everything after the commit point, best effort: each failure is a warning saying how it is
        repaired (the step is committed and every rank is told so). ``replaced``: old versions of the
        step, already renamed aside, deleted with the retired steps; ``root_fd``: the root, held open by
        a commit where directories exist."""

    def may_replace(self, found: os.stat_result) -> bool:
        """Whether the commit may replace what stands at the step's name (``found``): none by default."""
        del found
        return False

    def committed(self, sequence: int) -> CommittedStep:
        return CommittedStep(self.step, self.name, sequence)


@dataclass(frozen=True)
class StepCommit:
    """The commit of one step, as ``CheckpointSave`` drives it: ``promotion.open_stage()`` on the writer
    before the body; once every rank reported, ``root`` told what the checkpoint layer decides
    (``commit_point``, ``fsyncs``, ``retire_also``), ``adopt()`` if given, then ``promotion.finish``;
    ``promotion.discard`` when a rank failed. ``promotion`` is the storage's flow handed the step's
    behaviour (``LocalPromotion`` with ``StepRename``, ``ObjectPromotion`` with ``StepMarker``). The
    commit point is the step appearing under its name (a rename; an object store's marker): a failure
    before it commits nothing; after it (the ``latest`` pointer, retention) is a warning in
    ``root.warnings``."""

    promotion: Promotion
    root: RootCommit
    # Whether the commit syncs the stage's files (a durable commit on a POSIX filesystem), so that the
    # ranks can share the work out (``root.fsyncs``).
    shares_fsyncs: bool = False
    # ``ExistingDirectory.adopt`` (POSIX): the directory the script saves into, carried into the stage.
    adopt: Callable[[], None] | None = None


@dataclass(frozen=True)
class CommittedStep:
    """A committed step of this user: its number, directory name, and place in commit order
    (``sequence``; 0 for a step committed before sequences were recorded: those sort by number, first)."""

    step: int
    name: str
    sequence: int

    @property
    def order(self) -> tuple[int, int]:
        return (self.sequence, self.step)


@dataclass(frozen=True)
class ExistingDirectory:
    """What a save does with a directory of this user's that stands at its step's name without any
    safeio step marker (a save that already is committed is replaced by the new version, always).

    ``unmarked(path)``: the framework's own judgement, complete or not; a directory so judged is moved
    aside (kept, never deleted) and the step committed. ``placeholder(path)``: the framework made it to
    mark this very save in progress, and it holds nothing to keep (transformers' just-in-time
    checkpoint: ``checkpoint-N`` holding only ``checkpoint-is-incomplete.txt``); the commit replaces it.
    ``adopt``: the script saves *into* a directory of its own (``accelerator.save_state(dir)`` into a
    directory it made, or wrote a tokenizer into): its files are kept in the committed step, under what
    the save wrote, which wins (the files of an earlier commit of the step too, as the framework writes
    into the directory it finds). With none of them such a directory is refused."""

    unmarked: Callable[[str], bool] | None = None
    placeholder: Callable[[str], bool] | None = None
    adopt: bool = False


class StepStorage(ABC):
    """The steps of one checkpoint root, as one kind of place holds them.

    Commit order is the order: each commit records the next number of the root's sequence in its marker,
    and the most recent commit is the latest, not the highest number (a job that rolled back to step 10
    and saved 15 resumes from 15, as DeepSpeed's ``latest`` and Megatron's tracker would). With
    ``pointer`` (safeio's own roots), ``.checkpoints.safeio.sequence`` holds the last number given,
    written before the commit, and ``latest`` names the most recent commit, so that finding it reads
    two small files and one step. Without it (a framework's own directory, whose listing must stay the
    framework's: the Trainer's ``output_dir``), neither file is created — the next number is one past the
    highest a marker records, given under the root's lock, and the latest is found by reading the markers
    — and where a root already has them, they are kept current. Only the steps this user committed
    count: another user's, in a shared root, are never chosen or retired.
    """

    in_place_replicated: bool  # whether the writer's replicated files go straight into the stage
    root_url: str

    def __init__(
        self,
        names: StepNames,
        options: SaveOptions,
        *,
        keep: int | None,
        megatron_tracker: bool,
        pointer: bool = True,
    ) -> None:
        self.names = names
        self.options = options
        self.keep = keep
        self.megatron_tracker = megatron_tracker
        self.pointer = pointer
        self._deleting: threading.Thread | None = None
        # Steps whose marker this process has read (or written), by the identity of what stood at the
        # name then: a committed step never changes, so retention need not parse a large marker again.
        self._known: dict[str, tuple[object, CommittedStep]] = {}

    # -- what a kind of place provides ---------------------------------------------------------------

    @abstractmethod
    def url(self, name: str) -> str:
        """Where step (or stage) ``name`` is, as the user names it."""

    @abstractmethod
    def entry_names(self) -> list[str]:
        """The names directly under the root (one listing)."""

    @abstractmethod
    def reader(self, name: str) -> TargetReader:
        """The reader of step directory (or prefix) ``name``."""

    def own_reader(self, name: str) -> TargetReader:
        """The reader of ``name`` that judges it a commit of this user's: where owners can be told, only
        what this user owns is read (``reader`` reads another user's step too, to name it)."""
        return self.reader(name)

    @abstractmethod
    def read_pointer(self) -> str | None:
        """What ``latest`` names, or None (absent, damaged, not a small regular file)."""

    @abstractmethod
    def read_sequence(self) -> int | None:
        """The last sequence number given to a commit here, or None (none yet, or unreadable)."""

    @abstractmethod
    def promotion(
        self,
        step: int,
        *,
        rank: int,
        protect: Iterable[str] = (),
        existing: ExistingDirectory | None = None,
        on_phase: PhaseHook | None = None,
    ) -> StepCommit:
        """The writer: the commit of ``step`` (its stage is made by ``open_stage``); retention after it
        never removes a step named in ``protect``. ``existing``: what to do with a directory written
        without safeio at the step's name (``Checkpoints.save``); a kind of place that cannot do it
        refuses. ``on_phase`` hears each phase of the commit (the promotion flow's, then "pointer" and
        "retention")."""

    @abstractmethod
    def is_stage_of(self, stage_name: str, step: int) -> bool:
        """Whether ``stage_name`` (heard from the writer through the store: input like anything read) is a
        name this kind of place gives the stage of ``step``: one component beside the step, never a path."""

    def identity(self, name: str) -> object | None:
        """What tells the directory at ``name`` from any other that may stand there later (None: this kind
        of place cannot tell, and a marker is read every time)."""
        return None

    def remember(self, committed: CommittedStep) -> None:
        """A step this process just committed: its marker need not be read back for retention."""
        identity = self.identity(committed.name)
        if identity is not None:
            self._known[committed.name] = (identity, committed)

    @abstractmethod
    def stage_visible(self, stage_name: str) -> bool:
        """Whether this process sees the stage the writer made (an NFS client may not yet)."""

    # -- reading -------------------------------------------------------------------------------------

    def committed_step(
        self, name: str, reader: TargetReader | None = None, *, check_files: bool = True
    ) -> CommittedStep | None:
        """Step ``name`` if it is committed (its marker's step is the name's) by this user.
        ``check_files=False``: by its marker alone (retention orders steps committed long ago)."""
        step = self.names.parse(name)
        if step is None:
            return None
        identity = None if check_files else self.identity(name)
        known = self._known.get(name)
        if identity is not None and known is not None and known[0] == identity:
            return known[1]
        reader = reader or self.own_reader(name)
        record = reader.committed_marker(check_files=check_files)
        if record is None or record["step"] != step:
            return None
        owner = reader.owner(record)  # None: a marker from before owners were recorded (object stores)
        if owner is not None and owner != os.geteuid():
            return None
        sequence = record.get("sequence")
        if isinstance(sequence, bool) or not isinstance(sequence, int) or sequence < 1:
            sequence = 0  # committed before sequences were recorded (or damaged): sorts first, by step
        found = CommittedStep(step, name, sequence)
        if identity is not None:
            self._known[name] = (identity, found)
        return found

    def entry_owner(self, name: str) -> int | None:
        """The uid owning what stands at ``name`` (None: this kind of place cannot tell)."""
        return None

    def unmarked(self) -> list[tuple[int, str]]:
        """(step, name) of every entry named like a step that has no safeio marker at all and belongs to
        this user (where owners can be told): written without safeio (a framework's own checkpoints from
        before). Another user's are never resumed from, as with committed steps. By step number."""
        return sorted(
            (step, name)
            for name in self.entry_names()
            if (step := self.names.parse(name)) is not None
            and self.entry_owner(name) in (None, os.geteuid())
            and self.reader(name).committed_marker(check_files=False) is None
        )

    def unmarked_step(self, name: str) -> bool:
        """Whether ``name`` is an entry of this user's named like a step with no safeio marker at all."""
        return (
            self.names.parse(name) is not None
            and self.entry_owner(name) in (None, os.geteuid())
            and self.reader(name).exists()
            and self.reader(name).committed_marker(check_files=False) is None
        )

    def step_visible(self, name: str) -> bool:
        """Whether this process sees step ``name`` committed."""
        return self.committed_step(name) is not None

    def in_commit_order(self, *, check_files: bool = True) -> list[CommittedStep]:
        """Every step of this user committed here, oldest commit first (reads every step's marker)."""
        names = self.entry_names()
        found = [c for name in names if (c := self.committed_step(name, check_files=check_files)) is not None]
        return sorted(found, key=lambda c: c.order)

    def committed(self) -> list[tuple[int, str]]:
        """(step, name) of every committed checkpoint, as this process sees the root (by step number)."""
        return sorted((c.step, c.name) for c in self.in_commit_order())

    def latest(self) -> CommittedStep | None:
        """The most recent commit: what the pointer names, when that is a committed step whose sequence
        is the last one given (two reads and one step checked, however many steps there are); else,
        after a failure between a commit and its pointer, the newest by commit order (a listing)."""
        named = self.read_pointer()
        found = self.committed_step(named) if named else None
        if found is not None:
            last = self.read_sequence()
            if last is None or found.sequence >= last:
                return found
        ordered = self.in_commit_order()
        return ordered[-1] if ordered else None

    # -- retention -----------------------------------------------------------------------------------

    def retired(
        self, just_committed: CommittedStep, protect: Iterable[str], also: Iterable[str] = ()
    ) -> list[CommittedStep]:
        """This user's committed steps beyond the newest ``keep`` by commit order, and those named in
        ``also`` (a framework's own retention decided them: ``CheckpointStage.retire``), never the step
        just committed nor a protected one. One listing decides when there cannot be more steps than
        ``keep`` (the usual case: retention keeps it so); only then are the markers read."""
        also = set(also)
        if self.keep is None and not also:
            return []
        beyond_keep = self.keep is not None and (
            sum(1 for name in self.entry_names() if self.names.parse(name) is not None) > self.keep
        )
        if not beyond_keep and not also:
            return []
        ordered = self.in_commit_order(check_files=False)
        kept = {c.name for c in ordered[-self.keep :]} if beyond_keep and self.keep is not None else None
        spared = {just_committed.name, *protect}
        return [
            c
            for c in ordered
            if c.name not in spared and (c.name in also or (kept is not None and c.name not in kept))
        ]

    def next_number(self, recorded: int | None) -> int:
        """The next place in commit order (under the root's lock, before the commit): one past the record
        when there is one, else past the highest a step's marker holds (a root without the record: one
        from before sequences, a damaged one, or one kept without pointer files)."""
        last = recorded
        if last is None:
            last = max((c.sequence for c in self.in_commit_order(check_files=False)), default=0)
        return last + 1

    def delete_later(self, delete: Callable[[], None], what: str) -> None:
        """Run ``delete`` (retired steps, already renamed aside) on a background thread: no rank waits for
        it. The next save, ``Checkpoints.wait()`` and the process's exit join it, for the timeout at most."""
        self.join_deletions()

        def run() -> None:
            try:
                delete()
            except BaseException as exc:  # the steps are aside already: never a checkpoint again
                logger.warning(
                    "%s: could not finish deleting %s (%s); `safeio gc %s` removes what is left",
                    who(),
                    what,
                    exc,
                    self.root_url,
                )

        # Bounded at exit too (safeio._threads): a deletion stuck on a dead server never holds the process.
        self._deleting = start_background(run, name=f"safeio-retention {what}", bound=self.options.timeout)

    def join_deletions(self) -> None:
        """Wait for the deletion of retired steps, bounded (the timeout): one that hangs (a dead NFS
        server) is left to finish or fail on its own, with a WARNING. While it lasts, the waiting
        thread says so on the stall cadence, with where the deletion is."""
        deleting, self._deleting = self._deleting, None
        if deleting is None:
            return
        cadence = Cadence(self.options.warn_after)
        while deleting.is_alive() and cadence.elapsed() < self.options.timeout:
            deleting.join(min(cadence.due_in(), self.options.timeout - cadence.elapsed()))
            elapsed = cadence.take() if deleting.is_alive() else None
            if elapsed is not None:
                logger.warning(
                    "%s: still waiting after %s s for %s to finish (%s, retention of %s): the step before "
                    "was committed; a filesystem that does not answer holds it (check the mount). Its "
                    "stack (most recent call last):\n%s",
                    who(),
                    seconds(elapsed),
                    deleting.name,
                    "the deletion of retired steps renamed aside",
                    self.root_url,
                    thread_stack(deleting.ident),
                )
        if deleting.is_alive():
            logger.warning(
                "%s: %s is still running after %g s (the timeout): left to finish on its own; what it "
                "leaves is removed by `safeio gc %s`",
                who(),
                deleting.name,
                self.options.timeout,
                self.root_url,
            )
