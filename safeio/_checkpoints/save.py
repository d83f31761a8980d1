"""``Checkpoints.save``: a whole checkpoint (sharded and replicated files) staged, committed once.

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

This module is the flow and the writer's side (``peer``: every other rank's). Where the steps live is
the root's step storage's business (``storage``, by the root's back end): it makes the commit, a
promotion through the same flow as any directory save (``LocalSteps``: a stage directory and a rename;
``ObjectSteps``: in place under the step's prefix, committed by its marker). With ``dcp.async_save``,
``ckpt.commit_after(future)`` moves the commit to a background thread that runs once the future
completes (see ``PendingCommit``).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

from safeio._checkpoints.outcome import abandon, failure
from safeio._checkpoints.peer import exit_peer, gave_up, join_stage
from safeio._checkpoints.pending import PendingCommit, check_future, wait_for_future
from safeio._checkpoints.steps import ExistingDirectory, StepCommit
from safeio._coordination.calls import StoreGone
from safeio._coordination.checkpoint_call import CheckpointCall
from safeio._coordination.checkpoint_shares import FsyncShares, NestedResults
from safeio._coordination.checkpoint_status import (
    ASYNC_SAVE,
    BODY,
    DONE,
    REPORT,
    STAGE,
    advice,
)
from safeio._coordination.group import Group
from safeio._diagnostics.watchdog import Watchdog
from safeio._errors import CheckpointError, CollectiveMismatch, PeerTimeout
from safeio._options import SaveOptions
from safeio._promotion import active
from safeio._storage.fsops import discard_tree
from safeio._who import who

if TYPE_CHECKING:
    from safeio._checkpoints.checkpoints import Checkpoints

logger = logging.getLogger("safeio")


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
        self._commit: StepCommit | None = None
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
        self._watchdog = watchdog_for(call, self.ckpts.options).start()
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
                self._commit = self.ckpts._steps.promotion(
                    self.step,
                    rank=group.rank,
                    protect=self.protect,
                    existing=self.existing,
                    on_phase=call.status.enter_commit_phase,  # the same status after on_group
                )
                self._stage = self._commit.promotion.open_stage()
                self.stage_name = self._commit.promotion.stage_name
            except BaseException as exc:
                call.announce({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                raise
            # Whether every rank syncs a share of the stage's files before the commit (durable, POSIX).
            self._syncs = self._commit.shares_fsyncs and call.shared
            call.announce({"ok": True, "stage": self.stage_name, "sync": self._syncs})
            return
        try:
            join_stage(self, call, deadline)
        except (CollectiveMismatch, StoreGone):
            raise  # every rank of the call hears it already; or the writer's process (the store) is gone
        except PeerTimeout as waited:
            raise gave_up(self, waited) from None
        except BaseException as exc:
            # Told at once, the writer fails the step naming this rank, rather than waiting for a
            # report until its timeout (a malformed announcement killed rank 1 and left the writer
            # waiting, issue 34).
            call.report({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            raise

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
        self._watchdog = watchdog_for(self.call, self.ckpts.options).start()
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
                exit_peer(self, exc)
        finally:
            if self._scratch is not None:
                discard_tree(self._scratch)

    # -- the writer ----------------------------------------------------------------------------------

    def _exit_writer(self, exc: BaseException | None) -> None:
        """Collect, commit, decide. Whatever raises before the decision (a rank's malformed value, a
        failed commit, an interrupt), the stage is abandoned and every rank is told: no rank waits for an
        outcome that will never come."""
        commit = self._commit
        assert commit is not None, "the writer opened the stage"
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
                root = commit.root
                root.fsyncs = FsyncShares(self.call, self.timeout) if self._syncs else None
                root.commit_point = self.call.commit_point  # it may raise: nothing is committed
                root.retire_also.update(self.retire_names)
                if commit.adopt is not None:
                    commit.adopt()
                commit.promotion.finish(self._scratch or self._stage)
        except CollectiveMismatch:
            abandon(commit)  # every rank of the call has heard it from the rank that found it
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
            raise failure(self._not_committed(failed, missing), rank, self.step, self.final)
        # Committed: what failed after the commit point is a warning every rank hears, never a failure.
        warnings = commit.root.warnings
        self.call.decide({"ok": True, "path": self.final, "warnings": list(warnings)})
        self.warnings = list(warnings)  # its own: no need to check them as heard ones are
        for warning in self.warnings:
            logger.warning("%s: %s", who(rank), warning)

    def _not_committed(self, failed: dict[int, str], missing: list[int]) -> dict[str, Any]:
        """The writer: the stage goes and every rank hears that nothing was committed, and why."""
        assert self._commit is not None
        abandon(self._commit)
        outcome: dict[str, Any] = {
            "ok": False,
            "failed": {str(r): e for r, e in failed.items()},
            "missing": missing,
            # Where each missing rank was last reported: "never reported" alone says nothing of why.
            "where": {str(r): self.call.whereabouts(r) for r in missing[:16]},
        }
        self.call.decide(outcome)
        return outcome


def watchdog_for(call: CheckpointCall, options: SaveOptions) -> Watchdog:
    """The watchdog of this rank in ``call``, for the thread that starts it."""
    return Watchdog(call.status, options.warn_after, rank=call.group.rank, role="this rank", advice=advice)
