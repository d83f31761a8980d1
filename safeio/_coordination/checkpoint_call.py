"""A checkpoint's calls in the store: every rank reports, the writer decides, everyone hears it, bounded.

Keys live under ``safeio/ckpt/<root digest>/<n>``, where ``n`` numbers this process's collective calls on
the root (``save`` and ``latest()`` are collective: every rank makes them, in the same order). The writer
never blocks forever: it waits for the other ranks' reports at most until the deadline and then names the
ranks that never reported. The keys go once every other rank has read the outcome.

Saves nested in the body that only the writer keeps (a tokenizer's ``save_pretrained``) are made by the
writer alone: it publishes each one's result under the call (``result/<identity>/<n>``), the other ranks
wait for it instead of serialising the object into scratch that is thrown away (``WriterResults``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any

from safeio._coordination.calls import SLICE, StoreCall, StoreGone, digest, next_number
from safeio._coordination.channel import Outcome, decode_value, encode_value
from safeio._coordination.group import Group
from safeio._errors import CheckpointError, PeerTimeout

# How long the writer waits for the other ranks' fsyncs beyond four times its own share's (FsyncShares).
_SYNC_GRACE = 30.0


class DecidedFirst(Exception):
    """The writer decided the call's outcome before it set the key a rank was waiting for."""

    def __init__(self, outcome: dict[str, Any]) -> None:
        super().__init__(outcome)
        self.outcome = outcome


class CheckpointCall:
    """One collective call (``what``: "save of step 5", "latest()") on the checkpoint root ``root``."""

    def __init__(
        self,
        group: Group,
        root: str,
        what: str,
        *,
        call: StoreCall | None = None,
        published: list[str] | None = None,
        announced_fsyncs: bool = False,
    ) -> None:
        self.group = group
        self.root = root
        self.what = what
        # Keys the writer set for the body's saves (NestedResults): deleted with the call's own keys.
        self.published: list[str] = published if published is not None else []
        # Whether the writer told the ranks to wait for their fsyncs (FsyncShares), and has handed them out.
        self.announced_fsyncs = announced_fsyncs
        self.handed_out = False
        if call is None:
            prefix = f"safeio/ckpt/{digest(root, 16)}/{next_number(('checkpoints', root))}"
            call = StoreCall(group, prefix, root)
        self._call = call

    def on_group(self, group: Group) -> CheckpointCall:
        """The same call through another connection to the store (the async commit's thread)."""
        return CheckpointCall(
            group,
            self.root,
            self.what,
            call=self._call.on_group(group),
            published=self.published,
            announced_fsyncs=self.announced_fsyncs,
        )

    @property
    def shared(self) -> bool:
        return self._call.shared

    def _set(self, name: str, value: Any) -> None:
        self._call.set(name, json.dumps(value))

    def _wait(
        self, name: str, deadline: float, waiting_for: str, *, slice_seconds: float | None = None
    ) -> Any:
        def expired() -> PeerTimeout:
            return PeerTimeout(
                f"rank {self.group.rank}: {waiting_for} did not arrive within the timeout "
                f"({self.what} of {self.root})",
                self.root,
                waited_for=self.group.writer,
            )

        if slice_seconds is None:
            raw = self._call.wait(name, deadline, expired=expired)  # StoreGone: the store's host has left
        else:
            raw = self._wait_checking_outcome(name, deadline, expired, slice_seconds)
        try:
            return json.loads(raw)
        except ValueError:
            return None

    def _wait_checking_outcome(self, name: str, deadline: float, expired: Any, slice_seconds: float) -> bytes:
        """Wait for ``name`` in slices; between them, raise ``DecidedFirst`` if the writer has decided the
        call's outcome meanwhile (it then never sets ``name``: it failed before, or needs no answer)."""
        while True:
            until = min(deadline, time.monotonic() + slice_seconds)
            try:
                return self._call.wait(name, until, expired=expired)
            except StoreGone:
                raise
            except PeerTimeout:
                decided = self.outcome_if_decided()
                if decided is not None:
                    raise DecidedFirst(decided) from None
                if until >= deadline:
                    raise

    # -- the writer publishes, the others wait -------------------------------------------------------

    def announce(self, value: Any) -> None:
        """The writer: something every rank needs before its body (the stage's name), or a failure."""
        if self.shared:
            self.announced_fsyncs = isinstance(value, dict) and value.get("sync") is True
            self._set("announce", value)

    def hear_announcement(self, deadline: float) -> Any:
        return self._wait("announce", deadline, f"rank {self.group.writer}'s stage")

    def report(self, value: dict[str, Any]) -> None:
        """Every rank but the writer: how its part went ({"ok": bool, "error": str})."""
        if self.shared:
            self._set(f"rank/{self.group.rank}", value)

    def collect(self, deadline: float) -> tuple[dict[int, str], list[int]]:
        """The writer: every other rank's report, bounded. Returns (failed rank -> error, missing ranks)."""
        failed: dict[int, str] = {}
        missing: list[int] = []
        if not self.shared:
            return failed, missing
        for rank in range(self.group.world_size):
            if rank == self.group.rank:
                continue
            try:
                report = self._wait(f"rank/{rank}", deadline, f"rank {rank}'s report")
            except PeerTimeout:
                missing.append(rank)
                continue
            if not (isinstance(report, dict) and report.get("ok") is True):
                error = report.get("error") if isinstance(report, dict) else None
                failed[rank] = str(error or "failed")
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
        """The writer's outcome if it is already published (never waits)."""
        raw = self._call.get_now("outcome")
        try:
            value = json.loads(raw) if raw is not None else None
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def hear_outcome(self, deadline: float) -> dict[str, Any]:
        value = self._wait("outcome", deadline, f"rank {self.group.writer}'s commit")
        ranks = range(self.group.world_size)
        names = [
            "announce",
            "outcome",
            "fsync",
            *(f"rank/{r}" for r in ranks),
            *(f"synced/{r}" for r in ranks),
            *_result_keys(value),
        ]
        self._call.acknowledge(names, self.group.world_size - 1)
        return value if isinstance(value, dict) else {"ok": False, "error": "a malformed outcome"}


