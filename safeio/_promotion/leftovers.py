"""Finding what dead writers left beside a target, judging it, and handing it to its behaviour.

Used by the writer before it promotes (for its own target, under the promotion lock) and by ``safeio
gc`` (for a whole directory). Only names that parse as safeio siblings are ever touched, and never one
whose owner may be alive. Each behaviour holds its own recovery:
- a stage with a merge intent (killed between two file replacements): ``Merge.recover`` rolls it forward;
- an old version renamed aside: ``RenameAside.recover`` puts it back if the target is missing;
- version directories: ``versioned.prune`` once no link points at them and they are past the grace;
- anything else (a stage without intent, a temporary file or link): removed.
Everything is relative to the held parent directory: nothing here follows a link someone planted.

Ownership is part of liveness: a leftover whose owner is not its target's is never rolled forward,
restored, merged from or removed — by a save, by recovery, or by root's ``safeio gc`` — only reported with
its owner. Without a target, the owners that count are the parent directory's and this process's: another
user's killed save in a shared directory is theirs to clean up.
"""

from __future__ import annotations

import logging
import os
import time

from safeio._errors import SafeIOError
from safeio._promotion.aside import RenameAside
from safeio._promotion.merge import Merge
from safeio._promotion.recovery_records import Action, Leftover
from safeio._promotion.versioned import prune, versioned_targets
from safeio._storage import claims
from safeio._storage.dirfd import held_directory, lstat_at
from safeio._storage.fsops import remove_at
from safeio._storage.names import Sibling, host_tag, may_have_siblings, parse
from safeio._who import who

logger = logging.getLogger("safeio")

# Merges first (they complete targets), then asides (they restore missing ones), then the rest.
_ORDER = {"stage": 0, "old": 1}


def owners_that_count(parent_fd: int, listing: list[str], sibling: Sibling) -> frozenset[int]:
    """Whose leftover ``sibling`` may be recovered: its target's owner when the target is there, else
    the parent directory's owner and this process's euid."""
    for name in listing:
        if parse(name) is None and sibling.belongs_to(name):
            st = lstat_at(parent_fd, name)
            if st is not None:
                return frozenset({st.st_uid})
    return frozenset({os.fstat(parent_fd).st_uid, os.geteuid()})


def staleness(
    sibling: Sibling,
    parent: str,
    parent_fd: int | None,
    older_than: float | None,
    now: float,
    owners: frozenset[int] | None = None,
) -> tuple[bool, str]:
    """Whether a sibling may be recovered now, and why (or why not). ``owners``: the uids whose
    leftovers this may recover (see ``owners_that_count``); None: any."""
    if sibling.kind == "v":
        return False, "version directory in use, among the newest, or within its grace period"
    st = lstat_at(parent_fd, sibling.name) if parent_fd is not None else _lstat(parent, sibling.name)
    if st is None:
        return False, "vanished"
    if owners is not None and st.st_uid not in owners:
        allowed = ", ".join(map(str, sorted(owners)))
        return False, (
            f"owned by uid {st.st_uid}, while only uid {allowed} may have it recovered here: never rolled "
            "forward, restored or removed for anyone else; its owner's `safeio gc` removes it"
        )
    alive = sibling.owner_is_alive()
    if alive and sibling.pid == os.getpid() and sibling.host == host_tag():
        # Our own: stale unless a save in this process is using it right now (an aside left behind by
        # an earlier save because NFS silly-renamed files kept it, say). Writers claim a name before they
        # create it, so a stage another thread has just made is never judged in the gap.
        if claims.is_claimed(sibling.name):
            return False, "a save in this process is using it"
        alive = False
    if alive:
        return False, f"owner pid {sibling.pid} is alive"
    age = now - st.st_mtime
    if older_than is not None and age < older_than:
        return False, f"{age:.0f} s old, younger than {older_than:g} s"
    if alive is None:
        if older_than is None:
            return False, "owner on another host (pass an age to remove it)"
        return True, f"owner on another host, {age:.0f} s old"
    return True, f"owner pid {sibling.pid} is gone"


def _lstat(parent: str, name: str) -> os.stat_result | None:
    try:
        return os.lstat(os.path.join(parent, name))
    except OSError:
        return None


