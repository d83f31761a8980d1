"""``safeio gc PATH``: remove what crashed safeio writers left behind, and nothing else.

Leftovers are recognised by name only (``safeio._storage.names``: stages, old versions renamed aside,
temporary files and links, version directories; ``.<target>.safeio.lock`` markers), and judged by
``safeio._promotion.leftovers``, the same code a writer runs before it promotes: a sibling whose
owner is alive on this host is never touched; one whose owner is gone is removed (or, for an old
version whose target is missing, put back; for an interrupted merge, rolled forward); one owned by
another host only with ``--older-than``. Silly-renamed ``.nfs*`` files inside a leftover go with it
once their reader has closed them.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from safeio._promotion.leftovers import recover_directory, staleness
from safeio._promotion.recovery import Action
from safeio._storage.names import LOCK_SUFFIX, parse, pid_alive
from safeio.cli._common import (
    EXIT_OK,
    EXIT_PROBLEMS,
    existing_directory,
    human_bytes,
    parse_duration,
    print_json,
)

# filelock's soft-lock markers are at most this long; anything bigger is not one of them.
_MARKER_MAX = 1024
# filelock's host field carries this suffix when the writer ran in a non-initial PID namespace.
_NAMESPACE_MARK = "?pidns-"
_INITIAL_PID_NAMESPACE = 0xEFFFFFFC


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
    kept: list[dict[str, str]] = field(default_factory=list)
    errors: list[dict[str, str]] = field(default_factory=list)

    @property
    def freed(self) -> int:
        """Bytes removed (in a dry run: that would be removed)."""
        return sum(a["size"] for a in self.actions if a["verb"] == "remove" and (a["done"] or self.dry_run))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "freed_bytes": self.freed}


def run(args: argparse.Namespace) -> int:
    root = existing_directory(args.path)
    report = Report(root, args.dry_run, args.older_than)
    for directory, names in _directories_with_leftovers(root, report):
        _collect(directory, names, report, args.older_than, args.dry_run)
    if args.json:
        print_json(report.to_dict())
    else:
        _print(report)
    return EXIT_PROBLEMS if report.errors else EXIT_OK


def _directories_with_leftovers(root: str, report: Report) -> list[tuple[str, list[str]]]:
    found = []

    def onerror(exc: OSError) -> None:
        report.errors.append({"path": str(exc.filename or root), "error": exc.strerror or str(exc)})

    # followlinks=False: a symlink to a directory elsewhere is listed but never entered, so gc
    # cannot reach outside PATH.
    for dirpath, dirnames, filenames in os.walk(root, onerror=onerror, followlinks=False):
        names = dirnames + filenames
        if any(parse(name) is not None or _is_lock_name(name) for name in names):
            found.append((dirpath, sorted(names)))
        # A safeio sibling is handled whole (its contents, .nfs* included, are safeio's); the
        # strict lock's claims directory belongs to filelock.
        dirnames[:] = sorted(
            d for d in dirnames if parse(d) is None and not d.endswith(LOCK_SUFFIX + ".filelock")
        )
    return found


def _is_lock_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(LOCK_SUFFIX) and len(name) > len(LOCK_SUFFIX) + 1


def _collect(
    directory: str, names: list[str], report: Report, older_than: float | None, dry_run: bool
) -> None:
    try:
        actions = recover_directory(directory, older_than=older_than, dry_run=dry_run)
    except OSError as exc:
        report.errors.append({"path": directory, "error": exc.strerror or str(exc)})
        actions = []
    acted = set()
    for action in actions:
        acted.add(action.path)
        report.actions.append(_action_dict(action, dry_run))
        if not dry_run and action.verb == "remove" and os.path.lexists(action.path):
            # remove_tree gave up: an NFS reader still holds a silly-renamed .nfs* file inside.
            report.actions[-1]["done"] = False
            report.errors.append(
                {"path": action.path, "error": "still in use (files open elsewhere); run gc again later"}
            )
    now = time.time()
    for name in names:
        path = os.path.join(directory, name)
        sibling = parse(name)
        if sibling is not None and path not in acted and os.path.lexists(path):
            report.kept.append({"path": path, "reason": staleness(sibling, path, older_than, now)[1]})
        elif sibling is None and _is_lock_name(name):
            _collect_lock(path, report, older_than, dry_run, now)


def _action_dict(action: Action, dry_run: bool) -> dict[str, Any]:
    return {
        "verb": action.verb,
        "path": action.path,
        "reason": action.reason,
        "size": action.size,
        "done": not dry_run,
    }


# ---------------------------------------------------------------------------------------------------
# Soft-lock markers


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str


def read_holder(path: str) -> tuple[Holder | None, os.stat_result | None, bytes]:
    """The holder recorded in a filelock soft-lock marker (``pid=``/``host=`` lines, or the older
    ``pid\\nhost\\n`` form); None for anything else, including flock's empty lock files."""
    try:
        st = os.lstat(path)
        if not os.path.isfile(path) or os.path.islink(path) or st.st_size > _MARKER_MAX:
            return None, st, b""
        with open(path, "rb") as f:
            raw = f.read(_MARKER_MAX + 1)
    except OSError:
        return None, None, b""
    text = raw.decode("utf-8", "replace")
    lines = text.splitlines()
    if not text.endswith("\n") or not lines:
        return None, st, raw  # empty (flock) or half-written: not ours to judge
    fields = dict(line.partition("=")[::2] for line in lines[1:] if "=" in line)
    if lines[0].startswith("filelock/") and fields.get("pid", "").isdigit() and fields.get("host"):
        return Holder(int(fields["pid"]), fields["host"]), st, raw
    if len(lines) in (2, 3) and lines[0].isdigit() and lines[1]:
        return Holder(int(lines[0]), lines[1]), st, raw
    return None, st, raw


