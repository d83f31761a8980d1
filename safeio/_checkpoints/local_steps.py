"""Checkpoints on a POSIX filesystem (local disk, NFS): a stage directory beside the step, one rename.

The writer makes ``.step_N.safeio-stage-<owner>`` beside the step's final name; every rank writes its
part there. The commit writes the manifest of every file (the marker), fsyncs as configured, renames the
stage to ``step_N`` under the root's lock, points ``latest`` at the newest committed step and applies
retention. Stages of crashed saves are removed by the next save (or ``safeio gc``), never one whose owner
may be alive.
"""

from __future__ import annotations

import os

from safeio._boundary import os_failure
from safeio._checkpoints.committed import is_committed, wait_visible
from safeio._checkpoints.naming import StepNames
from safeio._checkpoints.pointer import write_pointer
from safeio._checkpoints.steps import LATEST, MEGATRON_TRACKER, StepStorage
from safeio._errors import InvalidTargetError, TargetExistsError
from safeio._options import SaveOptions
from safeio._promotion.leftovers import recover_directory
from safeio._storage import claims, manifest
from safeio._storage.claims import claimed
from safeio._storage.dirfd import fsync_fd_tree, held_directory, lstat_at, open_directory
from safeio._storage.fsops import remove_at
from safeio._storage.locking import held, lock_path_for, make_lock
from safeio._storage.names import sibling_name

_LOCK_NAME = "checkpoints"  # one promotion lock per root: ``.checkpoints.safeio.lock``


class LocalSteps(StepStorage):
    """The steps of a checkpoint root on a POSIX filesystem."""

    in_place_replicated = True  # the writer's replicated files go straight into the shared stage

    def __init__(
        self, root: str, names: StepNames, options: SaveOptions, keep: int | None, megatron_tracker: bool
    ) -> None:
        super().__init__(names, options, keep, megatron_tracker)
        self.root = root
        self.root_url = root

    def url(self, name: str) -> str:
        return os.path.join(self.root, name)

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

    # -- the writer ----------------------------------------------------------------------------------

    def open_stage(self, step: int, final_name: str) -> str:
        root, final = self.root, self.url(final_name)
        try:
            os.makedirs(root, exist_ok=True)
            with held_directory(root, follow=True) as root_fd:
                # What crashed saves left (stages of dead owners, never a live one) goes first.
                recover_directory(root, parent_fd=root_fd, keep_going=True, durable=self.options.durable)
                if lstat_at(root_fd, final_name) is not None:
                    if is_committed(final):
                        raise TargetExistsError(f"step {step} is already committed at {final}", final)
                    raise InvalidTargetError(
                        f"{final} exists and is not a committed checkpoint (safeio never deletes "
                        "what it did not write): move it away, or save another step",
                        final,
                    )
                # Claimed until commit() or abandon(): another thread's save here must not take it for
                # a leftover (see safeio._storage.claims).
                name = claims.claim(sibling_name(final_name, "stage"))
                try:
                    os.mkdir(name, 0o777, dir_fd=root_fd)  # the umask and a setgid root's group apply
                except BaseException:
                    claims.release(name)
                    raise
                return name
        except OSError as exc:
            raise os_failure(f"cannot open the stage of step {step} under {root}", root, exc) from exc

    def commit(self, stage_name: str, final_name: str, step: int, rank: int, replicated: str | None) -> None:
        del replicated  # written into the stage already
        root, final, durable = self.root, self.url(final_name), self.options.durable
        try:
            with held_directory(root, follow=True) as root_fd:
                stage_fd = open_directory(stage_name, dir_fd=root_fd)
                try:
                    entries = manifest.describe_files(stage_fd, hashes=False)
                    record = manifest.build(entries, rank=rank, call=f"checkpoint/{step}")
                    record["step"] = step
                    if durable:  # every rank's files, then the marker that says they are all there
                        fsync_fd_tree(stage_fd)
                    manifest.write(stage_fd, record, durable=durable)
                    if durable:
                        os.fsync(stage_fd)
                finally:
                    os.close(stage_fd)
                lock = make_lock(
                    lock_path_for(root, _LOCK_NAME), "auto", self.options.timeout, self.options.lease_seconds
                )
                with held(lock, root, rank):
                    if lstat_at(root_fd, final_name) is not None:
                        raise TargetExistsError(f"step {step} appeared at {final} meanwhile", final)
                    os.rename(stage_name, final_name, src_dir_fd=root_fd, dst_dir_fd=root_fd)
                    claims.release(stage_name)  # it is the step now; a failure before this abandons it
                    if durable:
                        os.fsync(root_fd)
                    committed = self.committed()
                    # latest first, then retention: a crash in between leaves a pointer to a whole step.
                    self._point_latest(committed[-1] if committed else (step, final_name))
                    self._retain(root_fd, committed)
        except OSError as exc:
            raise os_failure(f"cannot commit step {step} under {root}", root, exc) from exc

    def _point_latest(self, newest: tuple[int, str]) -> None:
        durable = self.options.durable
        write_pointer(os.path.join(self.root, LATEST), newest[1], durable=durable)
        if self.megatron_tracker:
            write_pointer(os.path.join(self.root, MEGATRON_TRACKER), str(newest[0]), durable=durable)

    def _retain(self, root_fd: int, committed: list[tuple[int, str]]) -> None:
        for entry in self.retired(committed):
            # Renamed aside first: a reader never finds a half-deleted checkpoint under its name. As a
            # "tmp" sibling, not an "old" one: recovery restores an old version whose name is missing,
            # and a retired checkpoint killed half deleted must go, never come back as a step.
            with claimed(sibling_name(entry, "tmp")) as aside:
                os.rename(entry, aside, src_dir_fd=root_fd, dst_dir_fd=root_fd)
                remove_at(root_fd, aside, what="retired checkpoint")

    def abandon(self, stage_name: str) -> None:
        """Nothing is committed: the stage goes (the previous checkpoints and ``latest`` stay)."""
        try:
            with held_directory(self.root, follow=True) as root_fd:
                remove_at(root_fd, stage_name, what="abandoned checkpoint stage")
        except OSError:
            pass  # left for `safeio gc`, or for the next save's recovery once released below
        finally:
            claims.release(stage_name)

    # -- every rank ----------------------------------------------------------------------------------

    def wait_stage(self, stage_name: str, deadline: float, rank: int, what: str) -> None:
        wait_visible(self.url(stage_name), deadline, rank, what, manifest_needed=False)

    def wait_committed(self, name: str, deadline: float, rank: int, what: str) -> None:
        wait_visible(self.url(name), deadline, rank, what)
