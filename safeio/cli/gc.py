"""``safeio gc PATH``: remove what crashed safeio writers left behind, and nothing else.

Leftovers are recognised by name only (``safeio.shares.parse_leftover``: stages, old versions renamed
aside, temporary files and links, version directories; ``.<target>.safeio.lock`` markers), and judged by
``safeio.shares`` (``staleness``, ``recover_leftovers``), the same code a writer runs before it
promotes: a sibling whose owner is alive on this host is never touched; one whose owner is gone is
removed (or, for an old version whose target is missing, put back; for an interrupted merge, rolled
forward); one owned by another host only with ``--older-than``. Silly-renamed ``.nfs*`` files inside a
leftover go with it once their reader has closed them.
"""

from __future__ import annotations

import argparse
import os
import stat
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from safeio.cli._common import (
    EXIT_OK,
    EXIT_PROBLEMS,
    columns,
    existing_directory,
    human_bytes,
    parse_duration,
    print_json,
)
from safeio.cli._states import State
from safeio.cli._states import fix as state_fix
from safeio.frameworks import open_shared_directory
from safeio.shares import (
    LOCK_SUFFIX,
    Action,
    LeftoverOwners,
    LockMarker,
    lstat_at,
    parse_leftover,
    read_lock_marker,
    recover_leftovers,
    remove_lock_marker_if_unchanged,
    staleness,
    walk,
)


def add_parser(commands: Any, epilog: str) -> None:
    parser = commands.add_parser(
        "gc",
        help="remove safeio's leftovers after crashes (stale stages, old versions, stale soft locks)",
        description="Find safeio's own leftovers under PATH (recursively, never following symlinks): "
        "stages and temporary files of writers that died, old versions renamed aside, version "
        "directories past their grace period, and soft-lock markers whose holder died. A leftover is "
        "stale when its owner's process is gone on this host; leftovers of other hosts are only "
        "removed with --older-than (their owner cannot be probed from here). Nothing safeio did not "
        "create is ever touched, nor a stage whose owner is alive.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", metavar="PATH", help="directory to clean (recursively)")
    parser.add_argument(
        "--older-than",
        metavar="DURATION",
        type=parse_duration,
        default=None,
        help="only leftovers at least this old (90, 45s, 30m, 2h, 1d); also allows removing "
        "leftovers owned by other hosts",
    )
    parser.add_argument("--dry-run", action="store_true", help="list what would be done; change nothing")
    parser.add_argument("--json", action="store_true", help="print a machine-readable report")
    parser.set_defaults(run=run)


@dataclass
class Report:
    path: str
    dry_run: bool
    older_than: float | None
    actions: list[dict[str, Any]] = field(default_factory=list)
    kept: list[dict[str, str | None]] = field(default_factory=list)
    errors: list[dict[str, str]] = field(default_factory=list)

    def keep(self, path: str, state: State, detail: str, fix: str | None = None) -> None:
        """A leftover gc leaves where it is: in what state, why, and (when it is a problem) what fixes it."""
        shown = fix if fix is not None else state_fix(state, self.path)
        self.kept.append({"path": path, "state": state, "detail": detail, "fix": shown})

    @property
    def freed(self) -> int:
        """Bytes removed (in a dry run: that would be removed)."""
        return sum(a["size"] for a in self.actions if a["verb"] == "remove" and (a["done"] or self.dry_run))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "freed_bytes": self.freed}


def run(args: argparse.Namespace) -> int:
    root = existing_directory(args.path)
    report = Report(root, args.dry_run, args.older_than)

    def onerror(exc: OSError) -> None:
        path = os.path.join(root, exc.filename) if exc.filename else root
        report.errors.append({"path": path, "error": exc.strerror or str(exc)})

    # Not following links: a symlink to a directory elsewhere is listed but never entered, and each
    # directory is worked on through the descriptor the walk holds, so a directory swapped for a link
    # meanwhile cannot lead gc outside PATH. The walk recurses on nothing (os.fwalk did, once per
    # level: a 3,000-level tree was a RecursionError); a directory too deep to name is an error here.
    try:
        with open_shared_directory(root, follow=True) as top:
            for listing in walk(top.fd, onerror=onerror):
                dirpath = os.path.join(root, listing.rel) if listing.rel else root
                names = sorted([*listing.subdirs, *(name for name, _st in listing.entries)])
                if any(parse_leftover(name) is not None or _is_lock_name(name) for name in names):
                    _collect(dirpath, listing.fd, names, report, args.older_than, args.dry_run)
                # A safeio sibling is handled whole (its contents, .nfs* included, are safeio's); the
                # strict lock's claims directory belongs to filelock.
                listing.subdirs[:] = [
                    d
                    for d in listing.subdirs
                    if parse_leftover(d) is None
                    and not d.endswith(LOCK_SUFFIX + ".filelock")
                    and lstat_at(listing.fd, d) is not None
                ]
    except OSError as exc:
        onerror(exc)
    if args.json:
        print_json(report.to_dict())
    else:
        _print(report)
    return EXIT_PROBLEMS if report.errors else EXIT_OK


