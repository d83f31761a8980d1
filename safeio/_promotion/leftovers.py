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
user's killed save in a shared directory is theirs to clean up. In a share where this user may not
change another's entries (sticky), a leftover of the target's owner that is not this user's is kept for
its owner when it needs only removing; one whose recovery would change the target (roll forward,
restore), or that cannot be read, blocks the save with an error naming it, its owner and what to do.

One pass over a listing, whatever another user plants in it: the owners that count are looked up once
per directory (``TargetOwners``), and the leftovers left alone are named in one WARNING, not one each
(4,000 planted names made the first file save of a directory take 97 s, issue 34).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass

from safeio._errors import PromotionError, SafeIOError
from safeio._promotion.aside import RenameAside
from safeio._promotion.merge import Merge
from safeio._promotion.recovery_records import Action, Leftover
from safeio._promotion.versioned import prune, versioned_targets
from safeio._storage import claims
from safeio._storage.dirfd import held_directory, lstat_at
from safeio._storage.fsops import remove_at
from safeio._storage.names import Sibling, host_tag, may_have_siblings, parse, truncated_base
from safeio._who import who

logger = logging.getLogger("safeio")

# Merges first (they complete targets), then asides (they restore missing ones), then the rest.
_ORDER = {"stage": 0, "old": 1}


class TargetOwners:
    """Whose leftovers may be recovered in one directory, from one pass over its listing: a sibling's
    target's owner when the target is there, else the directory's owner and this process's euid.

    Built once per listing: judging each sibling against the whole listing was quadratic in the names
    another user can plant (issue 34: 4,000 empty files, 97 s)."""

    def __init__(self, parent_fd: int, listing: Iterable[str]) -> None:
        self._parent_fd = parent_fd
        self._targets: dict[str, str] = {}  # a target's truncated base -> its name (the first, sorted)
        for name in sorted(listing):
            if ".safeio-" not in name or parse(name) is None:
                self._targets.setdefault(truncated_base(name), name)
        self._default: frozenset[int] | None = None

    def of(self, sibling: Sibling) -> frozenset[int]:
        name = self._targets.get(sibling.base)
        if name is not None:
            st = lstat_at(self._parent_fd, name)
            if st is not None:
                return frozenset({st.st_uid})
        if self._default is None:
            self._default = frozenset({os.fstat(self._parent_fd).st_uid, os.geteuid()})
        return self._default


def staleness(
    sibling: Sibling,
    parent: str,
    parent_fd: int | None,
    older_than: float | None,
    now: float,
    owners: frozenset[int] | None = None,
) -> tuple[bool, str]:
    """Whether a sibling may be recovered now, and why (or why not). ``owners``: the uids whose
    leftovers this may recover (see ``TargetOwners``); None: any."""
    if sibling.kind == "v":
        return False, "version directory in use, among the newest, or within its grace period"
    ours = sibling.pid == os.getpid() and sibling.host == host_tag()
    if ours and claims.is_claimed(sibling.name):
        # A save in this process is using it right now (the writer's own stage, beside a target of
        # another user's in a group share: never named as another user's leftover). Writers claim a name
        # before they create it, so a stage another thread has just made is never judged in the gap.
        return False, "a save in this process is using it"
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
    if alive and ours:
        alive = False  # our own, not in use: an aside an earlier save left (NFS silly-renamed files kept it)
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
    options = _Recovering(target_name, older_than, dry_run, durable, keep_going, kinds)
    if parent_fd is not None:
        return _recover_in(parent, parent_fd, options)
    try:
        with held_directory(parent, follow=True) as fd:
            return _recover_in(parent, fd, options)
    except FileNotFoundError:
        return []


@dataclass(frozen=True)
class _Recovering:
    """What ``recover_directory`` was asked (see there)."""

    target_name: str | None
    older_than: float | None
    dry_run: bool
    durable: bool
    keep_going: bool
    kinds: frozenset[str] | None