def _result_keys(outcome: Any) -> list[str]:
    """The keys of the body's saves an outcome names (input: only names NestedResults gives)."""
    drop = outcome.get("drop") if isinstance(outcome, dict) else None
    if not isinstance(drop, list):
        return []
    return [
        name for name in drop if isinstance(name, str) and name.startswith("result/") and ".." not in name
    ]


class NestedResults:
    """The ``safeio._promotion.active.WriterResults`` of one checkpoint's body: saves that only the
    writer keeps are made by the writer alone, and every other rank gets the writer's return value.

    Before, every rank serialised the object into node-local scratch and deleted it at the end of the
    checkpoint: 16-30 ms per rank per checkpoint for a tokenizer, a quarter of what safeio added to an
    async save. Each result is a key under the checkpoint's call; the writer's decision names them, and the
    last rank to hear it deletes them with the call's own keys (every rank has left its body by then), the
    results of saves the writer made alone included (a "rank 0 only" guard: nobody reads them)."""

    def __init__(self, call: CheckpointCall, timeout: float) -> None:
        self._call = call
        self._timeout = timeout
        self._numbers: dict[str, int] = {}

    @property
    def writes(self) -> bool:
        # Without a store there is no way to hear the writer: every rank saves for itself, as before.
        return self._call.group.is_writer or not self._call.shared

    def _name(self, identity: str) -> str:
        number = self._numbers[identity] = self._numbers.get(identity, 0) + 1
        return f"result/{digest(identity, 12)}/{number}"

    def publish(self, identity: str, value: Any, error: BaseException | None) -> None:
        name = self._name(identity)
        if not self._call.shared:
            return
        group = self._call.group
        if error is None:
            outcome = Outcome(True, self._call.root, group.rank, value=encode_value(value))
        else:
            outcome = Outcome.failure(self._call.root, group.rank, error)
        self._call._set(name, asdict(outcome))
        self._call.published.append(name)

    def hear(self, identity: str) -> Any:
        name = self._name(identity)
        waiting_for = f"rank {self._call.group.writer}'s result of {identity}"
        deadline = time.monotonic() + self._timeout
        try:
            # The writer may have failed before it reached this save: the outcome is looked at between
            # slices (long ones: each expired store wait logs a c10d warning), so the rank hears of it.
            raw = self._call._wait(name, deadline, waiting_for, slice_seconds=SLICE)
        except DecidedFirst:
            raise CheckpointError(
                f"rank {self._call.group.rank}: rank {self._call.group.writer} failed {self._call.what} of "
                f"{self._call.root} before it made the save this rank waits for ({identity})",
                self._call.root,
                failed={self._call.group.writer: "failed before the save"},
            ) from None
        try:
            outcome = Outcome(**raw) if isinstance(raw, dict) else None
        except TypeError:
            outcome = None
        if outcome is None:
            outcome = Outcome(
                False, self._call.root, self._call.group.writer, "ValueError", "a malformed result"
            )
        outcome.raise_if_failed(self._call.group.rank)
        return decode_value(outcome.value)


