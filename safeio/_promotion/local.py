"""The directory save on a POSIX filesystem (local disk, NFS, Lustre, FUSE): one flow, one class.

The stage is a hidden sibling of the target on its filesystem, so that promotion is a ``rename(2)``: an
entry replaced atomically, never a file truncated in place. The lock beside the target keeps rival writer
*jobs* apart; under it, dead writers' leftovers of the target are put right before this save promotes. A
missing target is renamed into place; an existing one is replaced by the behaviour's ``commit``
(``safeio._promotion.behaviour``: exchange, rename aside, merge, versioned, picked by the back end).

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
from collections.abc import Callable, Iterator
from typing import Any

from safeio._boundary import NOT_A_DIRECTORY, os_failure
from safeio._errors import InvalidTargetError, PromotionError, TargetExistsError
from safeio._options import SaveOptions
from safeio._promotion.base import Promoted, Promotion
from safeio._promotion.behaviour import Behaviour
from safeio._storage import claims, manifest
from safeio._storage.dirfd import fsync_files_below, held_directory, identity, lstat_at, open_directory
from safeio._storage.fsops import remove_at
from safeio._storage.location import Location
from safeio._storage.locking import held, lock_path_for, make_lock
from safeio._storage.metadata import Damaged, load_manifest
from safeio._storage.mounts import is_network_device
from safeio._storage.names import NAME_MAX, may_have_siblings, sibling_name
from safeio._storage.posix import rename_noreplace
from safeio._storage.readers import version_pointee
from safeio._storage.stage_contents import StageContents, settle_stage
from safeio._who import who

logger = logging.getLogger("safeio")

# A fresh target's rename found something in its place (see _promote_unlocked).
_TAKEN = frozenset({errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR})

# recover(parent, parent_fd, target_name, durable, own_stage): puts right what dead writers of the target
# left. Injected by the back end, because recovery dispatches to every behaviour and behaviours must not
# import each other.
Recovery = Callable[[str, int, str, bool, str], None]


class LocalPromotion(Promotion):
    """Stage beside the target on its own filesystem and promote with rename(2); the behaviour's
    ``commit`` replaces an existing target."""

    # Whether a durable save records a checksum of every file (safeio._storage.digests); a
    # checkpoint's gigabytes of shards are described by their sizes.
    hashes_when_durable = True
    # Whether the promotion changed the parent's entries (a rename there), so that a durable save syncs
    # it; a merge into an existing target changes only the target's.
    parent_changed = True

    def __init__(
        self,
        location: Location,
        options: SaveOptions,
        *,
        recover: Recovery,
        behaviour: Behaviour,
        **save: Any,
    ) -> None:
        super().__init__(location, options, **save)  # rank, call_id, on_phase
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
        self.contents = StageContents()  # what the finished stage holds (set by _prepare)

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
        self._check_existing_target()
        if self.behaviour.guards_own_ground:
            self.refuse_protected_directories()

    def _check_existing_target(self) -> None:
        target = self.target
        st = self._target_stat()
        if st is None:
            return
        dir_fd = self.parent_fd if self.parent_fd >= 0 else None
        shown = self.name if dir_fd is not None else target
        if stat.S_ISLNK(st.st_mode) and version_pointee(shown, dir_fd=dir_fd) is None:
            raise InvalidTargetError(
                f"target {target} is a symlink safeio did not create; safeio never writes through or "
                "replaces a foreign symlink (resolve it yourself and pass the real path)",
                target,
            )
        if not stat.S_ISLNK(st.st_mode) and not stat.S_ISDIR(st.st_mode):
            raise InvalidTargetError(
                f"target {target} exists and is not a directory: a replicated target is a directory "
                "(use safeio.atomic_open for a single file)",
                target,
            )
        if self.options.mode == "error":
            raise TargetExistsError(f"target {target} already exists and mode='error'", target)

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
        logger.debug("%s: stage %s created for %s", who(self.rank), stage, self.target)
        return stage

    def check_stage(self) -> None:
        """The stage is still the directory this process made (not renamed away or swapped for a link)."""
        st = lstat_at(self.parent_fd, self.stage_name)
        if st is None or identity(st) != self._stage_id:
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
        st = lstat_at(self.parent_fd, name)
        return st is not None and identity(st) == self._stage_id

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
            if self.parent_fd >= 0 and self.stage_name:
                st = lstat_at(self.parent_fd, self.stage_name)
                if st is not None and identity(st) == self._stage_id:
                    remove_at(self.parent_fd, self.stage_name, what="failed stage", shown=stage)
        finally:
            self.close()

    def finish(self, stage: str, *, result: Any = None) -> Promoted:
        promoted = super().finish(stage, result=result)
        self.close()
        return promoted

    # -- hooks of the flow -------------------------------------------------------------------------

    def _prepare(self, stage: str) -> dict[str, dict[str, Any]]:
        self.check_stage()
        durable = self.options.durable
        in_walk = durable and self._files_synced_in_walk()
        if durable:
            self.phase("fsync")  # the walk below fsyncs every file as it checksums it
        # One walk, one open per file: modes, checksums (durable only: see safeio._storage.manifest),
        # fsyncs, and the subdirectories'. The stage directory itself is synced once the manifest (and a
        # merge's intent) is in it: seal_stage.
        self.contents = settle_stage(
            self.stage_fd,
            self._stage_mode,
            describe=self.options.manifest,
            hashes=durable and self.hashes_when_durable,
            sync_files=in_walk,
            sync_dirs=durable,
        )
        self.check_staged(self.contents.content)
        if durable and not in_walk:
            self._sync_files()
        return self.contents.entries

    def _files_synced_in_walk(self) -> bool:
        """Whether the stage's walk fsyncs its files (one open per file); not where they are shared out
        among a checkpoint's ranks (``StepRename``)."""
        return True

    def _sync_files(self) -> None:
        """Durable saves whose files the walk did not sync: every regular file of the stage."""
        fsync_files_below(self.stage_fd)

    def seal_stage(self) -> None:
        """Durable saves: the stage's entries (its files, the manifest, a merge's intent) reach the disk
        in one fsync, before the first rename that publishes any of them."""
        if self.options.durable:
            os.fsync(self.stage_fd)

    def _promote_unlocked(self, stage: str, entries: dict[str, dict[str, Any]]) -> bool:
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
        logger.debug("%s: %s is new: promoted without the lock", who(self.rank), self.target)
        return True

    def rename_into_place(self, entries: dict[str, dict[str, Any]]) -> bool:
        """The stage becomes the target, which does not exist; False (nothing changed) if a rival's
        version took the name first, which first saves promote without the lock."""
        self.write_manifest(entries, None)
        self.seal_stage()
        self.before_rename()
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

    def before_rename(self) -> None:
        """The last moment before the stage becomes the target (a checkpoint's commit point: see
        ``StepRename``); nothing by default."""

    def noreplace_flag(self) -> bool:
        # NFS and FUSE refuse RENAME_NOREPLACE: asking would be one more round trip to the server.
        return not is_network_device(os.fstat(self.parent_fd).st_dev, self.parent)

    def lock_name(self) -> str:
        """Whose promotion lock this save takes: its target's (``.<name>.safeio.lock`` beside it)."""
        return self.name

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        lock = make_lock(
            lock_path_for(self.parent, self.lock_name()),
            self.options.lock,
            self.lock_timeout(),
            self.options.lease_seconds,
            parent_fd=self.parent_fd,
        )
        with held(lock, self.target, self.rank):
            yield

    def _promote(self, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        # Under the lock: a rival job may have changed the target while our body ran, and what dead
        # writers of it left is put right before this save promotes.
        self.check_target()
        self.check_stage()
        self.replaced = self._current_version()
        self._recover(self.parent, self.parent_fd, self.name, self.options.durable, self.stage_name)
        self._put_in_place(stage, entries)
        self._sync_parent()

    def _put_in_place(self, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        if self.behaviour.renames_fresh_target:
            if lstat_at(self.parent_fd, self.name) is None and self.rename_into_place(entries):
                return
            self.check_target()  # a first save of a rival job may have taken the name meanwhile
        self.behaviour.commit(self, stage, entries)

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

    def refuse_protected_directories(self) -> None:
        """Behaviours that remove the old version refuse a target that holds the process's own ground.

        ``replicated(".")`` in replace mode would otherwise empty the working directory it runs in.
        """
        if self.stage_fd >= 0:
            return  # checked before the stage was made; the working and home directories are the caller's
        target = self.target
        candidates = {target, os.path.realpath(target)}
        for what, path in (
            ("the working directory", _cwd()),
            ("the home directory", os.path.expanduser("~")),
        ):
            if (
                path
                and path != "/"
                and any(path == t or path.startswith(t.rstrip("/") + "/") for t in candidates)
            ):
                raise InvalidTargetError(
                    f"refusing mode={self.options.mode!r} for {target}: it is or contains {what} {path}, "
                    "which replacing it would delete (save into a subdirectory, or use mode='merge')",
                    target,
                )

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
        record = self.manifest_record(entries, old)
        if intent is not None:
            record[manifest.MERGE_INTENT_KEY] = intent
        self.version = manifest.write(self.stage_fd, record, durable=self.options.durable)

    @contextlib.contextmanager
    def target_directory(self) -> Iterator[int]:
        """The existing target directory, held (a link there is not followed)."""
        with held_directory(self.name, dir_fd=self.parent_fd) as fd:
            yield fd

    def remove_old_version(self, name: str) -> None:
        """Remove a replaced version after success: a failure here is a warning and a leftover for gc.

        The new version is already in place; raising now would tell every peer the save failed.
        """
        self.phase("cleanup")
        shown = os.path.join(self.parent, name)
        try:
            remove_at(self.parent_fd, name, what="replaced version", shown=shown)
        except OSError as exc:
            logger.warning(
                "%s: %s was promoted, but its old version %s could not be removed (%s); `safeio gc` "
                "removes it later",
                who(self.rank),
                self.target,
                shown,
                exc.strerror or exc,
            )


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # the working directory was removed
        return None
