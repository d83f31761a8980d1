"""Promotion: turning a finished stage into the target, atomically.

``Promoter`` owns the flow every back-end shares (open a stage; finish it: permissions, sync,
describe, lock, promote; or discard it). ``LocalPromoter`` renames on a POSIX filesystem (NFS
included); ``safeio.remote.RemotePromoter`` uploads under a commit marker for object stores.
``promoter_for`` picks one from the target, like orbax's mode-to-class map.

Local promotion by mode, with the target present:
- ``replace``: ``renameat2(RENAME_EXCHANGE)`` swaps stage and target in one step; where the filesystem
  refuses it (NFS, FUSE) the old target is renamed aside, the stage renamed in, and the old one removed.
  Readers may see the name missing for that instant — never a partial directory — and a writer killed
  in it leaves the old version aside, which the next save or ``safeio gc`` puts back.
- ``merge``: each file is ``os.replace``d into the existing directory (never truncated in place), other
  files stay. The stage records the intent first, so a crash part-way is rolled forward later.
- ``versioned``: the target is a symlink to an immutable version directory beside it; a new version is
  published by renaming a new symlink over it, which is atomic on every POSIX filesystem, NFS included.
- ``error``: ``TargetExistsError`` before the body runs.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Literal

from safeio import manifest
from safeio._who import who
from safeio.errors import InvalidTargetError, PromotionError, SafeIOError, TargetExistsError
from safeio.fsops import normalize_permissions, remove_tree
from safeio.locking import LockSetting, held, lock_path_for, make_lock
from safeio.names import parse, sibling_name
from safeio.recovery import prune_versions, recover_directory, roll_merge_forward
from safeio.storage import EXCHANGE_UNSUPPORTED, RENAME_EXCHANGE, Location, fsync_path, fsync_tree, renameat2

logger = logging.getLogger("safeio")

Mode = Literal["replace", "versioned", "merge", "error"]
MODES: tuple[str, ...] = ("replace", "versioned", "merge", "error")
PhaseHook = Callable[[str], None]

# Filesystems (by st_dev) on which RENAME_EXCHANGE was refused: warn once, then go straight to the fallback.
_no_exchange: set[int] = set()


class Promoter(ABC):
    """The flow of one writer-side save; subclasses fill in the back-end steps."""

    def __init__(
        self,
        location: Location,
        *,
        mode: Mode,
        durable: bool,
        lock: LockSetting,
        write_manifest: bool,
        timeout: float,
        rank: int,
        call_id: str,
        on_phase: PhaseHook | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        self.location = location
        self.mode = mode
        self.durable = durable
        self.lock = lock
        self.write_manifest = write_manifest
        self.timeout = timeout
        self.rank = rank
        self.call_id = call_id
        self._on_phase = on_phase
        self._started = time.monotonic()  # peers' waits began about now (see lock_timeout)
        self.result: Any = None  # the body's result (JSON form), recorded in the manifest
        # The manifest's call id when a peer entered the save: any other complete version seen later
        # was promoted since, by our writer or a newer save (a rival job's), and ends the wait.
        self.seen_at_start: object = None

    def lock_timeout(self) -> float:
        """What is left of ``timeout`` for the lock, minus a margin to publish the outcome.

        Peers wait ``timeout`` from about when this save began; a writer that waited the full
        ``timeout`` for a rival's lock after its body would report LockTimeout after every peer had
        given up with a PeerTimeout that hides why (seen with 8 ranks and a rival holding the lock).
        """
        margin = min(1.0, 0.05 * self.timeout)
        return max(0.01, self.timeout - (time.monotonic() - self._started) - margin)

    def phase(self, name: str) -> None:
        if self._on_phase is not None:
            self._on_phase(name)

    @abstractmethod
    def open_stage(self) -> str:
        """Check the target and create the writer's private stage; return its local path."""

    @abstractmethod
    def finish(self, stage: str) -> None:
        """Sync, describe and promote ``stage``; on return the target is the new version."""

    @abstractmethod
    def discard(self, stage: str) -> None:
        """Remove ``stage`` after a failure (the target is untouched)."""

    @abstractmethod
    def landed(self) -> bool:
        """Whether this save's result is visible and complete at the target (for store-less peers)."""

    @abstractmethod
    def current_call(self) -> object:
        """The call id in the target's manifest now (None if there is none)."""

    def is_newer(self, recorded: object) -> bool:
        """Whether a complete version with call id ``recorded`` shows this save has happened."""
        if call_covers(recorded, self.call_id):
            return True
        return recorded is not None and recorded != self.seen_at_start

    @abstractmethod
    def recorded_result(self) -> Any:
        """The writer's result as recorded in the target's manifest (for store-less peers)."""

    def describe(self, stage: str) -> dict[str, dict[str, Any]]:
        # Hashes only when durable: see safeio.manifest for the cost.
        return manifest.describe_files(stage, hashes=self.durable)


