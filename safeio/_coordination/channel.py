"""One save's line from the writer to its peers: progress phases and the final outcome.

The writer *publishes* (a key in the group's store, named by the target, the save's identity — which call
makes it, see ``safeio._saves.identity`` — and how many saves of that identity came before) and never
waits; a non-writer that made the same call waits for that key, in bounded slices, logging
while it waits. If the store becomes unreachable (rank 0 hosts the TCPStore and may exit as soon as it
has published), or the group has no store at all, the non-writer falls back to watching the promoted
target on the filesystem. Every wait ends by ``timeout`` with a PeerTimeout that says what the writer
was last doing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from safeio._coordination.calls import (
    MalformedValue,
    Progress,
    StoreCall,
    StoreGone,
    digest,
    next_number,
    parse_value,
    poll_until,
)
from safeio._coordination.group import Group, job_id
from safeio._coordination.save_outcome import Outcome, is_int
from safeio._errors import PeerTimeout
from safeio._stalls import Cadence, seconds
from safeio._who import who

logger = logging.getLogger("safeio")

# Keys of calls this far back are deleted by the writer: a peer that is that many saves of one target
# behind is not waiting for them any more (and the store must not grow without bound over a long run).
STORE_CALLS_KEPT = 64


def target_digest(target_url: str) -> str:
    return digest(target_url, 20)


class Channel:
    """One replicated save's call in the group's store: its outcome, the writer's phase, the acks."""

    waiting = False  # the watchdog's PhaseSource: the writer never waits for its peers

    def __init__(self, group: Group, target_url: str, identity: str, seq: int) -> None:
        self.group = group
        self.target_url = target_url
        self.identity = identity
        self.seq = seq
        self.digest = target_digest(target_url)
        self.identity_digest = digest(identity, 12)
        # The outcome is the prefix itself; "phase" and "acks" beside it. "last" is per target.
        self.call = StoreCall(group, self._prefix(seq), target_url)
        self.last = StoreCall(group, f"safeio/{self.digest}/last", target_url)
        self.phase = "start"
        self.phase_since = time.time()
        self._landed_value: Any = None
        self._publishing = threading.Lock()  # safeio.watchdog: see heartbeat
        # Set once the outcome is published: the last peer to read it deletes the call's keys, and a
        # phase record written after that (the "done" phase, a watchdog refresh) would outlive the call.
        self._closed = False

    @classmethod
    def open(cls, group: Group, target_url: str, identity: str) -> Channel:
        """The next save of ``target_url`` with ``identity`` from this process: every rank numbers the
        saves of each identity, and only those, so saves other ranks never make do not shift the count."""
        return cls(group, target_url, identity, next_number((target_url, identity)))

    def _prefix(self, seq: int) -> str:
        return f"safeio/{self.digest}/{self.identity_digest}/{seq}"

    @property
    def key(self) -> str:
        return self.call.key()

    @property
    def hears_through_store(self) -> bool:
        """Whether a peer can hear the outcome through the store (else only the filesystem tells)."""
        return self.group.store is not None

    @property
    def call_id(self) -> str:
        """Recorded in the manifest, so a store-less peer can recognise *this* save's result on disk."""
        return f"{job_id()}/{self.digest}/{self.identity_digest}/{self.seq}"

    # -- writer side -------------------------------------------------------------------------------

    def enter_phase(self, phase: str) -> None:
        self.phase, self.phase_since = phase, time.time()
        self.heartbeat()

    def heartbeat(self, *, wait: bool = True) -> None:
        """Publish the current phase (refreshed by the watchdog while a phase lasts).

        ``wait=False`` (the watchdog) skips the refresh if the writer thread is publishing right now.
        """
        if not self.call.shared:
            return
        # safeio.watchdog: one publisher at a time, so a refresh read before a phase change cannot land
        # after it and show peers the old phase.
        if not self._publishing.acquire(blocking=wait):
            return
        try:
            if self._closed:
                return
            record = {
                "phase": self.phase,
                "since": self.phase_since,
                "heard": time.time(),
                "host": self.group.host,
                "pid": os.getpid(),
                "rank": self.group.rank,
            }
            self.call.set("phase", json.dumps(record))
        except Exception as exc:  # progress is advisory: never fail a save because peers cannot see it
            logger.debug("%s: could not publish phase of %s: %s", who(self.group.rank), self.target_url, exc)
        finally:
            self._publishing.release()

    def publish(self, outcome: Outcome) -> None:
        if not self.call.shared:
            return
        with self._publishing:
            self._closed = True
        try:
            # For a peer's timeout message: what this writer last saved of the target. Set before the
            # outcome: the last peer to hear the outcome deletes it, and must not do so before it is set.
            last = {"identity": self.identity, "seq": self.seq, "ok": outcome.ok}
            self.last.set("", json.dumps(last))
            self.call.set("", outcome.encode())
        except Exception as exc:
            # Peers fall back to the filesystem (or time out with a PeerTimeout naming this rank).
            logger.warning(
                "%s: could not publish the outcome of %s to the store: %s",
                who(self.group.rank),
                self.target_url,
                exc,
            )
            return
        if self.seq > STORE_CALLS_KEPT:
            StoreCall(self.group, self._prefix(self.seq - STORE_CALLS_KEPT), self.target_url).delete(
                ("", "phase", "acks")
            )

    # -- non-writer side ---------------------------------------------------------------------------

    def wait(
        self,
        timeout: float,
        landed: Callable[[], bool] | None,
        result: Callable[[], Any] | None = None,
        *,
        warn_after: float = math.inf,
    ) -> Outcome:
        """Wait for the writer's outcome for at most ``timeout`` seconds; after ``warn_after`` seconds
        (then each time the wait has doubled) a WARNING says what the writer was last doing.

        ``landed`` checks the filesystem for this save's promoted result; it is used when there is no
        store or it becomes unreachable, and then ``result`` reads the writer's recorded return value.
        """
        self._landed_value = None
        if result is not None and landed is not None:
            inner = landed

            def landed_with_result() -> bool:
                if not inner():
                    return False
                self._landed_value = result()
                return True

            landed = landed_with_result
        cadence = Cadence(warn_after)
        deadline = cadence.start + timeout
        if self.hears_through_store:
            outcome = self._wait_store(deadline, cadence)
            if outcome is not None:
                return outcome
        return self._wait_filesystem(landed, deadline, cadence)

    def wait_visible(self, landed: Callable[[], bool], deadline: float) -> None:
        """After a successful outcome: wait (bounded) until the promoted result is visible to this rank."""
        waited_from = time.monotonic()

        def expired() -> PeerTimeout:
            return PeerTimeout(
                f"rank {self.group.rank}: rank {self.group.writer} promoted {self.target_url}, but this "
                f"rank still does not see that version after {time.monotonic() - waited_from:.1f} s "
                "(a stale client cache on a network filesystem?)",
                self.target_url,
                waited_for=self.group.writer,
                phase="done",
            )

        poll_until(landed, deadline, expired=expired)

    def _wait_store(self, deadline: float, cadence: Cadence) -> Outcome | None:
        def still_waiting(elapsed: float) -> None:
            logger.warning(
                "%s: still waiting after %s s for rank %d to save %s: %s",
                who(self.group.rank),
                seconds(elapsed),
                self.group.writer,
                self.target_url,
                self._writer_status(),
            )

        try:
            raw = self.call.wait(
                "",
                deadline,
                expired=lambda: self._timeout(cadence.elapsed()),
                progress=Progress(cadence, still_waiting),
            )
        except StoreGone as gone:
            # Expected at the end of a run: rank 0 hosts the TCPStore and may already have left.
            logger.info(
                "%s: the store became unreachable while waiting for %s (%s); watching the filesystem instead",
                who(self.group.rank),
                self.target_url,
                gone.__cause__,
            )
            return None
        self._acknowledge()
        return Outcome.decode(raw, self.key, self.target_url, self.group.writer)

    def _acknowledge(self) -> None:
        """The last peer to read the outcome deletes this call's keys, and the target's ``last`` record:
        the store holds nothing of a save every peer has heard (a run that saves into a new directory
        every step would otherwise keep one key per directory). If the writer has meanwhile published a
        newer save of the target, its ``last`` record goes too; it only ever informs a timeout message."""
        if self.call.acknowledge(("", "phase"), self.group.world_size - 1):
            self.last.delete(("",))

    def _wait_filesystem(
        self, landed: Callable[[], bool] | None, deadline: float, cadence: Cadence
    ) -> Outcome:
        def still_waiting(elapsed: float) -> None:
            logger.warning(
                "%s: still waiting after %s s for rank %d's save of %s to appear on the filesystem "
                "(this group has no store to hear it through)",
                who(self.group.rank),
                seconds(elapsed),
                self.group.writer,
                self.target_url,
            )

        poll_until(
            landed if landed is not None else lambda: False,
            deadline,
            expired=lambda: self._timeout(cadence.elapsed()),
            progress=Progress(cadence, still_waiting),
        )
        return Outcome(True, self.target_url, self.group.writer, value=self._landed_value)

    def _writer_record(self) -> dict[str, Any] | None:
        """The writer's phase record, if it is one (input: a malformed one is as good as none here, in a
        progress line or a timeout's message)."""
        raw = self.call.get_now("phase")
        if raw is None:
            return None
        with contextlib.suppress(MalformedValue):
            record = parse_value(raw, self.call.key("phase"))
            if isinstance(record, dict) and _is_phase_record(record):
                return record
        return None

    def _writer_status(self) -> str:
        writer = self.group.writer
        record = self._writer_record()
        if record is None:
            return (
                f"rank {writer} has published nothing for this save ({self._this_save()}); "
                f"{self._last_published()}"
            )
        now = time.time()
        host, pid, phase = (str(record.get(name))[:100] for name in ("host", "pid", "phase"))  # input
        return (
            f"rank {writer} ({host} pid {pid}) has been in {phase} of {self.target_url} for "
            f"{now - float(record.get('since', now)):.0f} s "
            f"(last heard {now - float(record.get('heard', now)):.0f} s ago)"
        )

    def _this_save(self) -> str:
        return f"#{self.seq} of {self.identity}"

    def _last_published(self) -> str:
        raw = self.last.get_now("")
        last = None
        with contextlib.suppress(MalformedValue):
            last = parse_value(raw, self.last.key()) if raw is not None else None
        known = isinstance(last, dict) and is_int(last.get("seq")) and isinstance(last.get("identity"), str)
        if not (known and isinstance(last, dict)):
            return (
                f"no save of {self.target_url} by it is on record (none yet, or every peer has heard the "
                "last one)"
            )
        outcome = "succeeded" if last.get("ok") else "failed"
        return (
            f"the last save of {self.target_url} it published was #{last.get('seq')} of "
            f"{last.get('identity')} ({outcome}); it has not reached this save, or makes it from other code "
            "or fewer times than this rank"
        )

    def _timeout(self, waited: float) -> PeerTimeout:
        record = self._writer_record()
        phase = str(record["phase"]) if record and "phase" in record else None
        return PeerTimeout(
            f"rank {self.group.rank} waited {waited:.1f} s for rank {self.group.writer} to save "
            f"{self.target_url}: {self._writer_status()}",
            self.target_url,
            waited_for=self.group.writer,
            phase=phase,
        )


def _is_phase_record(record: dict[str, Any]) -> bool:
    """Whether a phase record heard from the store has the types a progress line formats."""
    times = (record.get("since", 0), record.get("heard", 0))
    return isinstance(record.get("phase"), str) and all(
        isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) for t in times
    )
