"""``safeio.Checkpoints``: a whole checkpoint (sharded and replicated files) staged, committed once.

Every rank enters ``save(step)``: the writer makes one stage beside the step's final name and tells the
others its name through the store; every rank writes its part there (``dcp.save`` shards; replicated
files through safeio's saves, which write once — the writer's — straight into the stage, the other
ranks' into scratch). On leaving, every rank reports its part; the writer waits for all reports, bounded,
then writes the manifest of every file (the commit marker), fsyncs, renames the stage to the final name,
points ``latest`` at the newest committed step, applies retention, and publishes the outcome. Every rank
returns once the step is visible from it, or raises `CheckpointError` naming the ranks that failed or
never reported; then nothing is committed and ``latest`` is unchanged.

``latest()``/``steps()`` are resolved by the writer and published, so ranks whose NFS caches disagree
still get one answer, each returning once that step is visible from it.

Where the steps live is one class per storage behaviour: ``LocalSteps`` (POSIX: a stage directory and a
rename) and ``ObjectSteps`` (object stores: in place under the step's prefix, committed by its marker).
With ``dcp.async_save``, ``ckpt.commit_after(future)`` moves the commit to a background thread that runs
once the future completes (see ``PendingCommit``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from safeio._checkpoints.exchange import Exchange, StoreGone
from safeio._checkpoints.local_steps import LocalSteps
from safeio._checkpoints.naming import StepNames, check_step
from safeio._checkpoints.object_steps import ObjectSteps
from safeio._checkpoints.pending import PendingCommit
from safeio._checkpoints.steps import LATEST, MEGATRON_TRACKER, StepStorage
from safeio._coordination.group import Group, resolve_group
from safeio._errors import CheckpointError, InvalidOptionError, PeerTimeout
from safeio._options import SaveOptions
from safeio._promotion import active
from safeio._storage.location import resolve

__all__ = ["LATEST", "MEGATRON_TRACKER", "Checkpoint", "CheckpointStage", "Checkpoints"]


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: its step and the directory (or object-store prefix) to load it from."""

    step: int
    path: str


class CheckpointStage:
    """What ``with ckpts.save(step) as ckpt`` gives every rank: the shared stage to write into."""

    def __init__(self, save: CheckpointSave, path: str, is_writer: bool) -> None:
        self._save = save
        self.step = save.step
        self.path = path
        self.is_writer = is_writer

    def commit_after(self, future: Any) -> None:
        """Commit when ``future`` completes, not when the ``with`` block ends: for ``dcp.async_save``
        (its ``Future`` or ``AsyncSaveResponse``). Every rank calls it. The commit runs on a background
        thread once this rank's future is done; ``latest`` and retention move only then. The next
        ``save``, ``latest()`` or ``steps()`` first waits for it, and raises if it failed; call
        ``ckpts.wait()`` before the job ends."""
        self._save.future = future


