"""A checkpoint's calls in the store: every rank reports, the writer decides, everyone hears it, bounded.

Keys live under ``safeio/ckpt/<root digest>/<n>``, where ``n`` numbers this process's collective calls on
the root (``save`` and ``latest()`` are collective: every rank of a group of several makes them, in the
same order). A call of a group of one process (``get_last_checkpoint``'s own reading of a directory) is
not collective and takes no number: ranks that make different numbers of such readings still agree on
the numbers of the calls they make together. The first rank to enter call ``n`` records what it is
("save of step 5", "latest()"); every other rank compares on entry, in the same round trip, and a rank
that skipped a call or made one more is named at once on every rank of that call (``CollectiveMismatch``)
instead of each waiting out its timeout for keys the others never set. The writer never blocks forever:
it waits for the other ranks' reports at most until the deadline and then names the ranks that never
reported. The keys go once every other rank has read the outcome.

Every value read from the store is untrusted input (``parse_value``): a value that is not what safeio
sets is "malformed", an error naming the rank it is from, and the writer still decides an outcome.

What the ranks share inside a save (the writer's results of the body's replicated saves, the commit's
fsyncs) is in ``checkpoint_shares``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from typing import Any

from safeio._coordination.calls import (
    MalformedValue,
    Progress,
    StoreCall,
    digest,
    next_number,
    text,
)
from safeio._coordination.checkpoint_status import RankStatus, Status, advice, read_status
from safeio._coordination.diverged import diverged_record, entrant, mismatch_error, waited_on_keys
from safeio._coordination.group import Group
from safeio._errors import CheckpointError, CollectiveMismatch, PeerTimeout
from safeio._stalls import Cadence, seconds
from safeio._who import who

logger = logging.getLogger("safeio")


class DecidedFirst(Exception):
    """The writer decided the call's outcome before it set the key a rank was waiting for."""

    def __init__(self, outcome: dict[str, Any]) -> None:
        super().__init__(outcome)
        self.outcome = outcome


class LeftTheCall(Exception):
    """The rank waited for has ended this call (it is done, or in a later call of the root), and the key
    this rank waits for is not set: it never will be."""

    def __init__(self, rank: int, where: str) -> None:
        super().__init__(rank, where)
        self.rank = rank
        self.where = where


