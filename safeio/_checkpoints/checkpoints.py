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
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from safeio._boundary import os_failure
from safeio._checkpoints.committed import committed_within, is_committed, wait_visible
from safeio._checkpoints.exchange import Exchange, StoreGone
from safeio._checkpoints.naming import StepNames, check_step
from safeio._checkpoints.pointer import write_pointer
from safeio._coordination.group import Group, resolve_group
from safeio._errors import (
    CheckpointError,
    InvalidOptionError,
    InvalidTargetError,
    PeerTimeout,
    TargetExistsError,
)
from safeio._options import SaveOptions
from safeio._promotion import active
from safeio._promotion.leftovers import recover_directory
from safeio._storage import manifest
from safeio._storage.dirfd import fsync_fd_tree, held_directory, lstat_at, open_directory
from safeio._storage.fsops import remove_at
from safeio._storage.location import resolve
from safeio._storage.locking import held, lock_path_for, make_lock
from safeio._storage.names import sibling_name

LATEST = "latest"  # DeepSpeed's pointer file: the name of the newest checkpoint directory
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's: the newest iteration number
_LOCK_NAME = "checkpoints"  # one promotion lock per root: ``.checkpoints.safeio.lock``


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: its step and the directory to load it from."""

    step: int
    path: str


@dataclass(frozen=True)
class CheckpointStage:
    """What ``with ckpts.save(step) as ckpt`` gives every rank: the shared stage to write into."""

    step: int
    path: str
    is_writer: bool


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
        if not location.is_local:
            raise InvalidTargetError(
                f"Checkpoints on object stores is not supported yet: {location.url()} (use a POSIX path)",
                location.url(),
            )
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise InvalidOptionError(f"keep must be a number of checkpoints >= 1 or None, got {keep!r}", root)
        self.root = location.path
        self.keep = keep
        self.names = StepNames(name, self.root)
        self.options = SaveOptions.of(timeout=timeout, durable=durable)
        self.megatron_tracker = megatron_tracker
        self._group_arg = group

    def group(self) -> Group:
        return resolve_group(self._group_arg)

    def save(self, step: int) -> CheckpointSave:
        return CheckpointSave(self, check_step(step, self.root))

    # -- finding checkpoints -------------------------------------------------------------------------

    def committed(self) -> list[tuple[int, str]]:
        """(step, name) of every committed checkpoint, as this process sees the root (ascending)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        found = []
        for entry in names:
            step = self.names.parse(entry)
            if step is not None and is_committed(os.path.join(self.root, entry)):
                found.append((step, entry))
        return sorted(found)

    def latest(self) -> Checkpoint | None:
        """The newest committed checkpoint, the same on every rank, visible from each when it returns."""
        committed = self._agree("latest()", lambda: self.committed()[-1:])
        if not committed:
            return None
        step, entry = committed[0]
        return Checkpoint(step, os.path.join(self.root, entry))

    def steps(self) -> list[int]:
        """Every committed step, ascending, the same on every rank."""
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
            wait_visible(os.path.join(self.root, entry), deadline, group.rank, what)
        return found


