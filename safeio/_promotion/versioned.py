"""Versioned: the target is a symlink to an immutable version directory beside it.

A new version is published by creating a new symlink and renaming it over the target — atomic on every
POSIX filesystem, NFS included, so the name never disappears. Old versions stay for a grace period
(``SAFEIO_VERSION_GRACE``, 300 s) so that readers that resolved the link finish; ``safeio.snapshot``
resolves it once for readers that need one consistent version. A merge save into a versioned target
hard-links the previous version's other files into the new one (versions are immutable, so sharing
inodes is safe and costs no copy).
"""

from __future__ import annotations

import os
import time
from typing import Any

from safeio._options import version_grace
from safeio._promotion.local import LocalPromotion
from safeio._promotion.recovery import Action, tree_size
from safeio._storage import manifest
from safeio._storage.fsops import remove_tree
from safeio._storage.names import parse, sibling_name
from safeio._storage.posix import fsync_path
from safeio._storage.readers import is_version_link

KEEP_VERSIONS = 2


class Versioned(LocalPromotion):
    def check_target(self) -> None:
        super().check_target()
        self.refuse_protected_directories()

    def _promote(self, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        target, parent, name = self.target, self.parent, self.name
        merge = self.options.mode == "merge"
        current = os.path.realpath(target) if os.path.lexists(target) else None
        if merge and current is not None:
            entries = {**self._link_previous_files(current, stage), **entries}
        self.write_manifest(stage, entries, current if merge else None)
        if self.options.durable:
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
        if self.options.durable:
            fsync_path(parent, directory=True)
        self.phase("cleanup")
        prune(parent, name)

    def _replace_existing(self, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        self._promote(stage, entries)  # _promote handles a present and an absent target alike

    def _link_previous_files(self, previous: str, stage: str) -> dict[str, dict[str, Any]]:
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


def versioned_targets(parent: str, target_name: str | None) -> list[str]:
    """The versioned targets in ``parent`` (only ``target_name``, if given)."""
    names = [target_name] if target_name is not None else sorted(os.listdir(parent))
    return [name for name in names if is_version_link(os.path.join(parent, name))]


def prune(
    parent: str,
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
    link = os.path.join(parent, target_name)
    current = os.readlink(link) if os.path.islink(link) else None
    versions: list[tuple[float, str]] = []
    for name in os.listdir(parent):
        sibling = parse(name)
        if sibling is not None and sibling.kind == "v" and sibling.belongs_to(target_name):
            versions.append((os.lstat(os.path.join(parent, name)).st_mtime, name))
    versions.sort(reverse=True)
    actions = []
    for index, (mtime, name) in enumerate(versions):
        if name == current or index < KEEP_VERSIONS or now - mtime < grace:
            continue
        path = os.path.join(parent, name)
        size = tree_size(path)
        if not dry_run:
            remove_tree(path, what="old version")
        actions.append(Action("remove", path, f"old version, {now - mtime:.0f} s old", size))
    return actions
