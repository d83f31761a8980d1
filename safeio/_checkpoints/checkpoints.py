"""``safeio.Checkpoints``: a whole checkpoint (sharded and replicated files) staged, committed once.

Every rank enters ``save(step)``: the writer makes one stage beside the step's final name and tells the
others its name through the store; every rank writes its part there (``dcp.save`` shards; replicated
files through safeio's saves, which the writer alone makes, straight into the stage, while the other ranks
skip them and get the writer's result). On leaving, every rank reports its part; the writer waits for all
reports, bounded; when durable, every rank syncs a share of the stage's files at once (``FsyncShares``);
the writer writes the manifest of every file (the commit marker), fsyncs it and the directories, renames
the stage to the final name (replacing an earlier commit of the step), points ``latest`` at the newest
committed step (unless ``pointer=False``), applies retention, and publishes the outcome. Every rank
returns once the step is visible from it, or raises `CheckpointError` naming the ranks that failed or
never reported; then nothing is committed and ``latest`` is unchanged.

``latest()``/``steps()`` are resolved by the writer and published, so ranks whose NFS caches disagree
still get one answer, each returning once that step is visible from it.

Where the steps live is the root's back end's business (``safeio._promotion.backends``): its step storage
makes the commit, a promotion through the same flow as any directory save (``LocalSteps``: a stage
directory and a rename; ``ObjectSteps``: in place under the step's prefix, committed by its marker).
With ``dcp.async_save``, ``ckpt.commit_after(future)`` moves the commit to a background thread that runs
once the future completes (see ``PendingCommit``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from safeio._checkpoints.pending import PendingCommit, check_future, wait_for_future
from safeio._checkpoints.steps import (
    ExistingDirectory,
    StepNames,
    StepPromotion,
    check_step,
)
from safeio._checkpoints.storage import steps_for
from safeio._coordination.calls import MalformedValue, Progress, StoreGone, poll_until
from safeio._coordination.checkpoint_call import CheckpointCall, text
from safeio._coordination.checkpoint_shares import (
    FsyncShares,
    NestedResults,
    hear_fsync_share,
    report_sync_failed,
    report_synced,
)
from safeio._coordination.checkpoint_status import (
    ASYNC_SAVE,
    BODY,
    COMMIT_PHASES,
    DONE,
    FSYNC,
    OUTCOME,
    REPORT,
    RESOLVE,
    STAGE,
    advice,
)
from safeio._coordination.group import Group, resolve_group
from safeio._diagnostics.watchdog import Watchdog
from safeio._errors import (
    CheckpointError,
    CollectiveMismatch,
    InvalidOptionError,
    InvalidTargetError,
    InvalidTypeError,
    PeerTimeout,
    RemoteWriterError,
)
from safeio._options import SaveOptions, flag
from safeio._promotion import active
from safeio._promotion.backends import backend_for
from safeio._stalls import Cadence, seconds
from safeio._storage.dirfd import fsync_files, held_directory, is_relative_name
from safeio._storage.fsops import discard_tree
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


class CheckpointStage:
    """What ``with ckpts.save(step) as ckpt`` gives every rank: the shared stage to write into."""

    def __init__(self, save: CheckpointSave, path: str, is_writer: bool) -> None:
        self._save = save
        self.step = save.step
        self.path = path
        self.is_writer = is_writer

    @property
    def warnings(self) -> list[str]:
        """After the commit, on every rank: what failed after the commit point without undoing it (the
        ``latest`` pointer, retention), each with its repair. Empty when all went well."""
        return list(self._save.warnings)

    def retire(self, *names: str) -> None:
        """A framework with a retention of its own (the Trainer's ``save_total_limit`` rotation) decided
        that these committed steps (directory names or paths) go: they are retired after this step is
        committed, as ``keep`` retires steps (renamed aside under the root's lock, deleted after it), never
        the step being saved, a protected one, or one this user did not commit. Only the writer's call
        counts (``ckpt.is_writer``), made inside the ``with`` block."""
        self._save.retire_names.update(os.path.basename(os.fspath(n).rstrip("/")) for n in names)

    def commit_after(self, future: Any) -> None:
        """Commit when ``future`` completes, not when the ``with`` block ends: for ``dcp.async_save``
        (its ``Future`` or ``AsyncSaveResponse``). Every rank calls it. The commit runs on a background
        thread once this rank's future is done; ``latest`` and retention move only then. The next
        ``save``, ``latest()`` or ``steps()`` first waits for it, and raises if it failed; call
        ``ckpts.wait()`` before the job ends."""
        self._save.commit_after(future)


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
        lock: bool | str = "auto",
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

        committed = self._agree("latest()", here)
        newest = Checkpoint(committed[0][0], self._steps.url(committed[0][1])) if committed else None
        if unmarked is None:
            return newest
        above = newest.step if newest is not None else -1
        plain = self._agree(
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

        if self._agree(f"at({step})", here):
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

        self._agree(
            f"at({step}) of an unmarked step", judged_here, visible=lambda n: self._steps.reader(n).exists()
        )
        return Checkpoint(step, self._steps.url(name), committed=False)

    def steps(self) -> list[int]:
        """Every committed step of this user, by number (ascending), the same on every rank. The order of
        commits is ``latest()``'s business: after a rollback the newest commit need not be the last."""
        self.wait()
        return [step for step, _ in self._agree("steps()", self.committed)]

    def _agree(
        self,
        what: str,
        resolve_here: Callable[[], list[tuple[int, str]]],
        *,
        visible: Callable[[str], bool] | None = None,
    ) -> list[tuple[int, str]]:
        """The writer resolves, every rank gets its answer (or its error), visible from each (by
        ``visible``; default: committed)."""
        group = self.group()
        phase = RESOLVE if group.is_writer else OUTCOME
        call = CheckpointCall.enter(group, self.root, what, phase=phase, warn_after=self.options.warn_after)
        try:
            return self._answer(call, group, what, resolve_here, visible)
        finally:
            call.status.enter(DONE)

    def _answer(
        self,
        call: CheckpointCall,
        group: Group,
        what: str,
        resolve_here: Callable[[], list[tuple[int, str]]],
        visible: Callable[[str], bool] | None,
    ) -> list[tuple[int, str]]:
        deadline = time.monotonic() + self.options.timeout
        if group.is_writer:
            # Reading the root can hang on a mount that does not answer: the writer says so itself.
            with _watchdog(call, self.options):
                try:
                    found = [(int(s), str(n)) for s, n in resolve_here()]
                except InvalidTargetError as exc:
                    call.decide({"ok": False, "error": str(exc), "path": exc.path})
                    raise
                except BaseException as exc:  # every rank hears that there is no answer
                    call.decide({"ok": False, "error": f"{type(exc).__name__}: {exc}", "path": self.root})
                    raise
            call.decide({"ok": True, "found": found})
        elif call.shared:
            try:
                found = self._heard(call.hear_outcome(deadline), group, what)
            except StoreGone:
                # Rank 0, the store's host, answered and finished (the end of a run): the filesystem
                # is all that is left to ask.
                found = [(int(s), str(n)) for s, n in resolve_here()]
            except MalformedValue as exc:
                raise self._malformed_answer(group, what, str(exc)) from None
        else:
            found = [(int(s), str(n)) for s, n in resolve_here()]
        for _, entry in found:
            self._wait_visible(entry, deadline, group.rank, what, stage=False, visible=visible)
        return found

    def _heard(self, heard: dict[str, Any], group: Group, what: str) -> list[tuple[int, str]]:
        """The writer's answer to ``what``, or the error it answered with."""
        if not heard.get("ok"):
            path = heard.get("path")
            raise InvalidTargetError(text(heard.get("error")), path if isinstance(path, str) else self.root)
        answer = self._heard_steps(heard.get("found"))
        if answer is None:
            raise self._malformed_answer(group, what, f"not a list of committed steps: {text(heard)}")
        return answer

    def _heard_steps(self, found: object) -> list[tuple[int, str]] | None:
        """The writer's answer (input): (step, name) pairs where each name is that step's directory
        name; None when it is not (a name heard is joined to the root: never a path elsewhere)."""
        if not isinstance(found, list) or len(found) > 10**6:
            return None
        steps: list[tuple[int, str]] = []
        for entry in found:
            if not (isinstance(entry, list) and len(entry) == 2):
                return None
            step, name = entry
            if isinstance(step, bool) or not isinstance(step, int) or not isinstance(name, str):
                return None
            if self.names.parse(name) != step:
                return None
            steps.append((step, name))
        return steps

    def _malformed_answer(self, group: Group, what: str, problem: str) -> RemoteWriterError:
        return RemoteWriterError(
            f"rank {group.rank}: the answer of rank {group.writer} to {what} of {self.root} in the store is "
            f"malformed ({problem}); a value in the job's store is input (TCPStore has no authentication)",
            self.root,
            writer_rank=group.writer,
            error_type="MalformedValue",
            error_message=problem,
        )

    def _wait_visible(
        self,
        name: str,
        deadline: float,
        rank: int,
        what: str,
        *,
        stage: bool,
        visible: Callable[[str], bool] | None = None,
    ) -> None:
        """Return once step (or stage) ``name`` is visible from this rank; bounded. NFS clients cache
        directory entries and attributes: a rank on another client may not see it for a while after
        the writer made it."""
        path = self._steps.url(name)
        if visible is None:
            visible = self._steps.stage_visible if stage else self._steps.step_visible
        cadence = Cadence(self.options.warn_after)

        def still_waiting(elapsed: float) -> None:
            logger.warning(
                "%s: still waiting after %s s to see %s at %s from this rank: the writer made it, and a "
                "network filesystem's client cache shows it late (NFS: the mount's attribute and lookup "
                "caches)",
                who(rank),
                seconds(elapsed),
                what,
                path,
            )

        poll_until(
            lambda: visible(name),
            deadline,
            expired=lambda: PeerTimeout(
                f"rank {rank}: {what} at {path} is still not visible from this rank after "
                f"{cadence.elapsed():.0f} s",
                path,
                phase="visibility",
                elapsed=cadence.elapsed(),
            ),
            progress=Progress(cadence, still_waiting),
        )


class CheckpointSave:
    """``with ckpts.save(step) as ckpt``: see the module's docstring."""

    def __init__(
        self,
        checkpoints: Checkpoints,
        step: int,
        protect: list[str],
        existing: ExistingDirectory | None = None,
    ) -> None:
        self.ckpts = checkpoints
        self.step = step
        self.protect = protect
        self.existing = existing or ExistingDirectory()
        self.retire_names: set[str] = set()  # CheckpointStage.retire (the writer's count)
        self.final_name = checkpoints.names.format(step)
        self.final = checkpoints.path_of(self.final_name)
        self.stage_name = ""
        self.warnings: list[str] = []  # what failed after the commit point (see CheckpointStage.warnings)
        self._future: Any = None
        self._promotion: StepPromotion | None = None
        self._stage = ""
        self._scratch: str | None = None
        self._entry: active.ActiveStage | None = None
        self._results: NestedResults | None = None
        self._syncs = False  # whether the ranks share out the commit's fsyncs (FsyncShares)
        self._watchdog: Watchdog | None = None

    @property
    def timeout(self) -> float:
        return self.ckpts.options.timeout

    def commit_after(self, future: Any) -> None:
        check_future(future)
        self._future = future

    def __enter__(self) -> CheckpointStage:
        self.ckpts.wait()  # the previous async save's commit comes first
        steps = self.ckpts._steps
        group = self.group = self.ckpts.group()
        call = self.call = CheckpointCall.enter(
            group,
            self.ckpts.root,
            f"save of step {self.step}",
            phase=STAGE,
            step=self.step,
            warn_after=self.ckpts.options.warn_after,
        )
        # Every rank watches itself from here to its outcome: any rank may be the one stuck (in its
        # body, in a filesystem call), and it is the one that can tell where (its stack).
        self._watchdog = _watchdog(call, self.ckpts.options).start()
        try:
            self._open(call, group)
        except BaseException:
            self._stop_watching()
            raise
        stage = steps.url(self.stage_name)
        if not (group.is_writer and steps.in_place_replicated):
            self._scratch = tempfile.mkdtemp(prefix="safeio-ckpt-")
        # Replicated saves made inside the body (save_pretrained, torch_save) are made by the writer alone,
        # into the stage (on object stores: into scratch, uploaded at the commit); the other ranks skip
        # them and get the writer's result (NestedResults). Their scratch holds only what a model's
        # save_pretrained writes there (every rank calls it: its state may be gathered collectively).
        # Sharded writers (dcp.save) write the stage.
        self._results = NestedResults(call, self.timeout)
        self._entry = active.ActiveStage(
            self.final, stage, replicated=self._scratch or stage, results=self._results
        )
        active.push(self._entry)
        call.status.enter(BODY)
        return CheckpointStage(self, stage, group.is_writer)

    def _open(self, call: CheckpointCall, group: Group) -> None:
        """The writer opens the stage and announces it; every other rank hears it and sees it."""
        deadline = time.monotonic() + self.timeout
        if group.is_writer:
            try:
                self._promotion = self.ckpts._steps.promotion(
                    self.step,
                    rank=group.rank,
                    protect=self.protect,
                    existing=self.existing,
                    on_phase=lambda phase: self.call.status.enter(COMMIT_PHASES.get(phase, phase)),
                )
                self._stage = self._promotion.open_stage()
                self.stage_name = self._promotion.stage_name
            except BaseException as exc:
                call.announce({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                raise
            # Whether every rank syncs a share of the stage's files before the commit (durable, POSIX).
            self._syncs = self._promotion.shares_fsyncs and call.shared
            call.announce({"ok": True, "stage": self.stage_name, "sync": self._syncs})
            return
        try:
            self._join_stage(call, deadline)
        except (CollectiveMismatch, StoreGone):
            raise  # every rank of the call hears it already; or the writer's process (the store) is gone
        except PeerTimeout as waited:
            raise self._gave_up(waited) from None
        except BaseException as exc:
            # Told at once, the writer fails the step naming this rank, rather than waiting for a
            # report until its timeout (a malformed announcement killed rank 1 and left the writer
            # waiting, issue 34).
            call.report({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            raise

    def _join_stage(self, call: CheckpointCall, deadline: float) -> None:
        """A rank other than the writer: the stage the writer announced, checked, once visible here."""
        group, steps = self.group, self.ckpts._steps
        try:
            heard = call.hear_announcement(deadline)
        except MalformedValue as exc:
            raise CheckpointError(
                f"rank {group.rank}: the announcement of rank {group.writer} for step {self.step} under "
                f"{self.ckpts.root} in the store is malformed ({exc}); step {self.step} is not committed "
                f"(this rank tells rank {group.writer}, which abandons it)",
                self.final,
                failed={group.writer: "a malformed announcement"},
            ) from None
        if not (isinstance(heard, dict) and heard.get("ok") is True and isinstance(heard.get("stage"), str)):
            error = text(heard.get("error")) if isinstance(heard, dict) else f"no stage: {text(heard)}"
            raise CheckpointError(
                f"rank {group.rank}: rank {group.writer} could not open the stage of step {self.step} "
                f"under {self.ckpts.root}: {error}",
                self.final,
                failed={group.writer: error},
            )
        self.stage_name = heard["stage"]
        self._syncs = heard.get("sync") is True
        if not steps.is_stage_of(self.stage_name, self.step):
            # Joined to the root, an absolute or dotted name would send this rank's shards elsewhere.
            raise CheckpointError(
                f"rank {group.rank}: the stage name heard from rank {group.writer} for step {self.step} "
                f"under {self.ckpts.root} is not one safeio gives: {text(self.stage_name)}",
                self.final,
                failed={group.writer: "an invalid stage name"},
            )
        try:
            what = f"the stage of step {self.step}"
            self.ckpts._wait_visible(self.stage_name, deadline, group.rank, what, stage=True)
        except PeerTimeout:
            decided = call.outcome_if_decided()  # the writer failed and removed it already?
            if decided is None or decided.get("ok"):
                raise
            raise _failure(decided, group.rank, self.step, self.final) from None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._entry is not None, "__exit__ without __enter__"
        active.pop(self._entry)
        if exc is None and self._future is not None:
            # Training goes on; the commit's thread watches itself from now on (its stack is the one told).
            self.call.status.enter(ASYNC_SAVE)
            if self._watchdog is not None:
                self._watchdog.stop()
            future = self._future
            self.ckpts._commit_later(
                PendingCommit(
                    lambda: self._commit_elsewhere(future),
                    self.timeout,
                    f"step {self.step} of {self.ckpts.root}",
                    status=self.call.status,
                    warn_after=self.ckpts.options.warn_after,
                )
            )
            return
        try:
            self._finish(exc)
        finally:
            self._stop_watching()

    def _stop_watching(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
        self.call.status.enter(DONE)

    def _commit_elsewhere(self, future: Any) -> None:
        """The async commit's thread: wait for this rank's part (the future), then ``_finish``, through a
        connection to the store of its own. Made there, not on the training thread: a TCPStore client's
        clone is a new connection, 2-24 ms here, on every rank, which training would otherwise wait for
        at every async save. Watched from the start: its stack is the one a stall shows."""
        self._watchdog = _watchdog(self.call, self.ckpts.options).start()
        try:
            own: BaseException | None = None
            try:
                wait_for_future(future, self.timeout, f"step {self.step} of {self.ckpts.root}")
            except BaseException as exc:  # this rank's part failed: reported, so every rank hears of it
                own = exc
            self.group = self.group.for_another_thread()
            self.call = self.call.on_group(self.group)
            self._finish(own)
            if own is not None:
                raise own
        finally:
            self._stop_watching()

    def _finish(self, exc: BaseException | None) -> None:
        """Report this rank's part; the writer commits (or abandons); every rank hears the outcome."""
        try:
            if self.group.is_writer:
                self._exit_writer(exc)
            else:
                self._exit_peer(exc)
        finally:
            if self._scratch is not None:
                discard_tree(self._scratch)

    # -- the other ranks -----------------------------------------------------------------------------

    def _exit_peer(self, exc: BaseException | None) -> None:
        error = None if exc is None else f"{type(exc).__name__}: {exc}"
        self.call.report({"ok": exc is None, "error": error})
        if exc is not None:
            return  # this rank's own error propagates; the writer names it to the others
        # The writer may itself wait up to the timeout for the slowest rank's report before it decides.
        deadline = time.monotonic() + 2 * self.timeout
        rank, what = self.group.rank, f"step {self.step}"
        status = self.call.status
        try:
            if self._syncs:
                status.enter(FSYNC)
                self._sync_share(deadline)
            status.enter(OUTCOME)
            outcome = self.call.hear_outcome(deadline)
        except StoreGone as gone:
            # The writer decided and its process (the store's host) finished: a committed step on disk
            # is the outcome; none means it failed (its failure left nothing to find).
            try:
                self.ckpts._wait_visible(self.final_name, deadline, rank, what, stage=False)
            except PeerTimeout:
                raise gone from None
            return
        except MalformedValue as malformed:
            raise self._malformed(f"its outcome ({malformed})") from None
        except PeerTimeout as waited:
            raise self._gave_up(waited) from None
        problem = _outcome_problem(outcome)
        if problem is not None:
            raise self._malformed(f"its outcome ({problem})")
        if not outcome.get("ok"):
            raise _failure(outcome, rank, self.step, self.final)
        self._note_warnings(outcome.get("warnings"))
        self.ckpts._wait_visible(self.final_name, deadline, rank, what, stage=False)

    def _gave_up(self, waited: PeerTimeout) -> PeerTimeout:
        """This rank waited its whole timeout in this save: what it may assume, agreed with the writer
        through the call's verdict (``CheckpointCall.give_up``), said in its error and ``.outcome``."""
        writer, step = self.group.writer, self.step
        phase = f", in {waited.phase}" if waited.phase else ""
        elapsed = f" {waited.elapsed:.0f} s" if waited.elapsed is not None else ""
        outcome = self.call.give_up(
            f"rank {self.group.rank} waited{elapsed} for rank {waited.waited_for}{phase}"
        )
        if outcome == "not committed":
            said = (
                f"This rank gave up: step {step} is not committed (rank {writer} sees that this rank gave up "
                f"before its commit point and abandons the stage; latest is unchanged)."
            )
        elif outcome == "committing":
            said = (
                f"This rank gave up after rank {writer} had begun the commit of step {step} (its rename): "
                f"whether the step is committed is rank {writer}'s outcome; latest() tells."
            )
            outcome = "unknown"
        else:
            said = f"This rank gave up; whether step {step} is committed is unknown here: latest() tells."
        return PeerTimeout(
            f"{waited} {said}",
            waited.path,
            waited_for=waited.waited_for,
            phase=waited.phase,
            step=step,
            elapsed=waited.elapsed,
            outcome=outcome,
        )

    def _malformed(self, what: str) -> CheckpointError:
        """A value the writer sets is malformed: this rank cannot know the outcome from it."""
        writer = self.group.writer
        return CheckpointError(
            f"rank {self.group.rank}: {what} heard from rank {writer} in the store for step {self.step} "
            f"is malformed; this rank does not know whether step {self.step} was committed: latest() "
            "decides (a value in the job's store is input: TCPStore has no authentication)",
            self.final,
            failed={writer: f"malformed {what}"},
        )

    def _sync_share(self, deadline: float) -> None:
        """This rank's share of the commit's fsyncs (see FsyncShares), at the same time as every other
        rank's; the files it cannot sync are named back, and the writer syncs them."""
        try:
            share = hear_fsync_share(self.call, deadline)
        except MalformedValue as exc:
            # The writer fails the commit naming this rank at once, rather than waiting for its answer;
            # the call's verdict tells this rank whether the writer may still commit.
            report_sync_failed(self.call, f"the fsync shares it heard are malformed ({exc})")
            if self.call.give_up(f"rank {self.group.rank} heard malformed fsync shares") == "not committed":
                raise CheckpointError(
                    f"rank {self.group.rank}: the fsync shares heard from rank {self.group.writer} in the "
                    f"store for step {self.step} are malformed ({exc}); step {self.step} is not committed "
                    f"(this rank told rank {self.group.writer}, which abandons it)",
                    self.final,
                    failed={self.group.writer: "malformed fsync shares"},
                ) from None
            raise self._malformed(f"its fsync shares ({exc})") from None
        if share is None:
            return  # the writer decided first: nothing will be committed
        left = [rel for rel in share if not is_relative_name(rel)]  # input: never a path out of the stage
        wanted = [rel for rel in share if is_relative_name(rel)]
        try:
            with held_directory(self.ckpts._steps.url(self.stage_name)) as stage_fd:
                left += fsync_files(stage_fd, wanted)
        except OSError:
            left = share  # the stage cannot be opened from here (yet): the writer syncs them
        report_synced(self.call, left)

    def _note_warnings(self, warnings: object) -> None:
        if not isinstance(warnings, list):
            return
        self.warnings = [text(w) for w in warnings[:100]]
        for warning in self.warnings:
            logger.warning("%s: %s", who(self.group.rank), warning)

    # -- the writer ----------------------------------------------------------------------------------

    def _exit_writer(self, exc: BaseException | None) -> None:
        """Collect, commit, decide. Whatever raises before the decision (a rank's malformed value, a
        failed commit, an interrupt), the stage is abandoned and every rank is told: no rank waits for an
        outcome that will never come."""
        promotion = self._promotion
        assert promotion is not None, "the writer opened the stage"
        rank = self.group.rank
        if exc is not None:
            self._not_committed({rank: f"{type(exc).__name__}: {exc}"}, [])
            return  # the writer's own error propagates
        try:
            self.call.status.enter(REPORT)
            failed, missing = self.call.collect(time.monotonic() + self.timeout)
            if not (failed or missing):
                self.call.check_gave_up()  # before the commit's work: a rank that gave up is told "not"
                # The stage the writer's replicated files are in: the shared one, or scratch (uploaded).
                shares = FsyncShares(self.call, self.timeout) if self._syncs else None
                promotion.retire_also.update(self.retire_names)
                promoted = promotion.finish_step(
                    self._scratch or self._stage, shares, commit_point=self.call.commit_point
                )
        except CollectiveMismatch:
            _abandon(promotion)  # every rank of the call has heard it from the rank that found it
            raise
        except CheckpointError as ranks_failed:
            if not (ranks_failed.failed or ranks_failed.missing):
                self._not_committed({rank: f"{type(ranks_failed).__name__}: {ranks_failed}"}, [])
                raise
            failed, missing = ranks_failed.failed, ranks_failed.missing  # a rank's share failed the commit
        except BaseException as commit_error:
            self._not_committed({rank: f"{type(commit_error).__name__}: {commit_error}"}, [])
            raise
        if failed or missing:
            raise _failure(self._not_committed(failed, missing), rank, self.step, self.final)
        # Committed: what failed after the commit point is a warning every rank hears, never a failure.
        self.call.decide({"ok": True, "path": self.final, "warnings": list(promoted.warnings)})
        self._note_warnings(list(promoted.warnings))

    def _not_committed(self, failed: dict[int, str], missing: list[int]) -> dict[str, Any]:
        """The writer: the stage goes and every rank hears that nothing was committed, and why."""
        assert self._promotion is not None
        _abandon(self._promotion)
        outcome: dict[str, Any] = {
            "ok": False,
            "failed": {str(r): e for r, e in failed.items()},
            "missing": missing,
            # Where each missing rank was last reported: "never reported" alone says nothing of why.
            "where": {str(r): self.call.whereabouts(r) for r in missing[:16]},
        }
        self.call.decide(outcome)
        return outcome


def _watchdog(call: CheckpointCall, options: SaveOptions) -> Watchdog:
    """The watchdog of this rank in ``call``, for the thread that starts it."""
    return Watchdog(call.status, options.warn_after, rank=call.group.rank, role="this rank", advice=advice)


def _check_keep(keep: object, root: str | os.PathLike[str]) -> None:
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise InvalidOptionError(
            f"keep must be a number of checkpoints >= 1 or None, got {keep!r} (Checkpoints of {root})", root
        )


def _abandon(promotion: StepPromotion) -> None:
    """Nothing is committed: the stage goes, best effort (the previous checkpoints and ``latest`` stay;
    what is left is the next save's recovery or ``safeio gc``'s)."""
    with contextlib.suppress(OSError):
        promotion.discard("")


def _outcome_problem(outcome: dict[str, Any]) -> str | None:
    """What is wrong with a save's outcome heard from the store (input), or None."""
    failed, missing, warnings = (
        outcome.get("failed", {}),
        outcome.get("missing", []),
        outcome.get("warnings", []),
    )
    if not (isinstance(failed, dict) and all(r.isdigit() and isinstance(e, str) for r, e in failed.items())):
        return f"failed is not a map of ranks to errors: {text(failed)}"
    if not (isinstance(missing, list) and all(_is_rank(r) for r in missing)):
        return f"missing is not a list of ranks: {text(missing)}"
    if not (isinstance(warnings, list) and all(isinstance(w, str) for w in warnings)):
        return f"warnings is not a list of texts: {text(warnings)}"
    return None


def _is_rank(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31


def _failure(outcome: dict[str, Any], rank: int, step: int, final: str) -> CheckpointError:
    """The error every rank raises for a failed step; ``outcome`` as heard from the store (input)."""
    heard_failed, heard_missing = outcome.get("failed"), outcome.get("missing")
    failed = {
        int(r): text(e)
        for r, e in (heard_failed.items() if isinstance(heard_failed, dict) else ())
        if isinstance(r, str) and r.isdigit() and len(r) < 8
    }
    missing = [r for r in (heard_missing if isinstance(heard_missing, list) else ()) if _is_rank(r)]
    heard_where = outcome.get("where")
    where = heard_where if isinstance(heard_where, dict) else {}
    parts = [f"rank {r}: {e}" for r, e in sorted(failed.items())[:16]]
    for r in missing[:16]:
        last = where.get(str(r))
        parts.append(
            f"rank {r} never reported ({text(last) if isinstance(last, str) else 'died or still busy'})"
        )
    return CheckpointError(
        f"rank {rank}: step {step} was not committed ({'; '.join(parts) or 'failed'}); nothing was "
        f"committed at {final} and latest is unchanged",
        final,
        failed=failed,
        missing=missing,
    )
