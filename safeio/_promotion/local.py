"""The directory save on a POSIX filesystem (local disk, NFS, Lustre, FUSE): one flow, one function.

The stage is a hidden sibling of the target on its filesystem, so that promotion is a ``rename(2)``: an
entry replaced atomically, never a file truncated in place. The lock beside the target keeps rival writer
*jobs* apart; under it, dead writers' leftovers of the target are put right before this save promotes. A
missing target is renamed into place; an existing one is replaced by the behaviour's ``commit``
(``safeio._promotion.behaviour``: exchange, rename aside, merge, versioned, a checkpoint step's rename;
picked by the back end). ``finish`` is the whole commit, top to bottom; the behaviour is an object it
calls, never a subclass of it.

The parent (often a share others can write) is held open from the stage's creation; every step is
relative to it (``safeio._storage.dirfd``), never a path through links. The stage, held open too, is
checked to be the directory this process made before each phase: one swapped for a link is refused.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from typing import Any

from safeio._boundary import NOT_A_DIRECTORY, mapped, os_failure
from safeio._errors import InvalidTargetError, PromotionError
from safeio._options import SaveOptions
from safeio._promotion.base import FilesCheck, PhaseHook, Promoted, Promotion
from safeio._promotion.behaviour import Behaviour
from safeio._storage import claims, manifest
from safeio._storage.dirfd import held_directory, identity, lstat_at, open_directory, still_is
from safeio._storage.fsops import remove_at
from safeio._storage.location import Location
from safeio._storage.locking import held, lock_path_for, make_lock
from safeio._storage.metadata import Damaged, load_manifest
from safeio._storage.mounts import is_network_device
from safeio._storage.names import NAME_MAX, may_have_siblings, sibling_name
from safeio._storage.posix import rename_noreplace
from safeio._storage.stage_contents import StageContents, settle_stage
from safeio._who import who

logger = logging.getLogger("safeio")

# A fresh target's rename found something in its place (see _promote_fresh).
_TAKEN = frozenset({errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR})

# recover(parent, parent_fd, target_name, durable, own_stage): puts right what dead writers of the target
# left. Injected by the back end, because recovery dispatches to every behaviour and behaviours must not
# import each other.
Recovery = Callable[[str, int, str, bool, str], None]


class LocalPromotion(Promotion):
    """Stage beside the target on its own filesystem and promote with rename(2); the behaviour's
    ``commit`` replaces an existing target."""

    def __init__(
        self,
        location: Location,
        options: SaveOptions,
        *,
        rank: int,
        call_id: str,
        recover: Recovery,
        behaviour: Behaviour,
        on_phase: PhaseHook | None = None,
        check_files: FilesCheck | None = None,
        marker: dict[str, Any] | None = None,
    ) -> None:
        self.location, self.options = location, options
        self.rank, self.call_id = rank, call_id
        self._on_phase = on_phase
        self.marker = dict(marker or {})
        self._check_files = check_files
        self._started = time.monotonic()  # peers' waits began about now (see _lock_timeout)
        self._result: Any = None  # the body's result (JSON form), recorded in the manifest
        self.version: list[int] | None = None  # the promoted manifest's ``manifest.version_of``
        self.replaced: list[int] | None = None  # the same of the version it replaced (None: none)
        self._recover = recover
        self.behaviour = behaviour
        # Asked for at every step: read once (a Location is immutable).
        self.target = location.path
        self.parent = location.parent
        self.name = location.name
        self.parent_fd = -1
        self.stage_fd = -1
        self.stage_name = ""
        self._stage_id: tuple[int, int] | None = None
        self._stage_mode = 0o777  # what mkdir gave the stage (the umask applied): see settle_stage
        self.contents = StageContents()  # what the finished stage holds (set by _settle)
        # Whether the promotion changed the parent's entries (a rename there), so that a durable save
        # syncs it; a merge into an existing target changes only the target's.
        self.parent_changed = True
        self.committed = False  # whether the stage became the target (the commit point passed)

    def phase(self, name: str) -> None:
        if self._on_phase is not None:
            self._on_phase(name)

    # -- the target --------------------------------------------------------------------------------

    def _target_stat(self) -> os.stat_result | None:
        if self.parent_fd >= 0:
            return lstat_at(self.parent_fd, self.name)
        try:
            return os.lstat(self.target)
        except FileNotFoundError:
            return None
        except OSError as exc:  # ENOTDIR: a component of the parent is a file
            raise os_failure(
                f"cannot look at {self.target}", self.target, exc, invalid=NOT_A_DIRECTORY
            ) from exc

    def check_target(self) -> None:
        self.behaviour.check_target(self, self._target_stat())

    # -- the stage ---------------------------------------------------------------------------------

    def open_stage(self) -> str:
        size = len(self.name.encode("utf-8", "surrogateescape"))
        if size > NAME_MAX:
            # Refused before the body runs: the final rename would fail after all the work.
            raise PromotionError(
                f"cannot save {self.target}: its name is {size} bytes, over the {NAME_MAX}-byte limit of "
                "a file name",
                self.target,
                errno=errno.ENAMETOOLONG,
            )
        self.check_target()
        parent = self.parent
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        try:
            # The parent is the caller's path (trusted, links included); below it nothing is followed.
            try:
                self.parent_fd = os.open(parent, flags)
            except FileNotFoundError:
                os.makedirs(parent, exist_ok=True)
                self.parent_fd = os.open(parent, flags)
        except OSError as exc:
            if exc.errno in NOT_A_DIRECTORY:
                raise InvalidTargetError(
                    f"the parent of {self.target} cannot be created: {parent} or one of its components "
                    "is a file",
                    parent,
                ) from exc
            raise os_failure(f"cannot create the parent directory {parent}", parent, exc) from exc
        self.stage_name = claims.claim(sibling_name(self.name, "stage"))  # released by close()
        try:
            # The umask applies, as for any mkdir (mkdtemp would force 0700); a setgid parent's group too.
            os.mkdir(self.stage_name, 0o777, dir_fd=self.parent_fd)
            self.stage_fd = open_directory(self.stage_name, dir_fd=self.parent_fd)
            made = os.fstat(self.stage_fd)
            self._stage_id, self._stage_mode = identity(made), made.st_mode
        except OSError as exc:
            self.close()
            raise os_failure(
                f"cannot create a stage for {self.target} in {parent}",
                self.target,
                exc,
                invalid=NOT_A_DIRECTORY,
            ) from exc
        stage = os.path.join(parent, self.stage_name)
        if logger.isEnabledFor(logging.DEBUG):  # who() is work: not on every save for a line not shown
            logger.debug("%s: stage %s created for %s", who(self.rank), stage, self.target)
        return stage

    def check_stage(self) -> None:
        """The stage is still the directory this process made (not renamed away or swapped for a link)."""
        if not still_is(self.parent_fd, self.stage_name, self._stage_id):
            raise PromotionError(
                f"the stage {os.path.join(self.parent, self.stage_name)} of {self.target} was moved or "
                "replaced by someone else while the save ran; nothing was promoted and nothing it now "
                "points to was touched",
                self.target,
            )

    def promoted_is_stage(self, name: str) -> bool:
        """After a promoting rename: whether what now stands at ``name`` is the stage this process made.
        The last ``check_stage`` ran before the rename, which goes by name: in a share others can write,
        the stage may have been swapped in that window (a poller did it in 92 of 109 saves)."""
        return still_is(self.parent_fd, name, self._stage_id)

    def swapped_stage_error(self) -> PromotionError:
        return PromotionError(
            f"the stage {os.path.join(self.parent, self.stage_name)} of {self.target} was replaced by "
            "someone else just before it was promoted; the promotion was undone, nothing of theirs was "
            "kept under the target's name, and the previous version stays",
            self.target,
        )

    def close(self) -> None:
        # The stage is promoted, removed, or (a failed cleanup) a leftover for the next save's recovery.
        claims.release(self.stage_name)
        for attribute in ("stage_fd", "parent_fd"):
            fd = getattr(self, attribute)
            if fd >= 0:
                setattr(self, attribute, -1)
                with contextlib.suppress(OSError):
                    os.close(fd)

    def discard(self, stage: str) -> None:
        if self.behaviour.keeps_failed_stage(self, stage):
            self.close()
            return
        try:
            made = self.parent_fd >= 0 and self.stage_name
            if made and still_is(self.parent_fd, self.stage_name, self._stage_id):
                remove_at(self.parent_fd, self.stage_name, what="failed stage", shown=stage)
        finally:
            self.close()

    # -- the commit ------------------------------------------------------------------------------

    def finish(self, stage: str, *, result: Any = None) -> Promoted:
        """Describe, sync, lock and promote ``stage``; on return the target is the new version.
        ``result`` (the body's, JSON form) is recorded in the manifest for peers without a store."""
        self._result = result
        behaviour, target = self.behaviour, self.target
        with mapped(f"could not promote {target}", target):
            self.phase("manifest")  # describing the stage reads (and, if durable, hashes) every file
            entries = self._settle()
            if not (behaviour.promotes_unlocked and self._promote_fresh(entries)):
                self.phase("lock")
                with self._locked():
                    self.phase("promote")
                    # Under the lock: a rival job may have changed the target while our body ran, and
                    # what dead writers of it left is put right before this save promotes.
                    with behaviour.committing(self):
                        self.check_target()
                        self.check_stage()
                        self.replaced = self._current_version()
                        durable = self.options.durable
                        self._recover(self.parent, self.parent_fd, self.name, durable, self.stage_name)
                        if not (behaviour.renames_fresh_target and self._renamed_fresh(entries)):
                            behaviour.commit(self, stage, entries)
                        self.committed = True
                        self._sync_parent()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s: promoted %s (mode %s)", who(self.rank), target, self.options.mode)
        self.close()
        return Promoted(self.version, self.replaced)

    def _settle(self) -> dict[str, dict[str, Any]]:
        """Check the stage, make it durable where asked, and return the manifest entries of its files
        (none when the manifest is off)."""
        self.check_stage()
        durable, behaviour = self.options.durable, self.behaviour
        in_walk = durable and behaviour.syncs_in_walk(self)
        if durable:
            self.phase("fsync")  # the walk below fsyncs every file as it checksums it
        # One walk, one open per file: modes, checksums (durable only: see safeio._storage.manifest),
        # fsyncs, and the subdirectories'. The stage directory itself is synced once the manifest (and a
        # merge's intent) is in it: seal_stage.
        self.contents = settle_stage(
            self.stage_fd,
            self._stage_mode,
            describe=self.options.manifest,
            hashes=durable and behaviour.hashes_when_durable,
            sync_files=in_walk,
            sync_dirs=durable,
        )
        if self._check_files is not None:
            self._check_files(list(self.contents.content))
        if durable and not in_walk:
            behaviour.sync_files(self)
        return self.contents.entries

    def seal_stage(self) -> None:
        """Durable saves: the stage's entries (its files, the manifest, a merge's intent) reach the disk
        in one fsync, before the first rename that publishes any of them."""
        if self.options.durable:
            os.fsync(self.stage_fd)

    def _promote_fresh(self, entries: dict[str, dict[str, Any]]) -> bool:
        """A target that does not exist yet, with no leftovers of dead writers beside it, needs no lock.

        The lock orders promotions *over* an existing target and the recovery of leftovers; a rename that
        never replaces anything needs neither. ``renameat2(RENAME_NOREPLACE)`` refuses to replace
        whatever a rival promoted meanwhile; where the filesystem lacks the flag (NFS, FUSE), a plain
        rename does the same for any rival's version (a non-empty directory: ENOTEMPTY; a version link:
        ENOTDIR). Either way this save then goes the locked way, as if it had found the target. No lock
        file is made, which on NFS is three of the save's round trips.
        """
        if not self.behaviour.renames_fresh_target:
            return False
        if lstat_at(self.parent_fd, self.name) is not None:
            return False
        if may_have_siblings(os.listdir(self.parent_fd), self.name, besides=self.stage_name):
            return False  # leftovers are put right under the lock
        self.phase("promote")
        self.check_stage()
        if not self.rename_into_place(entries):
            return False
        self._sync_parent()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s: %s is new: promoted without the lock", who(self.rank), self.target)
        return True

    def _renamed_fresh(self, entries: dict[str, dict[str, Any]]) -> bool:
        """Under the lock: the stage renamed to a target that is still missing (True); else the target
        is checked again (a first save of a rival job may have taken the name meanwhile)."""
        if lstat_at(self.parent_fd, self.name) is None and self.rename_into_place(entries):
            return True
        self.check_target()
        return False

    def rename_into_place(self, entries: dict[str, dict[str, Any]]) -> bool:
        """The stage becomes the target, which does not exist; False (nothing changed) if a rival's
        version took the name first, which first saves promote without the lock."""
        self.write_manifest(entries, None)
        self.seal_stage()
        self.behaviour.commit_point()
        try:
            rename_noreplace(self.stage_name, self.name, self.parent_fd, flag=self.noreplace_flag())
        except OSError as exc:
            if exc.errno not in _TAKEN:
                raise
            if self.options.manifest:  # written again from what is there now
                os.unlink(manifest.MANIFEST_NAME, dir_fd=self.stage_fd)
                self.version = None
            return False
        if not self.promoted_is_stage(self.name):
            # Theirs goes back where it came from: the target's name must not show it.
            os.rename(self.name, self.stage_name, src_dir_fd=self.parent_fd, dst_dir_fd=self.parent_fd)
            raise self.swapped_stage_error()
        return True

    def noreplace_flag(self) -> bool:
        # NFS and FUSE refuse RENAME_NOREPLACE: asking would be one more round trip to the server.
        return not is_network_device(os.fstat(self.parent_fd).st_dev, self.parent)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        lock = make_lock(
            lock_path_for(self.parent, self.behaviour.lock_name or self.name),
            self.options.lock,
            self._lock_timeout(),
            self.options.lease_seconds,
            parent_fd=self.parent_fd,
            # A checkpoint's root directory itself is locked (a flock on it, locally): no lock file is
            # left in a framework's own directory, whose listing its users and tests read.
            on_directory=self.behaviour.lock_on_directory,
        )
        with held(lock, self.target, self.rank):
            yield

    def _lock_timeout(self) -> float:
        """What is left of ``timeout`` for the lock, minus a margin to publish the outcome.

        Peers wait ``timeout`` from about when this save began; a writer that waited the full
        ``timeout`` for a rival's lock after its body would report LockTimeout after every peer had
        given up with a PeerTimeout that hides why (seen with 8 ranks and a rival holding the lock).
        """
        timeout = self.options.timeout
        margin = min(1.0, 0.05 * timeout)
        return max(0.01, timeout - (time.monotonic() - self._started) - margin)

    def _current_version(self) -> list[int] | None:
        """``manifest.version_of`` the target's manifest now (through a version link), if it has one."""
        try:
            st = os.stat(
                f"{self.name}/{manifest.MANIFEST_NAME}", dir_fd=self.parent_fd, follow_symlinks=False
            )
        except OSError:
            return None
        return manifest.version_of(st) if stat.S_ISREG(st.st_mode) else None

    def _sync_parent(self) -> None:
        """Make the promotion itself durable."""
        if self.options.durable and self.parent_changed:
            os.fsync(self.parent_fd)

    # -- shared by local behaviours ------------------------------------------------------------------

    def write_manifest(
        self,
        entries: dict[str, dict[str, Any]],
        previous_fd: int | None,
        intent: dict[str, Any] | None = None,
    ) -> None:
        """Write the manifest into the stage last; ``previous_fd`` (merge) keeps other objects' entries;
        ``intent`` (merge) is recorded in it for recovery (``manifest.MERGE_INTENT_KEY``)."""
        if not self.options.manifest:
            return
        old = load_manifest(previous_fd, manifest.MANIFEST_NAME) if previous_fd is not None else None
        if isinstance(old, Damaged):
            logger.warning(
                "%s: the manifest of %s is damaged (%s); the new one lists only this save's files",
                who(self.rank),
                self.target,
                old.reason,
            )
            old = None
        record = manifest.build(
            entries, rank=self.rank, call=self.call_id, previous=old, result=self._result, marker=self.marker
        )
        if intent is not None:
            record[manifest.MERGE_INTENT_KEY] = intent
        self.version = manifest.write(self.stage_fd, record, durable=self.options.durable)

    @contextlib.contextmanager
    def target_directory(self) -> Iterator[int]:
        """The existing target directory, held (a link there is not followed)."""
        with held_directory(self.name, dir_fd=self.parent_fd) as fd:
            yield fd
