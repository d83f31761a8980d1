"""Putting a target right after a writer died, and finding safeio's leftovers.

Used by the writer before it promotes (for its own target, under the promotion lock) and by
``safeio gc`` (for a whole directory). Only names that parse as safeio siblings are ever touched, and
never one whose owner is alive on this host.

What a dead writer can leave, and what recovery does:
- a stage without intent (killed before promotion, or after an exchange, when the stage holds the old
  version): removed;
- a stage with a merge intent (killed between two file replacements): rolled forward, so the target
  ends up with the whole new set;
- an old version renamed aside (replace fallback): put back if the target is missing, else removed;
- temporary files and links: removed; version directories: pruned once no link points at them and
  they are past the grace period.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass

from safeio import active, manifest
from safeio._who import who
from safeio.fsops import remove_tree
from safeio.names import Sibling, host_tag, parse, truncated_base
from safeio.storage import fsync_path

logger = logging.getLogger("safeio")

VERSION_GRACE = float(os.environ.get("SAFEIO_VERSION_GRACE", "300"))
KEEP_VERSIONS = 2


@dataclass(frozen=True)
class Action:
    """Something recovery did (or, in a dry run, would do)."""

    verb: str  # "remove", "restore", "roll-forward", "skip"
    path: str
    reason: str
    size: int = 0


def tree_size(path: str) -> int:
    if os.path.islink(path) or not os.path.isdir(path):
        try:
            return os.lstat(path).st_size
        except OSError:
            return 0
    total = 0
    for dirpath, _dirnames, filenames in os.walk(path):
        for name in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def read_merge_intent(stage: str) -> dict[str, object] | None:
    try:
        with open(os.path.join(stage, manifest.MERGE_INTENT_NAME), encoding="utf-8") as f:
            intent = json.load(f)
    except (OSError, ValueError):
        return None
    return intent if isinstance(intent, dict) and isinstance(intent.get("files"), list) else None


def roll_merge_forward(stage: str, target: str, files: list[str], *, durable: bool) -> None:
    """Replace every file of ``files`` still in ``stage`` into ``target``, in order, then drop the stage."""
    touched: set[str] = set()
    for rel in files:
        src = os.path.join(stage, *rel.split("/"))
        if not os.path.lexists(src):
            continue  # replaced before the crash
        dst = os.path.join(target, *rel.split("/"))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.replace(src, dst)
        touched.add(os.path.dirname(dst))
    if durable:
        for directory in sorted(touched, key=len, reverse=True):
            fsync_path(directory, directory=True)
    remove_tree(stage, what="merged stage")


def _is_stale(sibling: Sibling, path: str, older_than: float | None, now: float) -> tuple[bool, str]:
    alive = sibling.owner_is_alive()
    if alive and sibling.pid == os.getpid() and sibling.host == host_tag():
        # Our own: stale unless a save in this process is using it right now (an aside left behind by
        # an earlier save because NFS silly-renamed files kept it, say).
        if active.is_active_stage(path):
            return False, "a save in this process is using it"
        alive = False
    if alive:
        return False, f"owner pid {sibling.pid} is alive"
    try:
        age = now - os.lstat(path).st_mtime
    except OSError:
        return False, "vanished"
    if older_than is not None and age < older_than:
        return False, f"younger than {older_than:g} s"
    if alive is None:
        if older_than is None:
            return False, "owner on another host (pass an age to remove it)"
        return True, f"owner on another host, {age:.0f} s old"
    return True, f"owner pid {sibling.pid} is gone"


def recover_directory(
    parent: str,
    *,
    target_name: str | None = None,
    older_than: float | None = None,
    dry_run: bool = False,
    durable: bool = True,
) -> list[Action]:
    """Recover every stale safeio sibling in ``parent`` (only ``target_name``'s, if given)."""
    try:
        names = sorted(os.listdir(parent))
    except FileNotFoundError:
        return []
    now = time.time()
    actions: list[Action] = []
    candidates = (parse(name) for name in names if ".safeio-" in name)
    siblings = [(s, os.path.join(parent, s.name)) for s in candidates if s is not None]
    if target_name is not None:
        siblings = [(s, p) for s, p in siblings if s.belongs_to(target_name)]
    # Merges first (they complete targets), then asides (they restore missing ones), then the rest.
    order = {"stage": 0, "old": 1}
    siblings.sort(key=lambda sp: order.get(sp[0].kind, 2))
    for sibling, path in siblings:
        if sibling.kind == "v":
            continue  # versions are pruned by prune_versions, not by owner liveness
        stale, reason = _is_stale(sibling, path, older_than, now)
        if not stale:
            continue
        actions.append(_recover_one(sibling, path, parent, target_name, reason, dry_run, durable))
    for base_target in _versioned_targets(parent, target_name):
        actions.extend(prune_versions(parent, base_target, dry_run=dry_run, now=now))
    return actions


def _target_for(sibling: Sibling, parent: str, target_name: str | None) -> str | None:
    if target_name is not None:
        return os.path.join(parent, target_name)
    if truncated_base(sibling.base) == sibling.base and len(sibling.base.encode()) < 200:
        return os.path.join(parent, sibling.base)
    return None  # the name was truncated: the target cannot be told from it


def _recover_one(
    sibling: Sibling,
    path: str,
    parent: str,
    target_name: str | None,
    reason: str,
    dry_run: bool,
    durable: bool,
) -> Action:
    size = tree_size(path)
    if sibling.kind == "stage":
        intent = read_merge_intent(path)
        if intent is not None:
            target = os.path.join(parent, str(intent.get("target_name", "")))
            if target_name is not None and intent.get("target_name") != target_name:
                return Action("skip", path, "merge intent of another target")
            if not dry_run:
                listed = intent["files"]
                files = [str(f) for f in listed] if isinstance(listed, list) else []
                roll_merge_forward(path, target, files, durable=durable)
                logger.warning("%s: rolled an interrupted merge forward into %s (%s)", who(), target, reason)
            return Action("roll-forward", path, f"interrupted merge into {target}; {reason}", size)
    if sibling.kind == "old":
        old_of = _target_for(sibling, parent, target_name)
        if old_of is None:
            return Action("skip", path, "old version of a target whose long name was truncated")
        if not os.path.lexists(old_of):
            if not dry_run:
                os.rename(path, old_of)
                if durable:
                    fsync_path(parent, directory=True)
                logger.warning(
                    "%s: restored the previous version of %s from %s (%s)", who(), old_of, path, reason
                )
            return Action("restore", path, f"the target {old_of} was missing; {reason}", size)
    if not dry_run:
        remove_tree(path, what=f"stale {sibling.kind}")
    return Action("remove", path, reason, size)


def _versioned_targets(parent: str, target_name: str | None) -> list[str]:
    names = [target_name] if target_name is not None else sorted(os.listdir(parent))
    found = []
    for name in names:
        full = os.path.join(parent, name)
        if os.path.islink(full):
            sibling = parse(os.readlink(full))
            if sibling is not None and sibling.kind == "v" and "/" not in os.readlink(full):
                found.append(name)
    return found


def prune_versions(
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
    grace = VERSION_GRACE if grace is None else grace
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