class CheckpointSave:
    """``with ckpts.save(step) as ckpt``: see the module's docstring."""

    def __init__(self, checkpoints: Checkpoints, step: int) -> None:
        self.ckpts = checkpoints
        self.step = step
        self.final_name = checkpoints.names.format(step)
        self.final = os.path.join(checkpoints.root, self.final_name)
        self.stage_name = ""
        self._scratch: str | None = None
        self._entry: active.ActiveStage | None = None

    @property
    def timeout(self) -> float:
        return self.ckpts.options.timeout

    def __enter__(self) -> CheckpointStage:
        group = self.group = self.ckpts.group()
        exchange = self.exchange = Exchange(group, self.ckpts.root, f"save of step {self.step}")
        deadline = time.monotonic() + self.timeout
        if group.is_writer:
            try:
                self.stage_name = self._open_stage()
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
        stage = os.path.join(self.ckpts.root, self.stage_name)
        if not group.is_writer:
            try:
                wait_visible(
                    stage, deadline, group.rank, f"the stage of step {self.step}", manifest_needed=False
                )
            except PeerTimeout:
                decided = exchange.outcome_if_decided()  # the writer failed and removed it already?
                if decided is None or decided.get("ok"):
                    raise
                raise _failure(decided, group.rank, self.step, self.final) from None
            self._scratch = tempfile.mkdtemp(prefix="safeio-peer-")
        # Replicated saves made inside the body (save_pretrained, torch_save) write once: the writer's
        # into the stage, the other ranks' into scratch. Sharded writers (dcp.save) write the stage.
        self._entry = active.ActiveStage(self.final, stage, replicated=self._scratch or stage)
        active.push(self._entry)
        return CheckpointStage(self.step, stage, group.is_writer)

    def _open_stage(self) -> str:
        root = self.ckpts.root
        try:
            os.makedirs(root, exist_ok=True)
            with held_directory(root, follow=True) as root_fd:
                # What crashed saves left (stages of dead owners, never a live one) goes first.
                recover_directory(
                    root, parent_fd=root_fd, keep_going=True, durable=self.ckpts.options.durable
                )
                if lstat_at(root_fd, self.final_name) is not None:
                    if is_committed(self.final):
                        raise TargetExistsError(
                            f"step {self.step} is already committed at {self.final}", self.final
                        )
                    raise InvalidTargetError(
                        f"{self.final} exists and is not a committed checkpoint (safeio never deletes "
                        "what it did not write): move it away, or save another step",
                        self.final,
                    )
                name = sibling_name(self.final_name, "stage")
                os.mkdir(name, 0o777, dir_fd=root_fd)  # the umask and a setgid root's group apply
                return name
        except OSError as exc:
            raise os_failure(f"cannot open the stage of step {self.step} under {root}", root, exc) from exc

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._entry is not None, "__exit__ without __enter__"
        active.pop(self._entry)
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
        if self.group.is_writer:
            self._exit_writer(exc)
        else:
            self._exit_peer(exc)

    # -- the other ranks -----------------------------------------------------------------------------

    def _exit_peer(self, exc: BaseException | None) -> None:
        error = None if exc is None else f"{type(exc).__name__}: {exc}"
        self.exchange.report({"ok": exc is None, "error": error})
        if exc is not None:
            return  # this rank's own error propagates; the writer names it to the others
        # The writer may itself wait up to the timeout for the slowest rank's report before it decides.
        deadline = time.monotonic() + 2 * self.timeout
        try:
            outcome = self.exchange.hear_outcome(deadline)
        except StoreGone:
            # The writer decided and its process (the store's host) finished: a committed step on disk
            # is the outcome; none means it failed (its failure left nothing to find).
            if not committed_within(self.final, deadline):
                raise
            outcome = {"ok": True}
        if not outcome.get("ok"):
            raise _failure(outcome, self.group.rank, self.step, self.final)
        wait_visible(self.final, deadline, self.group.rank, f"step {self.step}")

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
            self._abandon()
            outcome = {"ok": False, "failed": {str(r): e for r, e in failed.items()}, "missing": missing}
            self.exchange.decide(outcome)
            if exc is not None:
                return  # the writer's own error propagates
            raise _failure(outcome, rank, self.step, self.final)
        try:
            self._commit()
        except BaseException as commit_error:
            self._abandon()
            self.exchange.decide(
                {"ok": False, "failed": {str(rank): f"{type(commit_error).__name__}: {commit_error}"}}
            )
            raise
        self.exchange.decide({"ok": True, "path": self.final})

    def _abandon(self) -> None:
        """Nothing is committed: the stage goes (the previous checkpoints and ``latest`` stay)."""
        try:
            with held_directory(self.ckpts.root, follow=True) as root_fd:
                remove_at(root_fd, self.stage_name, what="abandoned checkpoint stage")
        except OSError:
            pass  # left for `safeio gc` (its owner, this process, will be gone)

    def _commit(self) -> None:
        ckpts, durable = self.ckpts, self.ckpts.options.durable
        root = ckpts.root
        try:
            with held_directory(root, follow=True) as root_fd:
                stage_fd = open_directory(self.stage_name, dir_fd=root_fd)
                try:
                    entries = manifest.describe_files(stage_fd, hashes=False)
                    record = manifest.build(entries, rank=self.group.rank, call=f"checkpoint/{self.step}")
                    record["step"] = self.step
                    if durable:  # every rank's files, then the marker that says they are all there
                        fsync_fd_tree(stage_fd)
                    manifest.write(stage_fd, record, durable=durable)
                    if durable:
                        os.fsync(stage_fd)
                finally:
                    os.close(stage_fd)
                lock = make_lock(
                    lock_path_for(root, _LOCK_NAME), "auto", self.timeout, ckpts.options.lease_seconds
                )
                with held(lock, root, self.group.rank):
                    if lstat_at(root_fd, self.final_name) is not None:
                        raise TargetExistsError(
                            f"step {self.step} appeared at {self.final} meanwhile", self.final
                        )
                    os.rename(self.stage_name, self.final_name, src_dir_fd=root_fd, dst_dir_fd=root_fd)
                    if durable:
                        os.fsync(root_fd)
                    committed = ckpts.committed()
                    newest = committed[-1][1] if committed else self.final_name
                    # latest first, then retention: a crash in between leaves a pointer to a whole step.
                    write_pointer(os.path.join(root, LATEST), newest, durable=durable)
                    if ckpts.megatron_tracker:
                        write_pointer(
                            os.path.join(root, MEGATRON_TRACKER), str(committed[-1][0]), durable=durable
                        )
                    self._retain(root_fd, committed)
        except OSError as exc:
            raise os_failure(f"cannot commit step {self.step} under {root}", root, exc) from exc

    def _retain(self, root_fd: int, committed: list[tuple[int, str]]) -> None:
        keep = self.ckpts.keep
        if keep is None or len(committed) <= keep:
            return
        for _, entry in committed[:-keep]:  # never the newest: keep >= 1
            # Renamed aside first: a reader never finds a half-deleted checkpoint under its name. As a
            # "tmp" sibling, not an "old" one: recovery restores an old version whose name is missing,
            # and a retired checkpoint killed half deleted must go, never come back as a step.
            aside = sibling_name(entry, "tmp")
            os.rename(entry, aside, src_dir_fd=root_fd, dst_dir_fd=root_fd)
            remove_at(root_fd, aside, what="retired checkpoint")


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