class CheckpointCall:
    """One collective call (``what``: "save of step 5", "latest()") on the checkpoint root ``root``.
    Made by ``enter``."""

    def __init__(
        self,
        group: Group,
        root: str,
        what: str,
        *,
        number: int,
        call: StoreCall,
        status: RankStatus,
        step: int | None = None,
        warn_after: float = math.inf,
        published: list[str] | None = None,
        announced_fsyncs: bool = False,
    ) -> None:
        self.group = group
        self.root = root
        self.what = what
        self.number = number  # this call's place among the root's collective calls (0: not collective)
        self.step = step  # the step a save is of (None: latest(), steps())
        self.warn_after = warn_after  # when a wait starts saying so (safeio._stalls)
        self.status = status  # this rank's published place in the call
        # Keys the writer set for the body's saves (NestedResults): deleted with the call's own keys.
        self.published: list[str] = published if published is not None else []
        # Whether the writer told the ranks to wait for their fsyncs (FsyncShares), and has handed them out.
        self.announced_fsyncs = announced_fsyncs
        self.handed_out = False
        self._call = call
        self.shared = call.shared  # whether peers hear the call through a store

    @classmethod
    def enter(
        cls,
        group: Group,
        root: str,
        what: str,
        *,
        phase: str,
        step: int | None = None,
        warn_after: float = math.inf,
    ) -> CheckpointCall:
        """This rank's next collective call on ``root``, in ``phase``, checked against what the rank
        that entered it first makes there (``CollectiveMismatch`` on a difference)."""
        # Only a group of several ranks makes collective calls: a process-alone reading took a number
        # too, and ranks that made different numbers of them (a script's `get_last_checkpoint(out) if
        # os.path.isdir(out) else None`) waited under different numbers at the next save, each for its
        # timeout (issue 32: a Ray Train job stuck at its first checkpoint).
        number = next_number(("checkpoints", root)) if group.world_size > 1 else 0
        call = cls(
            group,
            root,
            what,
            number=number,
            call=StoreCall(group, _prefix(root, number), root),
            status=RankStatus(group, root, number, what, phase),
            step=step,
            warn_after=warn_after,
        )
        call._check_entry()
        return call

    def on_group(self, group: Group) -> CheckpointCall:
        """The same call through another connection to the store (the async commit's thread)."""
        return CheckpointCall(
            group,
            self.root,
            self.what,
            number=self.number,
            call=self._call.on_group(group),
            status=self.status.reconnect(group),
            step=self.step,
            warn_after=self.warn_after,
            published=self.published,
            announced_fsyncs=self.announced_fsyncs,
        )

    def _set(self, name: str, value: Any) -> None:
        self._call.set(name, json.dumps(value))

    # -- entering: every rank makes the same call -----------------------------------------------------

    def _check_entry(self) -> None:
        if not self.shared:
            return
        rank = self.group.rank
        raw = self._call.claim("call", json.dumps({"rank": rank, "what": self.what}))
        if raw is None:
            return  # the store cannot tell (gone: rank 0 finished); the call's waits fall back as before
        try:
            first = self._call.parse("call", raw)
        except MalformedValue as exc:
            raise self._diverged({rank: self.what}, f"the record of this call is malformed ({exc})") from None
        if isinstance(first, dict) and first.get("what") == self.what:
            return
        theirs = entrant(first)
        if theirs is None:
            raise self._diverged({rank: self.what}, "the record of this call is malformed")
        raise self._diverged({rank: self.what, theirs[0]: theirs[1]}, "")

    def _diverged(self, calls: dict[int, str], problem: str) -> CollectiveMismatch:
        """This rank found that the ranks' calls differ: every key a rank of this call may be waiting
        for is set to say so (they wake at once), and the error to raise here."""
        record = diverged_record(calls, problem, number=self.number, found_by=self.group.rank)
        value = json.dumps({"diverged": record})
        for name in waited_on_keys(self.group.world_size, self.group.writer):
            self._call.set(name, value)
        return mismatch_error(record, rank=self.group.rank, root=self.root, number=self.number)

    # -- waiting --------------------------------------------------------------------------------------

    def _parse(self, raw: bytes, name: str) -> Any:
        """A value of this call as JSON; MalformedValue if it is not; CollectiveMismatch if a rank found
        that the ranks' calls differ."""
        value = self._call.parse(name, raw)
        if isinstance(value, dict) and "diverged" in value:
            raise mismatch_error(value["diverged"], rank=self.group.rank, root=self.root, number=self.number)
        return value

    def _wait(
        self, name: str, deadline: float, waiting_for: str, *, from_rank: int, decided_first: bool = False
    ) -> Any:
        """The value of ``name``, which rank ``from_rank`` sets (``waiting_for`` says what it is, for
        messages). While it waits, this rank says so on the stall cadence, with what ``from_rank`` last
        reported; at ``deadline``, a PeerTimeout naming that rank, the phase it was in, the step and the
        time waited. ``LeftTheCall`` when ``from_rank`` has ended the call without the value set;
        with ``decided_first``, ``DecidedFirst`` when the writer decided the outcome meanwhile (it then
        never sets ``name``: it failed before, or needs no answer)."""
        cadence = Cadence(self.warn_after)
        told: list[float] = []

        def tell(elapsed: float) -> None:
            if not told:
                self.status.publish()  # others see that this rank waits, and for whom
            told.append(elapsed)
            self._still_waiting(elapsed, waiting_for, from_rank)

        def check() -> None:
            if decided_first:
                decided = self.outcome_if_decided()
                if decided is not None:
                    raise DecidedFirst(decided)
            status = read_status(self.group, self.root, from_rank)
            if status is not None and status.has_ended(self.number) and self._call.get_now(name) is None:
                raise LeftTheCall(from_rank, status.describe(self.number))

        def expired() -> PeerTimeout:
            return self._waited_out(cadence.elapsed(), waiting_for, from_rank)

        with self.status.waiting_on(from_rank):
            # StoreGone: the store's host (rank 0) has left
            raw = self._call.wait(name, deadline, expired=expired, progress=Progress(cadence, tell, check))
        return self._parse(raw, name)

    def _still_waiting(self, elapsed: float, waiting_for: str, from_rank: int) -> None:
        status = read_status(self.group, self.root, from_rank)
        phase = status.phase if status is not None and status.call == self.number else ""
        logger.warning(
            "%s: still waiting after %s s for %s (%s of %s): %s. %s",
            who(self.group.rank),
            seconds(elapsed),
            waiting_for,
            self.what,
            self.root,
            self._describe(status, from_rank),
            advice(phase),
            extra={"safeio_waited_for": from_rank, "safeio_phase": phase, "safeio_elapsed": elapsed},
        )

    def _waited_out(self, elapsed: float, waiting_for: str, from_rank: int) -> PeerTimeout:
        status = read_status(self.group, self.root, from_rank)
        phase = status.phase if status is not None and status.call == self.number else None
        return PeerTimeout(
            f"rank {self.group.rank}: waited {elapsed:.0f} s, the bound of this wait, for {waiting_for} "
            f"({self.what} of {self.root}): {self._describe(status, from_rank)}. "
            f"{advice(phase or '')}".rstrip(),
            self.root,
            waited_for=from_rank,
            phase=phase,
            step=self.step,
            elapsed=elapsed,
        )

    def whereabouts(self, rank: int) -> str:
        """What rank ``rank`` last reported on this root, for a message (one get)."""
        return self._describe(read_status(self.group, self.root, rank), rank)

    def _describe(self, status: Status | None, rank: int) -> str:
        if status is None:
            return (
                f"rank {rank} has reported nothing on this root yet (it has not reached a collective call "
                "of it: still in other code, or it died before)"
            )
        return status.describe(self.number)

    # -- agreement when a rank gives up ---------------------------------------------------------------

    def give_up(self, reason: str) -> str:
        """A rank other than the writer gives up waiting in a save (its bound): the writer must not commit
        a step a rank has given up on, or the ranks would be told different things. The call's verdict
        is claimed for "abandon" (one compare_set), unless the writer has claimed it first for its commit:
        returns "not committed" (the writer sees the verdict at its commit point and abandons the stage),
        "committing" (the writer was already committing: latest() tells) or "unknown" (the store cannot
        say: gone, or without compare_set). Every key the writer may be waiting for from this rank is
        answered too, so that it learns of it at once."""
        if not self.shared:
            return "unknown"
        rank = self.group.rank
        raw = self._call.claim("verdict", json.dumps({"abandon": rank, "reason": reason}))
        if raw is None:
            return "unknown"  # only the filesystem will tell (latest())
        try:
            verdict = self._call.parse("verdict", raw)
        except MalformedValue:
            verdict = None
        committing = isinstance(verdict, dict) and "commit" in verdict
        error = f"gave up waiting: {reason}"
        self._set(f"rank/{rank}", {"ok": False, "error": error})
        self._set(f"synced/{rank}", {"error": error})
        return "committing" if committing else "not committed"

    def check_gave_up(self) -> None:
        """The writer, before the commit's work: CheckpointError if a rank has given up already (one get)."""
        raw = self._call.get_now("verdict") if self.shared else None
        if raw is not None:
            self._refuse_commit(raw)

    def commit_point(self) -> None:
        """The writer, right before the commit point (the rename, the marker): claims the verdict for the
        commit. CheckpointError naming the rank that gave up first, if one did: nothing is committed."""
        if not self.shared:
            return
        raw = self._call.claim("verdict", json.dumps({"commit": self.group.rank}))
        if raw is not None:  # None: a store that cannot tell; no rank can have claimed it either
            self._refuse_commit(raw)

    def _refuse_commit(self, raw: bytes) -> None:
        try:
            verdict = self._call.parse("verdict", raw)
        except MalformedValue as exc:
            verdict = {"abandon": None, "reason": f"a malformed verdict in the store ({exc})"}
        if isinstance(verdict, dict) and verdict.get("commit") == self.group.rank:
            return
        gave_up = verdict.get("abandon") if isinstance(verdict, dict) else None
        reason = text(verdict.get("reason")) if isinstance(verdict, dict) else "a verdict that is not one"
        rank = gave_up if isinstance(gave_up, int) and not isinstance(gave_up, bool) else None
        raise CheckpointError(
            f"rank {self.group.rank}: {f'rank {rank}' if rank is not None else 'a rank'} gave up waiting "
            f"({reason}) before the commit point of {self.what} of {self.root}: the step is not committed, "
            "as that rank was told",
            self.root,
            failed={rank if rank is not None else -1: f"gave up waiting: {reason}"},
        )

    def _wait_for_writer(
        self, name: str, deadline: float, waiting_for: str, *, decided_first: bool = False
    ) -> Any:
        """``_wait`` for a value the writer sets; its leaving the call without setting it means the ranks'
        calls differ (``CollectiveMismatch``)."""
        writer = self.group.writer
        try:
            return self._wait(name, deadline, waiting_for, from_rank=writer, decided_first=decided_first)
        except LeftTheCall as left:
            raise CollectiveMismatch(
                f"rank {self.group.rank}: rank {writer} left call {self.number} on {self.root} ({self.what}) "
                f"without setting {waiting_for}: {left.where}. save(), latest(), at() and steps() are "
                "collective: every rank of the group makes them, in the same order",
                self.root,
                call=self.number,
                calls={self.group.rank: self.what},
            ) from None

    # -- the writer publishes, the others wait -------------------------------------------------------

    def announce(self, value: Any) -> None:
        """The writer: something every rank needs before its body (the stage's name), or a failure."""
        if self.shared:
            self.announced_fsyncs = isinstance(value, dict) and value.get("sync") is True
            self._set("announce", value)

    def hear_announcement(self, deadline: float) -> Any:
        """Every other rank: what the writer announced (MalformedValue when it is not what it sets)."""
        return self._wait_for_writer("announce", deadline, f"rank {self.group.writer}'s stage")

    def report(self, value: dict[str, Any]) -> None:
        """Every rank but the writer: how its part went ({"ok": bool, "error": str})."""
        if self.shared:
            self._set(f"rank/{self.group.rank}", value)

    def collect(self, deadline: float) -> tuple[dict[int, str], list[int]]:
        """The writer: every other rank's report, bounded. Returns (failed rank -> error, missing ranks);
        a report that is not one is that rank's failure ("malformed")."""
        failed: dict[int, str] = {}
        missing: list[int] = []
        if not self.shared:
            return failed, missing
        for rank in range(self.group.world_size):
            if rank == self.group.rank:
                continue
            try:
                report = self._wait(f"rank/{rank}", deadline, f"rank {rank}'s report", from_rank=rank)
            except PeerTimeout:
                missing.append(rank)
                continue
            except MalformedValue as exc:
                failed[rank] = f"its report in the store is malformed ({exc})"
                continue
            except LeftTheCall as left:
                failed[rank] = f"left this call, no report of it to read ({left.where})"
                continue
            if not (isinstance(report, dict) and report.get("ok") is True):
                error = report.get("error") if isinstance(report, dict) else None
                failed[rank] = text(error) if error else "failed (a report that is not one)"
        return failed, missing

    def decide(self, value: dict[str, Any]) -> None:
        """The writer: the outcome every rank returns or raises (and the keys of the body's saves, which
        the last rank to hear it deletes with the call's own)."""
        if self.shared:
            if self.announced_fsyncs and not self.handed_out:
                # Ranks that wait for their fsyncs after reporting learn there are none (a failure,
                # or a commit that syncs nothing) without polling the outcome.
                self._set("fsync", {"none": True})
            self._set("outcome", {**value, "drop": list(self.published)})

    def outcome_if_decided(self) -> dict[str, Any] | None:
        """The writer's outcome if it is already published (never waits); None if not, or malformed
        (the wait for it says so)."""
        raw = self._call.get_now("outcome")
        if raw is None:
            return None
        try:
            value = self._parse(raw, "outcome")
        except MalformedValue:
            return None
        return value if isinstance(value, dict) else None

    def hear_outcome(
        self, deadline: float, problem: Callable[[dict[str, Any]], str | None] | None = None
    ) -> dict[str, Any]:
        """Every other rank: the writer's decision (MalformedValue when it is not one, or ``problem``
        finds it wrong). Acknowledged only when it is one, so that the call's keys go: a malformed
        outcome may be a value planted before the writer decided, and acknowledging it would delete this
        rank's report before the writer read it (the writer then waited out its timeout for a report
        that had been made). Never when this rank gave up waiting: the call's verdict must outlive it
        (``give_up``)."""
        value = self._wait_for_writer("outcome", deadline, f"rank {self.group.writer}'s decision")
        if not isinstance(value, dict) or not isinstance(value.get("ok"), bool):
            raise MalformedValue(f"the outcome is not one: {text(value)}")
        wrong = problem(value) if problem is not None else None
        if wrong is not None:
            raise MalformedValue(wrong)
        self._acknowledge(value)
        return value

    def _acknowledge(self, outcome: Any) -> None:
        ranks = range(self.group.world_size)
        names = [
            "call",
            "verdict",
            "announce",
            "outcome",
            "fsync",
            *(f"rank/{r}" for r in ranks),
            *(f"synced/{r}" for r in ranks),
            *_result_keys(outcome),
        ]
        self._call.acknowledge(names, self.group.world_size - 1)


def _prefix(root: str, number: int) -> str:
    return f"safeio/ckpt/{digest(root, 16)}/{number}"


def _result_keys(outcome: Any) -> list[str]:
    """The keys of the body's saves an outcome names (input: only names NestedResults gives)."""
    drop = outcome.get("drop") if isinstance(outcome, dict) else None
    if not isinstance(drop, list):
        return []
    return [
        name for name in drop if isinstance(name, str) and name.startswith("result/") and ".." not in name
    ]
