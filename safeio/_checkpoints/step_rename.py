"""The commit of one checkpoint step on a POSIX filesystem (local disk, NFS): a stage directory beside the
step, one rename.

The writer makes ``.step_N.safeio-stage-<owner>`` beside the step's final name (``LocalPromotion.open_stage``,
the same stage any directory save makes); every rank writes its part there. The commit is that
promotion's ``finish``, handed ``StepRename`` as its behaviour (as a directory save is handed an exchange
or a merge): the stage is checked to be the directory the writer made, its modes settled, and
under the root's lock (the ``lock`` option: a flock on the root directory itself locally, a lease marker
``.checkpoints.safeio.lock`` on a network filesystem) the root gives the next sequence number, the
manifest of every file is written last with the step and the sequence in it (the marker), fsynced as
configured, and the stage renamed to ``step_N`` — exchanged with what stands there when the step is
committed already, or renamed aside where exchange is refused: the commit point. Then, still under the
lock, the root points ``latest`` at it and renames retired steps (and a replaced old version) aside;
they are deleted after, on a background thread, without the lock. A failure after the rename is a
warning: the step is committed.

Everything the commit needs from its root comes in as one object, its ``RootCommit`` (the sequence, the
pointer and retention, the commit-point check, whether what stands at the name may be replaced, the
ranks' shares of the fsyncs): the commit never calls into the root's step storage.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from safeio._checkpoints.steps import RootCommit
from safeio._errors import PromotionError, SafeIOError, TargetExistsError
from safeio._options import exchange_disabled
from safeio._promotion.aside import RenameAside
from safeio._promotion.behaviour import Behaviour
from safeio._promotion.exchange import ExchangeRename
from safeio._promotion.local import LocalPromotion
from safeio._storage import claims, manifest
from safeio._storage.dirfd import fsync_files, held_directory, lstat_at
from safeio._storage.fsops import carry_missing
from safeio._storage.names import ROOT_LOCK, parse, sibling_name
from safeio._who import who

logger = logging.getLogger("safeio")


class StepRename(Behaviour):
    """One step's commit: the stage renamed to the step's name, under the root's lock, between its place
    in commit order and the pointer and retention. What stands there already — this user's commit of
    the same step (a rollback, a re-run into the same root), or a directory the caller's
    ``ExistingDirectory`` lets the commit replace — is swapped out at the commit, as a directory save
    replaces its target (``renameat2`` exchange, or renamed aside where the filesystem refuses it): the
    old version stays whole under the name until the new one takes it, and is then deleted like a
    retired step, after the lock."""

    promotes_unlocked = False  # the sequence, latest and retention need the root's lock even for a new step
    hashes_when_durable = False
    # The root's entries (the sequence, latest, retention) change with every commit. The root directory
    # itself is locked (a flock on it, locally); network filesystems take a lease, whose marker stands
    # only while the commit holds it.
    lock_name = ROOT_LOCK
    lock_on_directory = True

    def __init__(self, root: RootCommit) -> None:
        self.root = root
        self._replaced: list[str] = []  # old versions renamed aside, deleted after the commit

    def check_target(self, p: LocalPromotion, found: os.stat_result | None) -> None:
        if found is None or self.root.may_replace(found):
            return
        raise TargetExistsError(
            f"{p.target} appeared meanwhile and is not a step safeio may replace (a commit of this "
            "user's, or a directory the save was told it may replace); nothing was committed",
            p.target,
        )

    @contextlib.contextmanager
    def committing(self, p: LocalPromotion) -> Iterator[None]:
        """Under the root's lock: the step's place in commit order first (recorded in its manifest);
        after the rename, a failure to sync the root is a warning (the step is committed), and the
        pointer and retention follow."""
        root = self.root
        sequence = p.marker["sequence"] = root.next_sequence()
        try:
            yield
        except (OSError, SafeIOError) as exc:
            if not p.committed:
                raise  # before the commit point: nothing is committed
            root.warnings.append(f"the root {p.parent} could not be synced after the commit ({exc})")
        root.warnings.extend(root.after_commit(sequence, p.phase, self._replaced, p.parent_fd))

    def commit(self, p: LocalPromotion, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        """A committed step saved again (a rollback, a re-run into the root): exchanged with the new
        version, or renamed aside where the filesystem refuses exchange."""
        # NFS and FUSE refuse RENAME_EXCHANGE (EINVAL): asking would cost a round trip, and its fallback a
        # WARNING on the first rollback (or just-in-time checkpoint) of every job. A step replaced there is
        # missing for an instant, never torn: latest() meanwhile names the previous commit.
        way = RenameAside() if exchange_disabled() or not p.noreplace_flag() else ExchangeRename()
        way.commit(p, stage, entries)

    def commit_point(self) -> None:
        self.root.passing_commit_point()  # the manifest is written and sealed; the rename is the commit

    def syncs_in_walk(self, p: LocalPromotion) -> bool:
        return self.root.fsyncs is None or not p.options.manifest  # else shared out: sync_files

    def sync_files(self, p: LocalPromotion) -> None:
        # Each rank syncs its share of the files at the same time; the writer its own, then whatever
        # another rank could not (see CheckpointSave). The manifest and the directories stay the writer's.
        fsyncs = self.root.fsyncs
        if fsyncs is None or not p.options.manifest:  # no manifest entries: no list to share
            super().sync_files(p)
            return
        sizes = {rel: int(entry.get("size", 0)) for rel, entry in p.contents.entries.items()}
        own = fsyncs.hand_out(sizes)
        left = fsync_files(p.stage_fd, own)
        left += fsyncs.left_over()
        unsynced = fsync_files(p.stage_fd, left)
        if unsynced:
            raise PromotionError(
                f"could not sync {', '.join(unsynced[:5])} of the stage of step {self.root.step} "
                f"({len(unsynced)} file(s)): they vanished or cannot be opened; nothing was committed",
                p.target,
            )

    def old_version(self, p: LocalPromotion, name: str) -> None:
        """The version the commit replaced (at ``name``: the stage's after an exchange, the aside one
        otherwise) is renamed aside as a retired step is, and deleted with them after the lock: a step's
        gigabytes are not deleted while every later commit of the root waits."""
        aside = claims.claim(sibling_name(p.name, "tmp"))  # released once deleted
        try:
            os.rename(name, aside, src_dir_fd=p.parent_fd, dst_dir_fd=p.parent_fd)
        except OSError as exc:
            claims.release(aside)
            previous = os.path.join(p.parent, name)
            self.root.warnings.append(
                f"step {self.root.step} is committed, but its previous version {previous} "
                f"could not be set aside for deletion ({exc}); `safeio gc {p.parent}` removes it"
            )
            return
        self._replaced.append(aside)


def adopt_existing(p: LocalPromotion, root: RootCommit) -> None:
    """``ExistingDirectory.adopt``: the files of the directory the script saves into are kept in the
    committed step, where the save wrote nothing of the same name (its files win) — also when it is an
    earlier commit of the step: a tokenizer the script wrote there before its first save stays."""
    found = lstat_at(p.parent_fd, p.name)
    if found is None or not root.may_replace(found):
        return
    with held_directory(p.name, dir_fd=p.parent_fd) as existing_fd:
        carried = carry_missing(existing_fd, p.stage_fd, skip=_not_content)
    logger.debug("%s: %d file(s) of %s kept in step %s", who(p.rank), carried, p.target, root.step)


def nothing_to_recover(parent: str, parent_fd: int, target_name: str, durable: bool, own_stage: str) -> None:
    """No recovery of the step's own siblings under the lock: the only ones a step has are stages, and the
    root's dead ones were recovered when this process opened its first stage there."""
    del parent, parent_fd, target_name, durable, own_stage


def _not_content(name: str) -> bool:
    """What a directory a save adopts holds that is no file of the checkpoint: a safeio marker (an earlier
    save's manifest: the commit writes its own) or a safeio leftover."""
    return name == manifest.MANIFEST_NAME or parse(name) is not None
