"""Where each rank of a checkpoint root's collective calls is, published for the ranks that wait for it.

Every rank in a collective call on a root (``save``, ``latest()``) keeps one record in the group's store,
``safeio/ckpt/<root digest>/status/<rank>``: which call (its number and what it is), which phase since
when, host and pid, when last heard. It is set at each phase change (a TCPStore ``set`` goes out without
waiting for an answer) and refreshed by the watchdog's heartbeat while the call lasts. A rank waiting for
this one reads it: in its progress lines ("rank 0 (host-a pid 1533) has been in body of save of step 1
for 15 s (last heard 1 s ago)"), in its ``PeerTimeout`` at the bound (the phase the rank was actually in,
not the key that was missing), and to notice a rank that has left the call without answering. One key
per rank and root, overwritten: the store does not grow with the run.

Phases are named for the user, each with what to do about a stall in it (``advice``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from safeio._coordination.calls import MalformedValue, StoreCall, digest, parse_value
from safeio._coordination.group import Group

STAGE = "stage"  # the writer makes the stage; the others wait for its name and see it
BODY = "body"  # the code inside `with ckpts.save(step)`
ASYNC_SAVE = "async save"  # waiting for this rank's dcp.async_save to finish writing (commit_after)
REPORT = "report"  # the writer collects every rank's report
FSYNC = "commit's fsync"  # every rank syncs its share of the stage's files; the writer the manifest
LOCK = "lock"  # the writer takes the root's lock
PROMOTE = "promote"  # the writer renames the stage to the step's name: the commit point
POINTER = "pointer"  # the writer points `latest` at the step
RETENTION = "retention"  # the writer retires old steps (renamed aside; deleted later, in the background)
MANIFEST = "commit's manifest"  # the writer describes the stage's files for the marker
OUTCOME = "outcome"  # a rank waits for the writer's decision
RESOLVE = "resolve"  # the writer reads the root to answer latest(), at() or steps()
DONE = "done"

_ADVICE = {
    STAGE: "Opening the stage touches the filesystem: a mount that does not answer (an NFS server) holds "
    "it; check the mount (`dmesg`, `safeio doctor`).",
    BODY: "The code inside `with ckpts.save(...)` (dcp.save, the framework's save) has not returned: the "
    "stack shows where; a collective in it waits for every rank.",
    ASYNC_SAVE: "This rank's dcp.async_save has not finished writing its files: a slow or hung filesystem.",
    REPORT: "The writer waits for the other ranks to leave their bodies: their own logs say where they are.",
    MANIFEST: "Describing the checkpoint's files for its marker: the filesystem is slow or does not answer.",
    FSYNC: "Syncing the checkpoint's files to stable storage: the filesystem is slow or does not answer "
    "(check the mount, `dmesg`).",
    LOCK: "Waiting for the root's lock (.checkpoints.safeio.lock): another job saving into the same root?",
    PROMOTE: "Renaming the stage into place on the filesystem: the mount is slow or does not answer.",
    POINTER: "Writing the latest pointer: the mount is slow or does not answer (the step is committed).",
    RETENTION: "Retiring old checkpoints (renames under the root's lock): the mount is slow or does not "
    "answer (the step is committed).",
    OUTCOME: "Waiting for the writer's decision.",
    RESOLVE: "Reading the root to answer: the mount is slow or does not answer.",
}

# The promotion flow's own phase names (safeio._promotion.base), as a checkpoint's rank tells them.
COMMIT_PHASES = {"manifest": MANIFEST, "fsync": FSYNC, "lock": LOCK, "promote": PROMOTE}

_SILENT_AFTER = 30.0  # a rank in a call not heard from for this long may have died


def advice(phase: str) -> str:
    """What the user can do about a stall in ``phase``."""
    return _ADVICE.get(phase, "")


def status_call(group: Group, root: str) -> StoreCall:
    """The keys of the root's status records: ``status/<rank>``."""
    return StoreCall(group, f"safeio/ckpt/{digest(root, 16)}/status", root)