class Checkpoints:
    """Whole checkpoints under ``root``: ``save(step)``, ``latest()`` and ``steps()`` are collective
    (every rank of ``group`` calls them, in the same order)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep: int | None = 3,
        name: str = "step_{step}",
        group: Any = None,
        timeout: float | None = None,
        durable: bool = True,
        megatron_tracker: bool = False,
    ) -> None:
        location = resolve(root)
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise InvalidOptionError(f"keep must be a number of checkpoints >= 1 or None, got {keep!r}", root)
        names = StepNames(name, location.url())
        self.options = SaveOptions.of(timeout=timeout, durable=durable)
        self.storage: StepStorage
        if location.is_local:
            self.storage = LocalSteps(location.path, names, self.options, keep, megatron_tracker)
        else:
            self.storage = ObjectSteps(location, names, self.options, keep, megatron_tracker)
        self.root = self.storage.root_url
        self.keep = keep
        self.names = names
        self._group_arg = group
        self._pending: PendingCommit | None = None

    def group(self) -> Group:
        return resolve_group(self._group_arg)

    def save(self, step: int) -> CheckpointSave:
        return CheckpointSave(self, check_step(step, self.root))

    def wait(self) -> None:
        """Wait for the commit of an async save (``ckpt.commit_after``); raise if it failed. Every rank
        calls it before the job ends (``save``, ``latest()`` and ``steps()`` call it first)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    # -- finding checkpoints -------------------------------------------------------------------------

    def committed(self) -> list[tuple[int, str]]:
        """(step, name) of every committed checkpoint, as this process sees the root (ascending)."""
        return self.storage.committed()

    def latest(self) -> Checkpoint | None:
        """The newest committed checkpoint, the same on every rank, visible from each when it returns."""
        self.wait()
        committed = self._agree("latest()", lambda: self.committed()[-1:])
        if not committed:
            return None
        step, entry = committed[0]
        return Checkpoint(step, self.storage.url(entry))

    def steps(self) -> list[int]:
        """Every committed step, ascending, the same on every rank."""
        self.wait()
        return [step for step, _ in self._agree("steps()", self.committed)]

    def _agree(self, what: str, resolve_here: Any) -> list[tuple[int, str]]:
        group = self.group()
        exchange = Exchange(group, self.root, what)
        deadline = time.monotonic() + self.options.timeout
        if group.is_writer:
            found = [(int(s), str(n)) for s, n in resolve_here()]
            exchange.decide({"ok": True, "found": found})
        elif exchange.shared:
            try:
                heard = exchange.hear_outcome(deadline).get("found", [])
            except StoreGone:
                # Rank 0, the store's host, answered and finished (the end of a run): the filesystem
                # is all that is left to ask.
                heard = resolve_here()
            found = [(int(s), str(n)) for s, n in heard]
        else:
            found = [(int(s), str(n)) for s, n in resolve_here()]
        for _, entry in found:
            self.storage.wait_committed(entry, deadline, group.rank, what)
        return found


