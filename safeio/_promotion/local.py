"""What every behaviour on a POSIX filesystem (local disk, NFS, Lustre, FUSE) shares.

The stage is a hidden sibling of the target, on the same filesystem, so that promotion is a
``rename(2)``: a directory entry replaced atomically, never a file truncated in place. The lock beside the
target keeps rival writer *jobs* from promoting at the same time; under it, leftovers of dead writers of
the same target are put right before this save promotes. A target that does not exist yet is simply
renamed into place; what happens to an existing one is the behaviour's (``_replace_existing``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

from safeio._boundary import NOT_A_DIRECTORY, os_failure
from safeio._errors import InvalidTargetError, PromotionError, TargetExistsError
from safeio._options import SaveOptions
from safeio._promotion.base import Promotion
from safeio._storage import manifest
from safeio._storage.fsops import normalize_permissions, remove_tree
from safeio._storage.location import Location
from safeio._storage.locking import held, lock_path_for, make_lock
from safeio._storage.names import NAME_MAX, sibling_name
from safeio._storage.posix import fsync_path, fsync_tree
from safeio._storage.readers import is_version_link
from safeio._who import who

logger = logging.getLogger("safeio")

# recover(parent, target_name, durable): puts right what dead writers of the target left. Injected by the
# resolver, because recovery dispatches to every behaviour and behaviours must not import each other.
Recovery = Callable[[str, str, bool], None]


class LocalPromotion(Promotion):
    """Stage beside the target on its own filesystem and promote with rename(2)."""

    def __init__(self, location: Location, options: SaveOptions, *, recover: Recovery, **save: Any) -> None:
        super().__init__(location, options, **save)  # rank, call_id, on_phase
        self._recover = recover

    @property
    def target(self) -> str:
        return self.location.path

    @property
    def parent(self) -> str:
        return self.location.parent

    @property
    def name(self) -> str:
        return self.location.name

    def check_target(self) -> None:
        target = self.target
        if os.path.islink(target) and not is_version_link(target):
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
        if self.options.mode == "error" and os.path.lexists(target):
            raise TargetExistsError(f"target {target} already exists and mode='error'", target)

    def open_stage(self) -> str:
        self.check_target()
        size = len(self.name.encode("utf-8", "surrogateescape"))
        if size > NAME_MAX:
            # Refused before the body runs: the final rename would fail after all the work.
            raise PromotionError(
                f"cannot save {self.target}: its name is {size} bytes, over the {NAME_MAX}-byte limit of "
                "a file name",
                self.target,
                errno=errno.ENAMETOOLONG,
            )
        parent = self.parent
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            if exc.errno in NOT_A_DIRECTORY:
                raise InvalidTargetError(
                    f"the parent of {self.target} cannot be created: {parent} or one of its components "
                    "is a file",
                    parent,
                ) from exc
            raise os_failure(f"cannot create the parent directory {parent}", parent, exc) from exc
        stage = os.path.join(parent, sibling_name(self.name, "stage"))
        try:
            os.mkdir(stage, 0o777)  # the umask applies, as for any mkdir (mkdtemp would force 0700)
        except OSError as exc:
            raise os_failure(
                f"cannot create a stage for {self.target} in {parent}",
                self.target,
                exc,
                invalid=NOT_A_DIRECTORY,
            ) from exc
        logger.debug("%s: stage %s created for %s", who(self.rank), stage, self.target)
        return stage

    def discard(self, stage: str) -> None:
        remove_tree(stage, what="failed stage")

    # -- hooks of the flow -------------------------------------------------------------------------

    def _prepare(self, stage: str) -> dict[str, dict[str, Any]]:
        # Tools write with their own modes (safetensors writes weights 0600 through mkstemp).
        normalize_permissions(stage)
        return super()._prepare(stage)

    def _sync(self, stage: str) -> None:
        if self.options.durable:
            fsync_tree(stage)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        lock = make_lock(lock_path_for(self.parent, self.name), self.options.lock, self.lock_timeout())
        with held(lock, self.target, self.rank):
            yield

    def _before_promote(self) -> None:
        self.check_target()  # a rival job may have changed it while our body ran
        self._recover(self.parent, self.name, self.options.durable)

    def _promote(self, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        if os.path.lexists(self.target):
            self._replace_existing(stage, entries)
            return
        self.write_manifest(stage, entries, None)
        os.rename(stage, self.target)

    def _after_promote(self) -> None:
        if self.options.durable:
            fsync_path(self.parent, directory=True)

    @abstractmethod
    def _replace_existing(self, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        """Promote ``stage`` over a target that exists (a directory safeio may replace)."""

    # -- shared by local behaviours ------------------------------------------------------------------

    def refuse_protected_directories(self) -> None:
        """Behaviours that remove the old version refuse a target that holds the process's own ground.

        ``replicated(".")`` in replace mode would otherwise empty the working directory it runs in.
        """
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

    def write_manifest(self, stage: str, entries: dict[str, dict[str, Any]], previous: str | None) -> None:
        """Write the manifest into ``stage`` last; ``previous`` (a directory) keeps other objects' entries."""
        if not self.options.manifest:
            return
        old = manifest.read(previous) if previous is not None else None
        manifest.write(stage, self.manifest_record(entries, old), durable=self.options.durable)

    def remove_old_version(self, path: str) -> None:
        """Remove a replaced version after success: a failure here is a warning and a leftover for gc.

        The new version is already in place; raising now would tell every peer the save failed.
        """
        self.phase("cleanup")
        try:
            remove_tree(path, what="replaced version")
        except OSError as exc:
            logger.warning(
                "%s: %s was promoted, but its old version %s could not be removed (%s); `safeio gc` "
                "removes it later",
                who(self.rank),
                self.target,
                path,
                exc.strerror or exc,
            )


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # the working directory was removed
        return None
