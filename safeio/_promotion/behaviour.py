"""A storage behaviour on POSIX: how a settled, described stage replaces a target, and how a crash in the
middle of it is put right.

``LocalPromotion.finish`` (``local``) is one function for every POSIX directory save and checkpoint
step: check the stage, settle and describe it, lock, then a rename when the target is missing, else the
behaviour's ``commit``, then sync. What differs between a replicated directory, a merge, a versioned
target and a checkpoint step is this object, which the back end picks (``ExchangeRename``,
``RenameAside``, ``Merge``, ``Versioned``; the checkpoint layer's ``StepRename``) and hands in: its
data (which lock, whether a first save may skip it, whether durable saves checksum) and the few things
it does (``check_target``, ``commit``, ``committing`` around the locked part, how the stage's files are
synced, what becomes of a replaced version). It never subclasses the flow. Its ``recover`` (a static
method) is what ``safeio._promotion.leftovers`` calls for what it left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from safeio._errors import InvalidTargetError, TargetExistsError
from safeio._storage.dirfd import fsync_files_below
from safeio._storage.fsops import remove_at
from safeio._storage.readers import version_pointee
from safeio._who import who

if TYPE_CHECKING:
    from safeio._promotion.local import LocalPromotion

logger = logging.getLogger("safeio")


class Behaviour(ABC):
    """How a POSIX stage replaces the target (``commit``) and what recovery does with what a writer killed
    in it left (``recover``, a static method the leftovers' judge calls). Chosen by the back end
    (``safeio._promotion.backends``); ``LocalPromotion.finish`` calls it under the lock, once the stage is
    settled and described, and syncs after it."""

    # A target that does not exist yet becomes the stage by one rename (every behaviour but Versioned).
    renames_fresh_target: ClassVar[bool] = True
    # Whether that rename may happen without the lock (a checkpoint's root needs it for every commit).
    promotes_unlocked: ClassVar[bool] = True
    # Behaviours that remove the old version refuse a target holding the process's own ground.
    guards_own_ground: ClassVar[bool] = False
    # Whether a durable save records a checksum of every file (safeio._storage.digests); a
    # checkpoint's gigabytes of shards are described by their sizes.
    hashes_when_durable: ClassVar[bool] = True
    # Whose promotion lock: None, the target's (``.<name>.safeio.lock`` beside it); a name, that one's.
    lock_name: ClassVar[str | None] = None
    # Whether the lock is taken on the directory itself (a flock on it, locally: no lock file).
    lock_on_directory: ClassVar[bool] = False

    def check_target(self, p: LocalPromotion, found: os.stat_result | None) -> None:
        """Refuse what stands at the target's name (``found``; None: nothing) where this save may not
        replace it: a directory save's target is a directory or a version link safeio made."""
        check_directory_target(p, found, guard_own_ground=self.guards_own_ground)

    @abstractmethod
    def commit(self, p: LocalPromotion, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        """Promote the stage of ``p`` over a target that exists (a directory safeio may replace); one
        that does not ``renames_fresh_target`` is called for a missing target too."""

    @contextlib.contextmanager
    def committing(self, p: LocalPromotion) -> Iterator[None]:
        """Around everything done under the lock (nothing by default: a checkpoint step takes its place
        in commit order before, and points ``latest`` at it after)."""
        del p
        yield

    def commit_point(self) -> None:
        """The last moment before the stage becomes the target (a checkpoint's: see ``StepRename``);
        nothing by default."""
        return None

    def syncs_in_walk(self, p: LocalPromotion) -> bool:
        """Whether the stage's walk fsyncs its files (one open per file), when the save is durable."""
        del p
        return True

    def sync_files(self, p: LocalPromotion) -> None:
        """Durable saves whose files the walk did not sync: every regular file of the stage."""
        fsync_files_below(p.stage_fd)

    def old_version(self, p: LocalPromotion, name: str) -> None:
        """What becomes of the replaced version at ``name`` once the new one is in place: removed."""
        remove_old_version(p, name)

    def keeps_failed_stage(self, p: LocalPromotion, stage: str) -> bool:
        """After a failure: whether the stage must stay for recovery to finish (a merge part-way)."""
        del p, stage
        return False


def remove_old_version(p: LocalPromotion, name: str) -> None:
    """Remove a replaced version after success: a failure here is a warning and a leftover for gc.

    The new version is already in place; raising now would tell every peer the save failed.
    """
    p.phase("cleanup")
    shown = os.path.join(p.parent, name)
    try:
        remove_at(p.parent_fd, name, what="replaced version", shown=shown)
    except OSError as exc:
        logger.warning(
            "%s: %s was promoted, but its old version %s could not be removed (%s); `safeio gc` "
            "removes it later",
            who(p.rank),
            p.target,
            shown,
            exc.strerror or exc,
        )


# -- what a directory save may replace (Behaviour.check_target's default) ----------------------------


def check_directory_target(p: LocalPromotion, st: os.stat_result | None, *, guard_own_ground: bool) -> None:
    """Refuse a foreign symlink, a file, an existing target with mode='error', and (``guard_own_ground``:
    behaviours that remove the old version) a target holding the working or home directory."""
    if st is not None:
        _check_existing(p, st)
    if guard_own_ground:
        refuse_protected_directories(p)


def _check_existing(p: LocalPromotion, st: os.stat_result) -> None:
    target = p.target
    dir_fd = p.parent_fd if p.parent_fd >= 0 else None
    shown = p.name if dir_fd is not None else target
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
    if p.options.mode == "error":
        raise TargetExistsError(f"target {target} already exists and mode='error'", target)


def refuse_protected_directories(p: LocalPromotion) -> None:
    """Behaviours that remove the old version refuse a target that holds the process's own ground.

    ``replicated(".")`` in replace mode would otherwise empty the working directory it runs in.
    """
    if p.stage_fd >= 0:
        return  # checked before the stage was made; the working and home directories are the caller's
    target = p.target
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
                f"refusing mode={p.options.mode!r} for {target}: it is or contains {what} {path}, "
                "which replacing it would delete (save into a subdirectory, or use mode='merge')",
                target,
            )


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # the working directory was removed
        return None
