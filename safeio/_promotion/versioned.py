"""Versioned: the target is a symlink to an immutable version directory beside it.

A new version is published by creating a new symlink and renaming it over the target — atomic on every
POSIX filesystem, NFS included, so the name never disappears. Old versions stay for a grace period
(``SAFEIO_VERSION_GRACE``, 300 s) so that readers that resolved the link finish; ``safeio.snapshot``
resolves it once for readers that need one consistent version. A merge save into a versioned target
hard-links the previous version's other files into the new one (versions are immutable, so sharing
inodes is safe and costs no copy). The link must name a version directory of this target beside it,
opened without following a link: a crafted link or "version" pointing elsewhere is refused, so no file
from outside is ever linked into a version others read.
"""

from __future__ import annotations

import os
import stat
import time
from typing import Any

from safeio._errors import InvalidTargetError
from safeio._options import version_grace
from safeio._promotion.behaviour import Behaviour
from safeio._promotion.local import LocalPromotion
from safeio._promotion.recovery_records import Action, tree_size
from safeio._storage import manifest
from safeio._storage.claims import claimed
from safeio._storage.dirfd import lstat_at, open_directory, open_relative_directory, walk_files
from safeio._storage.fsops import remove_at
from safeio._storage.metadata import Damaged, load_manifest
from safeio._storage.names import parse, sibling_name
from safeio._storage.readers import version_pointee

KEEP_VERSIONS = 2


class Versioned(Behaviour):
    renames_fresh_target = False  # even a first save publishes a version through a link
    guards_own_ground = True

    def commit(self, p: LocalPromotion, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        """Publish the stage as a new version, whether the target exists or not."""
        pfd, name = p.parent_fd, p.name
        merge = p.options.mode == "merge"
        previous = self._open_current_version(p) if merge else None
        try:
            if previous is not None:
                entries = {**self._link_previous_files(p, previous), **entries}
            p.write_manifest(entries, previous)
        finally:
            if previous is not None:
                os.close(previous)
        p.seal_stage()
        version_name = sibling_name(name, "v")
        os.rename(p.stage_name, version_name, src_dir_fd=pfd, dst_dir_fd=pfd)
        if not p.promoted_is_stage(version_name):  # never link the target to what someone swapped in
            os.rename(version_name, p.stage_name, src_dir_fd=pfd, dst_dir_fd=pfd)
            raise p.swapped_stage_error()
        st = lstat_at(pfd, name)
        if st is not None and stat.S_ISDIR(st.st_mode):
            # First versioned save over a plain directory: it becomes a version too (the name is missing
            # for an instant this once; every later save swaps a symlink).
            os.rename(name, sibling_name(name, "v"), src_dir_fd=pfd, dst_dir_fd=pfd)
        with claimed(sibling_name(name, "link")) as link:
            os.symlink(version_name, link, dir_fd=pfd)
            os.replace(link, name, src_dir_fd=pfd, dst_dir_fd=pfd)
        if p.options.durable:
            os.fsync(pfd)
        p.phase("cleanup")
        prune(p.parent, pfd, name, grace=p.options.version_grace)

    def _open_current_version(self, p: LocalPromotion) -> int | None:
        """The current version directory (or the plain directory a first versioned save replaces)."""
        st = lstat_at(p.parent_fd, p.name)
        if st is None:
            return None
        current = p.name
        if stat.S_ISLNK(st.st_mode):
            pointee = version_pointee(p.name, dir_fd=p.parent_fd)
            if pointee is None:  # check_target refuses it too; the link changed since
                raise InvalidTargetError(f"target {p.target} links somewhere safeio did not make", p.target)
            current = pointee
        try:
            return open_directory(current, dir_fd=p.parent_fd)
        except OSError as exc:
            raise InvalidTargetError(
                f"the version {current} that {p.target} links to is not a directory safeio made "
                f"({exc.strerror or exc}); refusing to read from it",
                p.target,
            ) from exc

    def _link_previous_files(self, p: LocalPromotion, previous_fd: int) -> dict[str, dict[str, Any]]:
        staged = set(manifest.content_files(p.stage_fd))
        old = load_manifest(previous_fd, manifest.MANIFEST_NAME)
        old_files = old["files"] if old is not None and not isinstance(old, Damaged) else {}
        kept: dict[str, dict[str, Any]] = {}
        for rel_dir, fd, name, st in walk_files(previous_fd):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if rel in staged or rel in manifest.BOOKKEEPING:
                continue
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                continue
            dst = open_relative_directory(p.stage_fd, rel_dir, create=True)
            try:
                os.link(name, name, src_dir_fd=fd, dst_dir_fd=dst, follow_symlinks=False)
            finally:
                os.close(dst)
            if rel in old_files:
                kept[rel] = old_files[rel]
        return kept


def versioned_targets(parent_fd: int, target_name: str | None, listing: list[str] | None = None) -> list[str]:
    """The versioned targets in the directory (only ``target_name``, if given). With the directory's
    ``listing``, only names that have a version directory beside them are read as links: a checkpoint
    root of thousands of steps is not a thousand readlinks."""
    if target_name is not None:
        names = [target_name]
    else:
        listing = sorted(os.listdir(parent_fd)) if listing is None else listing
        versions = [s for s in map(parse, listing) if s is not None and s.kind == "v"]
        names = [name for name in listing if any(v.belongs_to(name) for v in versions)]
    return [name for name in names if version_pointee(name, dir_fd=parent_fd) is not None]


def prune(
    parent: str,
    parent_fd: int,
    target_name: str,
    *,
    dry_run: bool = False,
    now: float | None = None,
    grace: float | None = None,
) -> list[Action]:
    """Remove versions of a versioned target that no reader can still be using.

    Kept: the current version, the ``KEEP_VERSIONS`` newest, and any younger than the grace period (a
    reader that resolved the link just before the swap is still loading from its version).
    """
    now = time.time() if now is None else now
    grace = version_grace() if grace is None else grace
    current = version_pointee(target_name, dir_fd=parent_fd)
    versions: list[tuple[float, str]] = []
    for name in os.listdir(parent_fd):
        sibling = parse(name)
        if sibling is not None and sibling.kind == "v" and sibling.belongs_to(target_name):
            st = lstat_at(parent_fd, name)
            if st is not None:
                versions.append((st.st_mtime, name))
    versions.sort(reverse=True)
    actions = []
    for index, (mtime, name) in enumerate(versions):
        if name == current or index < KEEP_VERSIONS or now - mtime < grace:
            continue
        path = os.path.join(parent, name)
        size = tree_size(parent_fd, name)
        if not dry_run:
            remove_at(parent_fd, name, what="old version", shown=path)
        actions.append(Action("remove", path, f"old version, {now - mtime:.0f} s old", size))
    return actions