class RankStatus:
    """This rank's record in call ``number`` (``what``) on ``root``; the watchdog's ``PhaseSource``."""

    def __init__(self, group: Group, root: str, number: int, what: str, phase: str) -> None:
        self.group = group
        self.root = root
        self.number = number
        self.what = what
        self.phase = phase
        self.phase_since = time.time()
        self.waiting = False  # in a wait for another rank: its own lines say so, not the watchdog
        self.waiting_for: int | None = None
        self._keys = status_call(group, root)
        self._publishing = threading.Lock()  # see Channel.heartbeat
        self.publish()

    @property
    def target_url(self) -> str:
        return f"{self.what} of {self.root}"

    def reconnect(self, group: Group) -> RankStatus:
        """This record, published from now on through another connection to the store (the async
        commit's thread); the same object, so that the watchdog watching it sees every phase."""
        with self._publishing:
            self.group = group
            self._keys = status_call(group, self.root)
        return self

    def enter(self, phase: str) -> None:
        self.phase, self.phase_since = phase, time.time()
        self.publish()

    def enter_commit_phase(self, phase: str) -> None:
        """A phase of the commit's promotion flow (its hook), under the name a checkpoint's rank tells."""
        self.enter(COMMIT_PHASES.get(phase, phase))

    @contextlib.contextmanager
    def waiting_on(self, rank: int) -> Iterator[None]:
        """For the block, this rank waits for ``rank``: the watchdog stays quiet (the waiting lines name
        the rank). Published with the first waiting line only: a wait that ends at once costs nothing."""
        before = (self.waiting, self.waiting_for)
        self.waiting, self.waiting_for = True, rank
        try:
            yield
        finally:
            self.waiting, self.waiting_for = before

    def heartbeat(self, *, wait: bool = True) -> None:
        self.publish(wait=wait)

    def publish(self, *, wait: bool = True) -> None:
        if not self._keys.shared or self.number == 0:
            return
        if not self._publishing.acquire(blocking=wait):
            return  # the watchdog's refresh: the call's own thread is publishing right now
        try:
            record = {
                "call": self.number,
                "what": self.what,
                "phase": self.phase,
                "since": self.phase_since,
                "heard": time.time(),
                "host": self.group.host,
                "pid": os.getpid(),
                "waiting_for": self.waiting_for if self.waiting else None,
            }
            self._keys.set(str(self.group.rank), json.dumps(record))
        except Exception:  # progress is advisory: never fail a checkpoint because peers cannot see it
            pass
        finally:
            self._publishing.release()


@dataclass(frozen=True)
class Status:
    """A rank's record as heard (checked: it is input)."""

    rank: int
    call: int
    what: str
    phase: str
    since: float
    heard: float
    host: str
    pid: int
    waiting_for: int | None

    def has_ended(self, number: int) -> bool:
        """Whether this rank has ended call ``number``: it is in a later call, or done with this one. A
        value it was to set there and did not can no longer come. (A rank that heard a planted outcome,
        well-formed enough to pass for the writer's, acknowledged it, which deleted the call's keys, its
        own report among them, and ended: the writer then waited out its timeout for that report.)"""
        return self.call > number or (self.call == number and self.phase == DONE)

    def describe(self, number: int, now: float | None = None) -> str:
        """This record for a rank waiting in call ``number``."""
        now = time.time() if now is None else now
        who = f"rank {self.rank} ({self.host} pid {self.pid})"
        heard = now - self.heard
        in_phase = f"{self.phase} of {self.what} for {now - self.since:.0f} s (last heard {heard:.0f} s ago"
        if self.phase != DONE and heard > _SILENT_AFTER:
            in_phase += ": it may have died, or be stuck outside Python"
        in_phase += ")"
        if self.waiting_for is not None:
            in_phase += f", itself waiting for rank {self.waiting_for}"
        if self.call == number:
            return f"{who} has been in {in_phase}"
        if self.call < number:
            return f"{who} has not reached this call (its call {number}) yet: it is in {in_phase}"
        return f"{who} has left this call without answering: it is in call {self.call}, {in_phase}"


def read_status(group: Group, root: str, rank: int) -> Status | None:
    """Rank ``rank``'s record on ``root``, or None (none yet, or not one: input)."""
    keys = status_call(group, root)
    raw = keys.get_now(str(rank))
    if raw is None:
        return None
    with contextlib.suppress(MalformedValue):
        return _checked(parse_value(raw, keys.key(str(rank))), rank)
    return None


def _checked(record: object, rank: int) -> Status | None:
    if not isinstance(record, dict):
        return None
    call, pid, waiting_for = (
        _int(record.get("call")),
        _int(record.get("pid")),
        _int(record.get("waiting_for")),
    )
    since, heard = _time(record.get("since")), _time(record.get("heard"))
    what, phase, host = _text(record.get("what")), _text(record.get("phase")), _text(record.get("host"))
    if call is None or pid is None or since is None or heard is None:
        return None
    if what is None or phase is None or host is None:
        return None
    return Status(rank, call, what, phase, since, heard, host, pid, waiting_for)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _time(value: object) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok and isinstance(value, (int, float)) else None


def _text(value: object) -> str | None:
    return value[:200] if isinstance(value, str) else None