def _os_error(message: str, path: str, exc: OSError) -> SafeIOError:
    if exc.errno in (errno.ENOTDIR, errno.EEXIST) and "parent" in message:
        return InvalidTargetError(f"{message}: a component of the path is not a directory ({exc})", path)
    return PromotionError(f"{message}: {exc.strerror or exc}", path, errno=exc.errno)


def _is_version_link(path: str) -> bool:
    if not os.path.islink(path):
        return False
    pointee = os.readlink(path)
    sibling = parse(pointee)
    return "/" not in pointee and sibling is not None and sibling.kind == "v"


class LocalPromoter(Promoter):
    """Stage beside the target on its own filesystem and promote with rename(2)."""

    @property
    def target(self) -> str:
        return self.location.path

    @property
    def parent(self) -> str:
        return self.location.parent

    def _check_target(self) -> None:
        target = self.target
        if os.path.islink(target) and not _is_version_link(target):
            raise InvalidTargetError(
                f"target {target} is a symlink safeio did not create; safeio never writes through or "
                "replaces a foreign symlink (resolve it yourself and pass the real path)",
                target,
            )
        if os.path.lexists(target) and not os.path.isdir(target):
            raise InvalidTargetError(
                f"target {target} exists and is not a directory: a replicated target is a directory "
                "(use safeio.atomic_open for a single file)",
                target,
            )
        if self.mode == "error" and os.path.lexists(target):
            raise TargetExistsError(f"target {target} already exists and mode='error'", target)

    def open_stage(self) -> str:
        self._check_target()
        parent = self.parent
        try:
            os.makedirs(parent, exist_ok=True)
        except FileExistsError as exc:
            raise InvalidTargetError(
                f"the parent of {self.target} is not a directory: {parent}", parent
            ) from exc
        except NotADirectoryError as exc:
            raise InvalidTargetError(
                f"the parent of {self.target} cannot be created: a component of {parent} is a file",
                parent,
            ) from exc
        except OSError as exc:
            raise _os_error(f"cannot create the parent directory {parent}", parent, exc) from exc
        stage = os.path.join(parent, sibling_name(self.location.name, "stage"))
        try:
            os.mkdir(stage, 0o777)  # the umask applies, as for any mkdir (mkdtemp would force 0700)
        except OSError as exc:
            raise _os_error(f"cannot create a stage for {self.target} in {parent}", self.target, exc) from exc
        logger.debug("%s: stage %s created for %s", who(self.rank), stage, self.target)
        return stage

    def discard(self, stage: str) -> None:
        remove_tree(stage, what="failed stage")

    def finish(self, stage: str) -> None:
        try:
            self.phase("manifest")  # describing the stage reads (and, if durable, hashes) every file
            normalize_permissions(stage)
            entries = self.describe(stage) if self.write_manifest else {}
            self.phase("fsync")
            if self.durable:
                fsync_tree(stage)
            self.phase("lock")
            lock = make_lock(lock_path_for(self.parent, self.location.name), self.lock, self.lock_timeout())
            with held(lock, self.target, self.rank):
                self.phase("promote")
                self._check_target()
                recover_directory(self.parent, target_name=self.location.name, durable=self.durable)
                self._promote(stage, entries)
                if self.durable:
                    fsync_path(self.parent, directory=True)
        except OSError as exc:
            if isinstance(exc, SafeIOError):
                raise
            raise _os_error(f"could not promote {self.target}", self.target, exc) from exc
        logger.debug("%s: promoted %s (mode %s)", who(self.rank), self.target, self.mode)

    def _write_manifest(self, stage: str, entries: dict[str, dict[str, Any]], previous: str | None) -> None:
        if not self.write_manifest:
            return
        old = manifest.read(previous) if previous is not None else None
        record = manifest.build(entries, rank=self.rank, call=self.call_id, previous=old, result=self.result)
        manifest.write(stage, record, durable=self.durable)

    def _promote(self, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        target = self.target
        exists = os.path.lexists(target)
        if self.mode == "versioned" or (exists and _is_version_link(target)):
            self._promote_versioned(stage, entries)
        elif not exists:
            self._write_manifest(stage, entries, None)
            os.rename(stage, target)
        elif self.mode == "merge":
            self._promote_merge(stage, entries)
        else:
            self._write_manifest(stage, entries, None)
            self._promote_replace(stage)

    # -- replace ---------------------------------------------------------------------------------

    def _promote_replace(self, stage: str) -> None:
        target = self.target
        device = os.stat(self.parent).st_dev
        if device not in _no_exchange and not os.environ.get("SAFEIO_NO_EXCHANGE"):
            try:
                renameat2(stage, target, RENAME_EXCHANGE)
            except OSError as exc:
                if exc.errno not in EXCHANGE_UNSUPPORTED:
                    raise
                _no_exchange.add(device)
                logger.warning(
                    "%s: the filesystem of %s refuses RENAME_EXCHANGE (%s): replacing by renaming the "
                    "old version aside; readers may see the name missing for an instant (mode='versioned' "
                    "avoids that)",
                    who(self.rank),
                    target,
                    exc.strerror,
                )
            else:
                # The stage's name now holds the old version.
                self.phase("cleanup")
                remove_tree(stage, what="replaced version")
                return
        self._replace_aside(stage)

    def _replace_aside(self, stage: str) -> None:
        target = self.target
        aside = os.path.join(self.parent, sibling_name(self.location.name, "old"))
        os.rename(target, aside)
        try:
            os.rename(stage, target)
        except BaseException:
            os.rename(aside, target)  # put the old version back before reporting the failure
            raise
        if self.durable:
            fsync_path(self.parent, directory=True)
        self.phase("cleanup")
        remove_tree(aside, what="replaced version")

    # -- merge -----------------------------------------------------------------------------------

    def _promote_merge(self, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        target = self.target
        self._write_manifest(stage, entries, target)
        files = manifest.content_files(stage)
        if self.write_manifest:
            files.append(manifest.MANIFEST_NAME)  # last: it describes the whole set
        self._check_merge_conflicts(files)
        intent = {"target_name": self.location.name, "files": files}
        intent_path = os.path.join(stage, manifest.MERGE_INTENT_NAME)
        with open(intent_path, "x", encoding="utf-8") as f:
            json.dump(intent, f)
            if self.durable:
                f.flush()
                os.fsync(f.fileno())
        if self.durable:
            fsync_path(stage, directory=True)
        roll_merge_forward(stage, target, files, durable=self.durable)

    def _check_merge_conflicts(self, files: list[str]) -> None:
        for rel in files:
            parts = rel.split("/")
            for depth in range(1, len(parts)):
                prefix = os.path.join(self.target, *parts[:depth])
                if os.path.lexists(prefix) and not os.path.isdir(prefix):
                    raise InvalidTargetError(
                        f"cannot merge {rel} into {self.target}: {prefix} is a file there", self.target
                    )
            dest = os.path.join(self.target, *parts)
            if os.path.isdir(dest) and not os.path.islink(dest):
                raise InvalidTargetError(
                    f"cannot merge {rel} into {self.target}: it is a directory there", self.target
                )

    # -- versioned -------------------------------------------------------------------------------

    def _promote_versioned(self, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        target, parent, name = self.target, self.parent, self.location.name
        current = os.path.realpath(target) if os.path.lexists(target) else None
        if self.mode == "merge" and current is not None:
            entries = {**self._link_previous_files(current, stage), **entries}
        self._write_manifest(stage, entries, current if self.mode == "merge" else None)
        if self.durable:
            fsync_path(stage, directory=True)
        version_name = sibling_name(name, "v")
        os.rename(stage, os.path.join(parent, version_name))
        if os.path.lexists(target) and not os.path.islink(target):
            # First versioned save over a plain directory: it becomes a version too (the name is missing
            # for an instant this once; every later save swaps a symlink).
            os.rename(target, os.path.join(parent, sibling_name(name, "v")))
        link = os.path.join(parent, sibling_name(name, "link"))
        os.symlink(version_name, link)
        os.replace(link, target)
        if self.durable:
            fsync_path(parent, directory=True)
        self.phase("cleanup")
        prune_versions(parent, name)

    def _link_previous_files(self, previous: str, stage: str) -> dict[str, dict[str, Any]]:
        """Merge into a versioned target: hard-link the previous version's other files into the stage
        (versions are immutable, so sharing inodes is safe and costs no copy)."""
        staged = set(manifest.content_files(stage))
        old_manifest = manifest.read(previous) or {"files": {}}
        kept: dict[str, dict[str, Any]] = {}
        for rel in manifest.content_files(previous):
            if rel in staged:
                continue
            dst = os.path.join(stage, *rel.split("/"))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.link(os.path.join(previous, *rel.split("/")), dst)
            if rel in old_manifest["files"]:
                kept[rel] = old_manifest["files"][rel]
        return kept

    def landed(self) -> bool:
        directory = self.target
        if not os.path.isdir(directory):
            return False
        if not self.write_manifest:
            return True
        record = manifest.read(directory)
        return (
            record is not None
            and self.is_newer(record.get("call"))
            and not manifest.problems(directory, record, check_hashes=False)
        )

    def current_call(self) -> object:
        record = manifest.read(self.target)
        return record.get("call") if record else None

    def recorded_result(self) -> Any:
        record = manifest.read(self.target)
        return record.get("result") if record else None


def call_covers(recorded: object, awaited: str) -> bool:
    """Whether a manifest written by save ``recorded`` shows that save ``awaited`` has happened.

    Call ids are ``job/target-digest/sequence``. A later save of the same target in the same job also
    counts: the writer may have saved twice and exited before a slow peer looked (its store gone).
    """
    if not isinstance(recorded, str):
        return False
    if recorded == awaited:
        return True
    job, _, seq = recorded.rpartition("/")
    awaited_job, _, awaited_seq = awaited.rpartition("/")
    return job == awaited_job and seq.isdigit() and awaited_seq.isdigit() and int(seq) >= int(awaited_seq)


def promoter_for(location: Location, **options: Any) -> Promoter:
    if location.is_local:
        return LocalPromoter(location, **options)
    from safeio.remote import RemotePromoter

    return RemotePromoter(location, **options)
