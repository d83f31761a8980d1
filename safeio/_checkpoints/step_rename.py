"""The commit of one checkpoint step on a POSIX filesystem (local disk, NFS): a stage directory beside the
step, one rename.

The writer makes ``.step_N.safeio-stage-<owner>`` beside the step's final name (``StepRename.open_stage``,
the same stage any directory save makes); every rank writes its part there. The commit is that
promotion's ``finish``: the stage is checked to be the directory the writer made, its modes settled, and
under the root's lock (the ``lock`` option: a flock on the root directory itself locally, a lease marker
``.checkpoints.safeio.lock`` on a network filesystem) the root gives the next sequence number, the
manifest of every file is written last with the step and the sequence in it (the marker), fsynced as
configured, and the stage renamed to ``step_N`` — exchanged with what stands there when the step is
committed already, or renamed aside where exchange is refused: the commit point. Then, still under the
lock, the root points ``latest`` at it and renames retired steps (and a replaced old version) aside;
they are deleted after, on a background thread, without the lock. A failure after the rename is a
warning: the step is committed.

Everything the commit needs from its root comes in as one object, its ``RootCommit`` (the sequence, the
pointer and retention, the commit-point check, whether what stands at the name may be replaced): the
commit never calls into the root's step storage.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from safeio._checkpoints.steps import RootCommit, SharedFsyncs, StepPromotion
from safeio._errors import PromotionError, SafeIOError, TargetExistsError
from safeio._options import exchange_disabled
from safeio._promotion.aside import RenameAside
from safeio._promotion.base import Promoted
from safeio._promotion.behaviour import Behaviour
from safeio._promotion.exchange import ExchangeRename
from safeio._promotion.local import LocalPromotion
from safeio._storage import claims, manifest
from safeio._storage.dirfd import fsync_files, held_directory, lstat_at
from safeio._storage.fsops import carry_missing
from safeio._storage.location import Location
from safeio._storage.locking import held, lock_path_for, make_lock
from safeio._storage.names import ROOT_LOCK, parse, sibling_name
from safeio._who import who

logger = logging.getLogger("safeio")


class StepRename(LocalPromotion, StepPromotion):
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
        root: RootCommit,
        adopt: bool = False,
        **save: Any,
    ) -> None:
        # No recovery of the step's own siblings under the lock: the only ones a step has are stages,
        # and the root's dead ones were recovered when this process opened its first stage there.
        super().__init__(location, recover=_nothing_to_recover, behaviour=StepReplace(), root=root, **save)
        self._adopt = adopt
        self._renamed = False
        self._fsyncs: SharedFsyncs | None = None
        self.shares_fsyncs = self.options.durable
        self._replaced: list[str] = []  # old versions renamed aside, deleted after the commit

    def finish_step(
        self,
        stage: str,
        fsyncs: SharedFsyncs | None = None,
        *,
        commit_point: Callable[[], None] | None = None,
    ) -> Promoted:
        self._fsyncs = fsyncs
        if self._adopt:
            self._adopt_existing()
        return super().finish_step(stage, fsyncs, commit_point=commit_point)

    def _adopt_existing(self) -> None:
        """``ExistingDirectory.adopt``: the files of the directory the script saves into are kept in the
        committed step, where the save wrote nothing of the same name (its files win) — also when it is
        an earlier commit of the step: a tokenizer the script wrote there before its first save stays."""
        found = lstat_at(self.parent_fd, self.name)
        if found is None or not self.root.may_replace(found):
            return
        with held_directory(self.name, dir_fd=self.parent_fd) as existing_fd:
            carried = carry_missing(existing_fd, self.stage_fd, skip=_not_content)
        logger.debug(
            "%s: %d file(s) of %s kept in step %s", who(self.rank), carried, self.target, self.root.step
        )

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
                f"could not sync {', '.join(unsynced[:5])} of the stage of step {self.root.step} "
                f"({len(unsynced)} file(s)): they vanished or cannot be opened; nothing was committed",
                self.target,
            )

    def check_target(self) -> None:
        found = self._target_stat()
        if found is None:
            return
        if self.root.may_replace(found):
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
        sequence = self.marker["sequence"] = self.root.next_sequence()
        try:
            super()._promote(stage, entries)
        except (OSError, SafeIOError) as exc:
            if not self._renamed:
                raise  # before the commit point: nothing is committed
            self.warnings.append(f"the root {self.parent} could not be synced after the commit ({exc})")
        self.warnings.extend(self.root.after_commit(sequence, self.phase, self._replaced, self.parent_fd))

    def before_rename(self) -> None:
        self.root.passing_commit_point()  # the manifest is written and sealed; the rename is the commit

    def _put_in_place(self, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        super()._put_in_place(stage, entries)
        self._renamed = True  # the commit point

    def remove_old_version(self, name: str) -> None:
        """The version the commit replaced (at ``name``: the stage's after an exchange, the aside one
        otherwise) is renamed aside as a retired step is, and deleted with them after the lock: a step's
        gigabytes are not deleted while every later commit of the root waits."""
        aside = claims.claim(sibling_name(self.name, "tmp"))  # released once deleted
        try:
            os.rename(name, aside, src_dir_fd=self.parent_fd, dst_dir_fd=self.parent_fd)
        except OSError as exc:
            claims.release(aside)
            previous = os.path.join(self.parent, name)
            self.warnings.append(
                f"step {self.root.step} is committed, but its previous version {previous} "
                f"could not be set aside for deletion ({exc}); `safeio gc {self.parent}` removes it"
            )
            return
        self._replaced.append(aside)


class StepReplace(Behaviour):
    """A committed step saved again (a rollback, a re-run into the root): exchanged with the new version,
    or renamed aside where the filesystem refuses exchange."""

    def commit(self, p: LocalPromotion, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        # NFS and FUSE refuse RENAME_EXCHANGE (EINVAL): asking would cost a round trip, and its fallback a
        # WARNING on the first rollback (or just-in-time checkpoint) of every job. A step replaced there is
        # missing for an instant, never torn: latest() meanwhile names the previous commit.
        way = RenameAside() if exchange_disabled() or not p.noreplace_flag() else ExchangeRename()
        way.commit(p, stage, entries)


def _nothing_to_recover(parent: str, parent_fd: int, target_name: str, durable: bool, own_stage: str) -> None:
    del parent, parent_fd, target_name, durable, own_stage


def _not_content(name: str) -> bool:
    """What a directory a save adopts holds that is no file of the checkpoint: a safeio marker (an earlier
    save's manifest: the commit writes its own) or a safeio leftover."""
    return name == manifest.MANIFEST_NAME or parse(name) is not None