def recover_directory(
    parent: str,
    *,
    parent_fd: int | None = None,
    target_name: str | None = None,
    older_than: float | None = None,
    dry_run: bool = False,
    durable: bool = True,
    keep_going: bool = False,
    kinds: frozenset[str] | None = None,
) -> list[Action]:
    """Recover every stale safeio sibling in ``parent`` (only ``target_name``'s, if given; only siblings
    of ``kinds``, if given, and then no version directory is pruned).

    ``parent_fd``, if given, is ``parent`` held open; otherwise ``parent`` is opened here. A leftover
    that cannot be recovered (a link planted where its roll-forward needs a directory, say) raises, or
    with ``keep_going`` becomes a ``"failed"`` action and the others are still recovered: a writer must
    not promote over a target it could not put right, while ``gc`` reports and goes on.
    """
    if parent_fd is None:
        try:
            with held_directory(parent, follow=True) as fd:
                return recover_directory(
                    parent,
                    parent_fd=fd,
                    target_name=target_name,
                    older_than=older_than,
                    dry_run=dry_run,
                    durable=durable,
                    keep_going=keep_going,
                    kinds=kinds,
                )
        except FileNotFoundError:
            return []
    now = time.time()
    listing = sorted(os.listdir(parent_fd))
    candidates = (parse(name) for name in listing if ".safeio-" in name)
    siblings = [s for s in candidates if s is not None and s.kind != "v"]
    if target_name is not None:
        siblings = [s for s in siblings if s.belongs_to(target_name)]
    if kinds is not None:
        siblings = [s for s in siblings if s.kind in kinds]
    siblings.sort(key=lambda s: _ORDER.get(s.kind, 2))
    actions: list[Action] = []
    for sibling in siblings:
        owners = owners_that_count(parent_fd, listing, sibling)
        stale, reason = staleness(sibling, parent, parent_fd, older_than, now, owners)
        if not stale:
            if reason.startswith("owned by uid") and not dry_run:
                logger.warning("%s: leaving %s alone: %s", who(), os.path.join(parent, sibling.name), reason)
            continue
        leftover = Leftover(sibling, parent, parent_fd, reason)
        try:
            actions.append(_recover_one(leftover, target_name, dry_run=dry_run, durable=durable))
        except (OSError, SafeIOError) as exc:
            if not keep_going:
                raise
            actions.append(Action("failed", leftover.path, str(exc)))
    if kinds is None:
        for versioned in versioned_targets(parent_fd, target_name, listing):
            actions.extend(prune(parent, parent_fd, versioned, dry_run=dry_run, now=now))
    return actions


TEMPORARY_MARK = ".safeio-tmp-"
_swept: set[tuple[int, int]] = set()  # (device, inode) of the directories this process has swept


def remove_dead_temporaries(parent: str, parent_fd: int, own: str) -> None:
    """A file save's step, at this process's first file save in a directory: the temporary files of file
    saves whose writer is gone, of any target (a save killed while writing step 3's checkpoint leaves its
    temporary file beside the restarted job's save of step 4's), removed by ``safeio gc``'s judgement
    (owner, liveness). Once per directory and process: a listing costs with the directory's size, and a
    save killed later, in another process, is the next process's first save's (or ``gc``'s) to remove.
    Housekeeping: a leftover that cannot be removed is logged, never a failure of the save."""
    st = os.fstat(parent_fd)
    if (st.st_dev, st.st_ino) in _swept:
        return
    _swept.add((st.st_dev, st.st_ino))
    if not any(TEMPORARY_MARK in name and name != own for name in os.listdir(parent_fd)):
        return
    for action in recover_directory(parent, parent_fd=parent_fd, kinds=frozenset({"tmp"}), keep_going=True):
        if action.verb == "failed":
            logger.warning("%s: could not remove %s: %s", who(), action.path, action.reason)


def recover_target(parent: str, parent_fd: int, target_name: str, durable: bool, own_stage: str) -> None:
    """The writer's step before it promotes: put right what dead writers of this target left.

    One listing first: with no sibling of the target but the writer's own stage (almost every save),
    nothing is parsed, statted or judged.
    """
    if may_have_siblings(os.listdir(parent_fd), target_name, besides=own_stage):
        recover_directory(parent, parent_fd=parent_fd, target_name=target_name, durable=durable)


def _recover_one(leftover: Leftover, target_name: str | None, *, dry_run: bool, durable: bool) -> Action:
    kind = leftover.sibling.kind
    if kind == "stage":
        rolled = Merge.recover(leftover, target_name, dry_run=dry_run, durable=durable)
        if rolled is not None:
            return rolled
    elif kind == "old":
        return RenameAside.recover(leftover, target_name, dry_run=dry_run, durable=durable)
    size = leftover.size
    if not dry_run:
        remove_at(leftover.parent_fd, leftover.name, what=f"stale {kind}", shown=leftover.path)
    return Action("remove", leftover.path, leftover.reason, size)