def _this_host() -> str:
    # As filelock writes it: the host name, plus the PID namespace when not the initial one (a pid is
    # only meaningful inside its namespace).
    name = socket.gethostname()
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return name
    return name if namespace == _INITIAL_PID_NAMESPACE else f"{name}{_NAMESPACE_MARK}{namespace:x}"


def _collect_lock(path: str, report: Report, older_than: float | None, dry_run: bool, now: float) -> None:
    holder, st, raw = read_holder(path)
    if holder is None or st is None:
        return  # flock lock files stay: removing one a process holds would let a second holder in
    age = now - st.st_mtime
    if holder.host == _this_host():
        if pid_alive(holder.pid):
            report.kept.append({"path": path, "reason": f"lock held by live pid {holder.pid}"})
            return
        reason = f"soft lock of pid {holder.pid}, which is gone"
    elif older_than is None:
        report.kept.append(
            {"path": path, "reason": f"lock held on host {holder.host} (pass --older-than to break it)"}
        )
        return
    else:
        reason = f"soft lock of pid {holder.pid} on host {holder.host}, unrefreshed for {age:.0f} s"
    if older_than is not None and age < older_than:
        report.kept.append({"path": path, "reason": f"lock {age:.0f} s old, younger than --older-than"})
        return
    done = not dry_run
    if not dry_run:
        done = _remove_marker_if_unchanged(path, st, raw)
        if not done:
            report.kept.append({"path": path, "reason": "lock changed hands while gc looked at it"})
            return
    report.actions.append(
        {"verb": "remove", "path": path, "reason": reason, "size": st.st_size, "done": done}
    )


def _remove_marker_if_unchanged(path: str, seen: os.stat_result, raw: bytes) -> bool:
    # A contender may have broken the stale marker and taken the lock since we read it: remove only
    # the very marker judged stale (same inode, same content).
    try:
        st = os.lstat(path)
        with open(path, "rb") as f:
            now_raw = f.read(_MARKER_MAX + 1)
        if (st.st_ino, st.st_dev) != (seen.st_ino, seen.st_dev) or now_raw != raw:
            return False
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _print(report: Report) -> None:
    verbs = {"remove": "removed", "restore": "restored", "roll-forward": "rolled forward", "skip": "skipped"}
    if report.dry_run:
        verbs = {"remove": "would remove", "restore": "would restore", "roll-forward": "would roll forward"}
        verbs["skip"] = "would skip"
    for action in report.actions:
        verb = verbs.get(action["verb"], action["verb"])
        if not action["done"] and not report.dry_run:
            verb = "NOT removed"
        size = f" ({human_bytes(action['size'])})" if action["verb"] == "remove" else ""
        print(f"{verb:<16} {action['path']}{size}: {action['reason']}")
    for kept in report.kept:
        print(f"{'kept':<16} {kept['path']}: {kept['reason']}")
    for error in report.errors:
        print(f"{'error':<16} {error['path']}: {error['error']}")
    removed = sum(1 for a in report.actions if a["verb"] == "remove")
    if not report.actions:
        print(f"nothing to clean under {report.path}")
    elif report.dry_run:
        print(
            f"dry run: would free {human_bytes(report.freed)} ({removed} item(s) to remove); nothing changed"
        )
    else:
        print(f"freed {human_bytes(report.freed)} ({removed} item(s) removed)")