def _recover_in(parent: str, parent_fd: int, options: _Recovering) -> list[Action]:
    """``recover_directory`` with ``parent`` held open as ``parent_fd``."""
    target_name, older_than, dry_run = options.target_name, options.older_than, options.dry_run
    durable, keep_going, kinds = options.durable, options.keep_going, options.kinds
    now = time.time()
    listing = sorted(os.listdir(parent_fd))
    owners = TargetOwners(parent_fd, listing)
    actions: list[Action] = []
    for sibling in _siblings(listing, target_name, kinds):
        stale, reason = staleness(sibling, parent, parent_fd, older_than, now, owners.of(sibling))
        if not stale:
            if reason.startswith(FOREIGN):
                actions.append(Action("keep", os.path.join(parent, sibling.name), reason))
            continue
        leftover = Leftover(sibling, parent, parent_fd, reason)
        try:
            actions.append(
                _recover_as_this_user(leftover, target_name, dry_run=dry_run, durable=durable, gc=keep_going)
            )
        except (OSError, SafeIOError) as exc:
            if not keep_going:
                raise
            actions.append(Action("failed", leftover.path, str(exc)))
    if not dry_run:
        warn_left_alone([a for a in actions if a.verb == "keep"])
    if kinds is None:
        for versioned in versioned_targets(parent_fd, target_name, listing):
            actions.extend(prune(parent, parent_fd, versioned, dry_run=dry_run, now=now))
    return actions


def _siblings(listing: list[str], target_name: str | None, kinds: frozenset[str] | None) -> list[Sibling]:
    """The safeio siblings in ``listing`` that recovery judges (not version directories: pruned apart),
    only ``target_name``'s and of ``kinds`` where given, in the order they are put right."""
    candidates = (parse(name) for name in listing if ".safeio-" in name)
    siblings = [s for s in candidates if s is not None and s.kind != "v"]
    if target_name is not None:
        siblings = [s for s in siblings if s.belongs_to(target_name)]
    if kinds is not None:
        siblings = [s for s in siblings if s.kind in kinds]
    return sorted(siblings, key=lambda s: _ORDER.get(s.kind, 2))


FOREIGN = "owned by uid"  # how ``staleness`` begins the reason for another user's leftover
_DENIED = frozenset({errno.EPERM, errno.EACCES})


def _recover_as_this_user(
    leftover: Leftover, target_name: str | None, *, dry_run: bool, durable: bool, gc: bool
) -> Action:
    """Recover a stale leftover whose owner counts. One that is not this user's (a group share: its target
    is that user's) may be beyond this user's permissions (a sticky share: EPERM): then one that only
    needs removing is kept for its owner ("keep"), and one whose recovery would change the target (roll a
    merge forward, restore an old version) or cannot be read blocks the target's saves with an error
    naming it, its owner and what to do (``gc`` keeps it, reported as theirs). Before, the save failed with
    "Operation not permitted" naming neither (issue 34 item 7)."""
    uid = _owner(leftover)
    if uid is None or uid == os.geteuid():
        return _recover_one(leftover, target_name, dry_run=dry_run, durable=durable)
    planned: Action | None = None
    try:
        planned = _recover_one(leftover, target_name, dry_run=True, durable=durable)
        return planned if dry_run else _recover_one(leftover, target_name, dry_run=False, durable=durable)
    except (OSError, SafeIOError) as exc:
        denied = _permission_error(exc)
        if denied is None:
            raise
        why, me = denied.strerror or str(denied), os.geteuid()
        if planned is not None and planned.verb == "remove":
            owner_gc = f"uid {uid}'s `safeio gc {leftover.parent}` (or root's) removes it"
            reason = f"{FOREIGN} {uid}, which this user (uid {me}) may not remove here ({why}); {owner_gc}"
            return Action("keep", leftover.path, reason)
        owner_gc = f"uid {uid}'s `safeio gc {leftover.parent}` (or root's) completes or removes it"
        needs = {"roll-forward": "rolled forward", "restore": "restored"}.get(
            planned.verb if planned is not None else "", "read to tell whether it holds a merge to complete"
        )
        if gc:
            reason = f"{FOREIGN} {uid}: it must be {needs}, which uid {me} may not do ({why}); {owner_gc}"
            return Action("keep", leftover.path, reason)
        target = os.path.join(leftover.parent, target_name or leftover.sibling.base)
        raise PromotionError(
            f"cannot save {target}: {leftover.path}, left by a killed save of uid {uid}, must be {needs} "
            f"before the target is saved again, and this user (uid {me}) may not do it ({why}); "
            f"ask uid {uid} (or root) to run `safeio gc {leftover.parent}`",
            target,
            errno=denied.errno,
        ) from exc


