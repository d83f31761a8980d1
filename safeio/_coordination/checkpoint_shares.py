"""What the ranks of one checkpoint save share through its call, besides reports and the decision.

Saves nested in the body that only the writer keeps (a tokenizer's ``save_pretrained``) are made by the
writer alone: it publishes each one's result under the call (``result/<identity>/<n>``), the other ranks
wait for it instead of serialising the object into scratch that is thrown away (``NestedResults``). A
durable commit's fsyncs are shared out among the ranks, which sync their shares at once
(``FsyncShares``). Every value heard is input (``calls.parse_value``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any

from safeio._coordination.calls import VALUE_CAP, MalformedValue, digest, text
from safeio._coordination.checkpoint_call import CheckpointCall, DecidedFirst, LeftTheCall
from safeio._coordination.save_outcome import Outcome, decode_value, encode_value
from safeio._errors import CheckpointError, PeerTimeout

# How long the writer waits for the other ranks' fsyncs beyond four times its own share's (FsyncShares).
_SYNC_GRACE = 30.0


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
        call = self._call
        writer = call.group.writer
        waiting_for = f"rank {writer}'s result of {identity}"
        deadline = time.monotonic() + self._timeout
        try:
            # The writer may have failed before it reached this save: the outcome is looked at between
            # slices (long ones: each expired store wait logs a c10d warning), so the rank hears of it.
            raw = call._wait_for_writer(name, deadline, waiting_for, decided_first=True)
        except DecidedFirst:
            raise CheckpointError(
                f"rank {call.group.rank}: rank {writer} failed {call.what} of "
                f"{call.root} before it made the save this rank waits for ({identity})",
                call.root,
                failed={writer: "failed before the save"},
            ) from None
        except MalformedValue as exc:
            raw = {"malformed": str(exc)}
        outcome = Outcome.from_record(raw, call.root, writer)
        outcome.raise_if_failed(call.group.rank)
        return decode_value(outcome.value)


class FsyncShares:
    """The ``safeio._checkpoints.steps.SharedFsyncs`` of one durable commit: the writer hands every rank a
    share of the stage's files (``fsync``), each rank syncs its share and answers (``synced/<rank>``: the
    files it could not), all at once; the writer syncs its own share meanwhile, then what is left.

    Shares are made once every rank has reported its body done, from the writer's one walk of the
    finished stage: a rank cannot sync "the files it wrote" (every rank is the same user, and arbitrary
    writers leave no record), and a rank that listed the stage itself while others still wrote would
    miss their files. Any rank's fsync makes a file durable: on one machine the page cache is shared; on
    NFS a client's close() has already written its data to the server (close-to-open), where a COMMIT
    from any client makes it stable. Shares are balanced by size (the dirty bytes are what fsync costs).
    A rank that does not answer in time (four times as long as the writer took for its own share, and at
    least 30 s) costs only speed: the writer syncs its share itself. An answer that is not one fails the
    commit, naming the rank (a value in the store is input)."""

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
        encoded = json.dumps({str(rank): names for rank, names in shares.items()})
        if len(encoded) > VALUE_CAP:  # the ranks would refuse it as malformed: the writer syncs all
            shares = {rank: (list(sizes) if rank == group.writer else []) for rank in ranks}
            encoded = json.dumps({str(rank): names for rank, names in shares.items()})
        self._shares = shares
        self._handed_at = time.monotonic()
        self._call._call.set("fsync", encoded)
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
                answer = self._call._wait(f"synced/{rank}", deadline, f"rank {rank}'s fsyncs", from_rank=rank)
            except (PeerTimeout, LeftTheCall):
                left.extend(share)  # never answered: its share is the writer's
                continue
            except MalformedValue as exc:
                raise CheckpointError(
                    f"rank {self._call.group.rank}: rank {rank}'s answer to its share of the commit's "
                    f"fsyncs in the store is malformed ({exc})",
                    self._call.root,
                    failed={rank: "a malformed answer to its fsync share"},
                ) from None
            error = answer.get("error") if isinstance(answer, dict) else None
            unsynced = answer.get("left") if isinstance(answer, dict) else None
            if error is not None:
                raise CheckpointError(
                    f"rank {self._call.group.rank}: rank {rank} could not sync its share: {text(error)}",
                    self._call.root,
                    failed={rank: text(error)},
                )
            if not (isinstance(unsynced, list) and all(isinstance(name, str) for name in unsynced)):
                raise CheckpointError(
                    f"rank {self._call.group.rank}: rank {rank}'s answer to its share of the commit's "
                    f"fsyncs in the store is malformed (not a list of names: {text(unsynced)})",
                    self._call.root,
                    failed={rank: "a malformed answer to its fsync share"},
                )
            own = set(share)
            left.extend(name for name in unsynced if name in own)  # input: only names it was given
        return left


def hear_fsync_share(call: CheckpointCall, deadline: float) -> list[str] | None:
    """A rank other than the writer, after reporting its body: its share of the stage's files to sync;
    None when the writer decided the outcome without handing any out (a failure: nothing is committed).
    MalformedValue when what it heard is not a share."""
    shares = call._wait_for_writer("fsync", deadline, f"rank {call.group.writer}'s fsync shares")
    if not isinstance(shares, dict):
        raise MalformedValue(f"the fsync shares are not a mapping: {text(shares)}")
    if shares.get("none") is True:
        return None
    share = shares.get(str(call.group.rank), [])
    if not (isinstance(share, list) and all(isinstance(name, str) for name in share)):
        raise MalformedValue(f"this rank's fsync share is not a list of names: {text(share)}")
    return list(share)


def report_synced(call: CheckpointCall, left: list[str]) -> None:
    """A rank other than the writer: its share is synced but for ``left``."""
    call._set(f"synced/{call.group.rank}", {"left": left})


def report_sync_failed(call: CheckpointCall, error: str) -> None:
    """A rank other than the writer that cannot take part in the commit's fsyncs (it gave up, or what it
    heard was malformed): the writer fails the commit naming it, instead of waiting for its answer."""
    call._set(f"synced/{call.group.rank}", {"error": error})