class FsyncShares:
    """The ``safeio._promotion.steps.SharedFsyncs`` of one durable commit: the writer hands every rank a
    share of the stage's files (``fsync``), each rank syncs its share and answers (``synced/<rank>``: the
    files it could not), all at once; the writer syncs its own share meanwhile, then what is left.

    Shares are made once every rank has reported its body done, from the writer's one walk of the
    finished stage: a rank cannot sync "the files it wrote" (every rank is the same user, and arbitrary
    writers leave no record), and a rank that listed the stage itself while others still wrote would
    miss their files. Any rank's fsync makes a file durable: on one machine the page cache is shared; on
    NFS a client's close() has already written its data to the server (close-to-open), where a COMMIT
    from any client makes it stable. Shares are balanced by size (the dirty bytes are what fsync costs).
    A rank that does not answer in time (four times as long as the writer took for its own share, and at
    least 30 s) costs only speed: the writer syncs its share itself."""

    def __init__(self, call: CheckpointCall, timeout: float) -> None:
        self._call = call
        self._timeout = timeout
        self._shares: dict[int, list[str]] = {}
        self._handed_at = 0.0

    def hand_out(self, sizes: dict[str, int]) -> list[str]:
        group = self._call.group
        ranks = range(group.world_size)
        shares: dict[int, list[str]] = {rank: [] for rank in ranks}
        loads = dict.fromkeys(ranks, 0)
        # Largest first, each to the rank with the fewest bytes so far.
        for rel, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
            rank = min(ranks, key=lambda r: (loads[r], r))
            shares[rank].append(rel)
            loads[rank] += max(size, 1)
        self._shares = shares
        self._handed_at = time.monotonic()
        self._call._set("fsync", {str(rank): names for rank, names in shares.items()})
        self._call.handed_out = True
        return shares[group.writer]

    def left_over(self) -> list[str]:
        # Shares are balanced by size, so a rank still syncing long after the writer finished its own is
        # stuck, or died after its report: rather than hold the commit for the whole timeout, the writer
        # then syncs that share itself (a second fsync of a file is harmless).
        now = time.monotonic()
        deadline = min(self._handed_at + self._timeout, now + max(_SYNC_GRACE, 4 * (now - self._handed_at)))
        left: list[str] = []
        for rank, share in sorted(self._shares.items()):
            if rank == self._call.group.writer or not share:
                continue
            try:
                answer = self._call._wait(f"synced/{rank}", deadline, f"rank {rank}'s fsyncs")
            except PeerTimeout:
                left.extend(share)  # never answered: its share is the writer's
                continue
            unsynced = answer.get("left") if isinstance(answer, dict) else None
            if not isinstance(unsynced, list):
                left.extend(share)
                continue
            own = set(share)
            left.extend(name for name in unsynced if name in own)  # input: only names it was given
        return left


def hear_fsync_share(call: CheckpointCall, deadline: float) -> list[str] | None:
    """A rank other than the writer, after reporting its body: its share of the stage's files to sync;
    None when the writer decided the outcome without handing any out (a failure: nothing is committed)."""
    shares = call._wait("fsync", deadline, f"rank {call.group.writer}'s fsync shares")
    if not isinstance(shares, dict) or shares.get("none") is True:
        return None
    share = shares.get(str(call.group.rank))
    return [str(name) for name in share] if isinstance(share, list) else []


def report_synced(call: CheckpointCall, left: list[str]) -> None:
    """A rank other than the writer: its share is synced but for ``left``."""
    call._set(f"synced/{call.group.rank}", {"left": left})