def _is_lock_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(LOCK_SUFFIX) and len(name) > len(LOCK_SUFFIX) + 1


def _collect(
    directory: str, dir_fd: int, names: list[str], report: Report, older_than: float | None, dry_run: bool
) -> None:
    try:
        actions = recover_leftovers(
            directory, parent_fd=dir_fd, older_than=older_than, dry_run=dry_run, keep_going=True
        )
    except OSError as exc:
        report.errors.append({"path": directory, "error": exc.strerror or str(exc)})
        actions = []
    acted = set()
    for action in actions:
        acted.add(action.path)
        if action.verb == "keep":  # another user's, or one this user may not remove: theirs, not an error
            report.keep(action.path, State.ANOTHER_USERS, action.reason)
            continue
        if action.verb == "failed":
            report.errors.append({"path": action.path, "error": action.reason})
            continue
        report.actions.append(_action_dict(action, dry_run, _found(action.path)))
        if not dry_run and action.verb == "remove" and lstat_at(dir_fd, os.path.basename(action.path)):
            # remove_tree gave up: an NFS reader still holds a silly-renamed .nfs* file inside.
            report.actions[-1]["done"] = False
            report.errors.append(
                {"path": action.path, "error": "still in use (files open elsewhere); run gc again later"}
            )
    now = time.time()
    owners = LeftoverOwners(dir_fd, names)  # one pass, however many names were planted
    for name in names:
        path = os.path.join(directory, name)
        sibling = parse_leftover(name)
        found = lstat_at(dir_fd, name) if sibling is not None and path not in acted else None
        if sibling is not None and found is not None:
            owner_counts = owners.of(sibling)
            reason = staleness(sibling, directory, dir_fd, older_than, now, owner_counts)[1]
            state = State.ANOTHER_USERS if found.st_uid not in owner_counts else _found(path, kept=True)
            report.keep(path, state, reason)
        elif sibling is None and _is_lock_name(name):
            _collect_lock(directory, dir_fd, name, report, older_than, dry_run, now)


def _found(path: str, *, kept: bool = False) -> State:
    """What a leftover of a user whose leftovers gc may recover is, by its name: its save's process
    alive (in progress), gone (stale), on another host; a version directory gc keeps is in use."""
    sibling = parse_leftover(os.path.basename(path))
    if sibling is None:
        return State.STALE
    if sibling.kind == "v":
        return State.IN_USE if kept else State.STALE
    alive = sibling.owner_is_alive()
    return State.OTHER_HOST if alive is None else State.IN_PROGRESS if alive else State.STALE


def _action_dict(action: Action, dry_run: bool, state: State) -> dict[str, Any]:
    return {
        "verb": action.verb,
        "path": action.path,
        "state": state,
        "detail": action.reason,
        "size": action.size,
        "done": not dry_run,
    }


# ---------------------------------------------------------------------------------------------------
# Soft-lock markers (judged by safeio.shares.read_lock_marker)