class CheckpointSave:
    """``with ckpts.save(step) as ckpt``: see the module's docstring."""

    def __init__(self, checkpoints: Checkpoints, step: int) -> None:
        self.ckpts = checkpoints
        self.storage = checkpoints.storage
        self.step = step
        self.final_name = checkpoints.names.format(step)
        self.final = self.storage.url(self.final_name)
        self.stage_name = ""
        self.future: Any = None  # set by CheckpointStage.commit_after
        self._scratch: str | None = None
        self._entry: active.ActiveStage | None = None

    @property
    def timeout(self) -> float:
        return self.ckpts.options.timeout

    def __enter__(self) -> CheckpointStage:
        self.ckpts.wait()  # the previous async save's commit comes first
        group = self.group = self.ckpts.group()
        exchange = self.exchange = Exchange(group, self.ckpts.root, f"save of step {self.step}")
        deadline = time.monotonic() + self.timeout
        if group.is_writer:
            try:
                self.stage_name = self.storage.open_stage(self.step, self.final_name)
            except BaseException as exc:
                exchange.announce({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                raise
            exchange.announce({"ok": True, "stage": self.stage_name})
        else:
            heard = exchange.hear_announcement(deadline)
            if not (isinstance(heard, dict) and heard.get("ok") and isinstance(heard.get("stage"), str)):
                error = heard.get("error") if isinstance(heard, dict) else "no stage"
                raise CheckpointError(
                    f"rank {group.rank}: rank {group.writer} could not open the stage of step {self.step} "
                    f"under {self.ckpts.root}: {error}",
                    self.final,
                    failed={group.writer: str(error)},
                )
            self.stage_name = heard["stage"]
            try:
                what = f"the stage of step {self.step}"
                self.storage.wait_stage(self.stage_name, deadline, group.rank, what)
            except PeerTimeout:
                decided = exchange.outcome_if_decided()  # the writer failed and removed it already?
                if decided is None or decided.get("ok"):
                    raise
                raise _failure(decided, group.rank, self.step, self.final) from None
        stage = self.storage.url(self.stage_name)
        if not (group.is_writer and self.storage.in_place_replicated):
            self._scratch = tempfile.mkdtemp(prefix="safeio-ckpt-")
        # Replicated saves made inside the body (save_pretrained, torch_save) write once: the writer's
        # into the stage (on object stores: into scratch, uploaded at the commit), the other ranks' into
        # scratch. Sharded writers (dcp.save) write the stage.
        self._entry = active.ActiveStage(self.final, stage, replicated=self._scratch or stage)
        active.push(self._entry)
        return CheckpointStage(self, stage, group.is_writer)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._entry is not None, "__exit__ without __enter__"
        active.pop(self._entry)
        if exc is None and self.future is not None:
            self.exchange.group = self.group = self.group.for_another_thread()
            self.ckpts._pending = PendingCommit(
                self.future, self._finish, self.timeout, f"step {self.step} of {self.ckpts.root}"
            )
            return
        self._finish(exc)

    def _finish(self, exc: BaseException | None) -> None:
        """Report this rank's part; the writer commits (or abandons); every rank hears the outcome."""
        try:
            if self.group.is_writer:
                self._exit_writer(exc)
            else:
                self._exit_peer(exc)
        finally:
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)

    # -- the other ranks -----------------------------------------------------------------------------

    def _exit_peer(self, exc: BaseException | None) -> None:
        error = None if exc is None else f"{type(exc).__name__}: {exc}"
        self.exchange.report({"ok": exc is None, "error": error})
        if exc is not None:
            return  # this rank's own error propagates; the writer names it to the others
        # The writer may itself wait up to the timeout for the slowest rank's report before it decides.
        deadline = time.monotonic() + 2 * self.timeout
        rank, what = self.group.rank, f"step {self.step}"
        try:
            outcome = self.exchange.hear_outcome(deadline)
        except StoreGone as gone:
            # The writer decided and its process (the store's host) finished: a committed step on disk
            # is the outcome; none means it failed (its failure left nothing to find).
            try:
                self.storage.wait_committed(self.final_name, deadline, rank, what)
            except PeerTimeout:
                raise gone from None
            return
        if not outcome.get("ok"):
            raise _failure(outcome, rank, self.step, self.final)
        self.storage.wait_committed(self.final_name, deadline, rank, what)

    # -- the writer ----------------------------------------------------------------------------------

    def _exit_writer(self, exc: BaseException | None) -> None:
        rank = self.group.rank
        failed: dict[int, str]
        missing: list[int]
        if exc is not None:
            failed, missing = {rank: f"{type(exc).__name__}: {exc}"}, []
        else:
            failed, missing = self.exchange.collect(time.monotonic() + self.timeout)
        if failed or missing:
            self.storage.abandon(self.stage_name)
            outcome = {"ok": False, "failed": {str(r): e for r, e in failed.items()}, "missing": missing}
            self.exchange.decide(outcome)
            if exc is not None:
                return  # the writer's own error propagates
            raise _failure(outcome, rank, self.step, self.final)
        try:
            self.storage.commit(self.stage_name, self.final_name, self.step, rank, self._scratch)
        except BaseException as commit_error:
            self.storage.abandon(self.stage_name)
            self.exchange.decide(
                {"ok": False, "failed": {str(rank): f"{type(commit_error).__name__}: {commit_error}"}}
            )
            raise
        self.exchange.decide({"ok": True, "path": self.final})


def _failure(outcome: dict[str, Any], rank: int, step: int, final: str) -> CheckpointError:
    failed = {int(r): str(e) for r, e in (outcome.get("failed") or {}).items()}
    missing = [int(r) for r in outcome.get("missing") or []]
    parts = [f"rank {r}: {e}" for r, e in sorted(failed.items())]
    parts.extend(f"rank {r} never reported (died, or still in its body)" for r in missing)
    return CheckpointError(
        f"rank {rank}: step {step} was not committed ({'; '.join(parts) or 'failed'}); nothing was "
        f"committed at {final} and latest is unchanged",
        final,
        failed=failed,
        missing=missing,
    )