def _owner(leftover: Leftover) -> int | None:
    st = lstat_at(leftover.parent_fd, leftover.name)
    return st.st_uid if st is not None else None


def _permission_error(exc: BaseException | None) -> OSError | None:
    """The permission failure (EPERM, EACCES) that ``exc`` is or was caused by, if any."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in _DENIED:
            return exc
        exc = exc.__cause__
    return None


_NAMED = 5  # leftovers named in the one WARNING; the rest are counted


def warn_left_alone(kept: list[Action]) -> None:
    """One WARNING for every leftover of other users a recovery left alone, however many there are."""
    if not kept:
        return
    shown = "; ".join(f"{a.path}: {a.reason}" for a in kept[:_NAMED])
    more = f"; and {len(kept) - _NAMED} more" if len(kept) > _NAMED else ""
    logger.warning("%s: left %d leftover(s) of other users alone: %s%s", who(), len(kept), shown, more)


TEMPORARY_MARK = ".safeio-tmp-"
_swept: set[tuple[int, int]] = set()  # (device, inode) of the directories this process has swept


def remove_dead_temporaries(parent: str, parent_fd: int, own: str) -> None:
    """A file save's step, at this process's first file save in a directory: the temporary files of file
    saves whose writer is gone, of any target (a save killed while writing step 3's checkpoint leaves its
    temporary file beside the restarted job's save of step 4's). Once per directory and process: a
    listing costs with the directory's size, and a save killed later, in another process, is the next
    process's first save's (or ``gc``'s) to remove. Housekeeping: a leftover that cannot be removed is
    logged, never a failure of the save.

    Only what a file save leaves: a regular file of this user named as a temporary file, unlinked (one
    name; never a tree). A directory under such a name is never a file save's: another user of a
    group-writable directory could rename your ``data/`` tree (which they may not delete) to one, and this
    sweep deleted it (issue 34 item 3); retired checkpoint steps are ``gc``'s. One pass over the listing,
    and one WARNING for other users' temporary files, however many were planted."""
    st = os.fstat(parent_fd)
    if (st.st_dev, st.st_ino) in _swept:
        return
    _swept.add((st.st_dev, st.st_ino))
    names = [name for name in os.listdir(parent_fd) if TEMPORARY_MARK in name and name != own]
    if not names:
        return
    euid, now = os.geteuid(), time.time()
    mine = frozenset({euid})
    theirs: list[Action] = []
    for name in names:
        sibling = parse(name)
        found = lstat_at(parent_fd, name) if sibling is not None and sibling.kind == "tmp" else None
        if sibling is None or found is None or not stat.S_ISREG(found.st_mode):
            continue
        path = os.path.join(parent, name)
        if found.st_uid != euid:
            theirs.append(Action("keep", path, f"{FOREIGN} {found.st_uid}: its owner's to remove"))
            continue
        stale, reason = staleness(sibling, parent, parent_fd, None, now, mine)
        if not stale:
            continue
        try:
            os.unlink(name, dir_fd=parent_fd)  # a name: another name of the same file keeps it
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("%s: could not remove %s (%s): %s", who(), path, reason, exc.strerror or exc)
    warn_left_alone(theirs)


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