def _collect_lock(
    directory: str,
    dir_fd: int,
    name: str,
    report: Report,
    older_than: float | None,
    dry_run: bool,
    now: float,
) -> None:
    path = os.path.join(directory, name)
    marker = read_lock_marker(dir_fd, name)
    if marker is None:
        return
    owners = _lock_owners(dir_fd, name)
    if marker.st.st_uid not in owners:
        allowed = ", ".join(map(str, sorted(owners)))
        detail = f"lock owned by uid {marker.st.st_uid}, not uid {allowed}: left to its owner"
        report.keep(path, State.ANOTHER_USERS, detail)
        return
    age = now - marker.st.st_mtime
    holder = marker.holder
    alive = holder.alive() if holder is not None else False
    state = (
        State.DAMAGED if marker.damaged is not None else State.OTHER_HOST if alive is None else State.STALE
    )
    if marker.damaged is not None:
        if stat.S_ISDIR(marker.st.st_mode) or older_than is None:
            detail = f"damaged: {marker.damaged} (pass --older-than to remove it)"
            report.keep(path, state, detail, f"`safeio gc {report.path} --older-than 1h` removes it")
            return
        reason = f"damaged: {marker.damaged}, {age:.0f} s old"
    elif holder is None:
        return  # flock lock files stay: removing one a process holds would let a second holder in
    elif alive:
        report.keep(path, State.IN_PROGRESS, f"lock held by live pid {holder.pid}")
        return
    elif alive is None:
        if older_than is None:
            report.keep(path, state, f"lock held on host {holder.host} (pass --older-than to break it)")
            return
        reason = f"soft lock of pid {holder.pid} on host {holder.host}, unrefreshed for {age:.0f} s"
    else:
        reason = f"soft lock of pid {holder.pid}, which is gone"
    if older_than is not None and age < older_than:
        report.keep(path, state, f"lock {age:.0f} s old, younger than --older-than")
        return
    _remove_lock(report, path, dir_fd, name, marker, state=state, reason=reason, dry_run=dry_run)


def _remove_lock(
    report: Report,
    path: str,
    dir_fd: int,
    name: str,
    marker: LockMarker,
    *,
    state: State,
    reason: str,
    dry_run: bool,
) -> None:
    """Remove a judged lock marker (not with ``dry_run``) unless it changed hands meanwhile; report it."""
    done = not dry_run
    if not dry_run:
        done = remove_lock_marker_if_unchanged(dir_fd, name, marker)
        if not done:
            report.keep(path, State.IN_PROGRESS, "lock changed hands while gc looked at it")
            return
    report.actions.append(
        {
            "verb": "remove",
            "path": path,
            "state": state,
            "detail": reason,
            "size": marker.st.st_size,
            "done": done,
        }
    )


def _lock_owners(dir_fd: int, name: str) -> frozenset[int]:
    """Whose lock markers gc may remove: the locked target's owner, else the directory's and gc's own."""
    target = name[1 : -len(LOCK_SUFFIX)]
    st = lstat_at(dir_fd, target)
    if st is not None:
        return frozenset({st.st_uid})
    return frozenset({os.fstat(dir_fd).st_uid, os.geteuid()})


def _print(report: Report) -> None:
    verbs = {"remove": "removed", "restore": "restored", "roll-forward": "rolled forward", "skip": "skipped"}
    if report.dry_run:
        verbs = {"remove": "would remove", "restore": "would restore", "roll-forward": "would roll forward"}
        verbs["skip"] = "would skip"
    table = []
    for action in report.actions:
        verb = verbs.get(action["verb"], action["verb"])
        if not action["done"] and not report.dry_run:
            verb = "NOT removed"
        size = f" ({human_bytes(action['size'])})" if action["verb"] == "remove" else ""
        table.append([verb, action["state"], f"{action['path']}{size}: {action['detail']}"])
    for kept in report.kept:
        table.append(["kept", str(kept["state"]), f"{kept['path']}: {kept['detail']}"])
    for error in report.errors:
        table.append(["error", "-", f"{error['path']}: {error['error']}"])
    for line in columns(table):
        print(line)
    fixes: dict[str, int] = {}
    for kept in report.kept:
        if kept["fix"] is not None:
            fixes[kept["fix"]] = fixes.get(kept["fix"], 0) + 1
    for how, count in fixes.items():
        print(f"fix ({count} kept): {how}")
    removed = sum(1 for a in report.actions if a["verb"] == "remove")
    if not report.actions:
        print(f"nothing to clean under {report.path}")
    elif report.dry_run:
        print(
            f"dry run: would free {human_bytes(report.freed)} ({removed} item(s) to remove); nothing changed"
        )
    else:
        print(f"freed {human_bytes(report.freed)} ({removed} item(s) removed)")
