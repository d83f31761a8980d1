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
import hashlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from safeio._coordination.group import Group, job_id
from safeio._errors import PeerTimeout, RemoteWriterError
from safeio._who import who

logger = logging.getLogger("safeio")

# Keys of calls this far back are deleted by the writer: a peer that is that many saves of one target
# behind is not waiting for them any more (and the store must not grow without bound over a long run).
KEEP_CALLS = 64
_FIRST_PAUSE = 0.05
_LOG_EVERY = 30.0

_counter_lock = threading.Lock()
_counters: dict[tuple[str, str], int] = {}


def target_digest(target_url: str) -> str:
    return hashlib.sha256(target_url.encode("utf-8", "surrogateescape")).hexdigest()[:20]


def encode_value(value: Any) -> Any:
    """A JSON form of a save's return value (tuples survive, as HF returns tuples of paths)."""
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode_value(v) for k, v in value.items()}
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def decode_value(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(decode_value(v) for v in value["__tuple__"])
        return {k: decode_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    return value


@dataclass(frozen=True)
class Outcome:
    ok: bool
    target: str
    writer_rank: int
    error_type: str | None = None
    error_message: str | None = None
    value: Any = None  # the writer's result (encode_value form), handed to every rank
    # What identifies the promoted version on disk (a local manifest's inode and size), so that a peer
    # confirms it sees that version with one stat instead of reading the manifest and every file, and the
    # version it replaced (None: none), so that a peer can tell a rival's later version from a stale view.
    version: list[int] | None = None
    replaced: list[int] | None = None

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Outcome:
        return cls(**json.loads(raw))

    @classmethod
    def failure(cls, target: str, writer_rank: int, error: BaseException) -> Outcome:
        return cls(False, target, writer_rank, type(error).__name__, str(error))

    def raise_if_failed(self, rank: int) -> None:
        if self.ok:
            return
        raise RemoteWriterError(
            f"rank {rank}: the writer (rank {self.writer_rank}) failed to save {self.target}: "
            f"{self.error_type}: {self.error_message}",
            self.target,
            writer_rank=self.writer_rank,
            error_type=self.error_type,
            error_message=self.error_message,
        )


def is_store_timeout(error: BaseException) -> bool:
    if isinstance(error, TimeoutError):
        return True
    dist = sys.modules.get("torch.distributed")
    store_error = getattr(dist, "DistStoreError", None)
    network_error = getattr(dist, "DistNetworkError", None)
    if network_error is not None and isinstance(error, network_error):
        return False
    return store_error is not None and isinstance(error, store_error)


class Channel:
    """The keys of one call (target, sequence number) in the group's store."""

    def __init__(self, group: Group, target_url: str, identity: str, seq: int) -> None:
        self.group = group
        self.target_url = target_url
        self.identity = identity
        self.seq = seq
        self.digest = target_digest(target_url)
        self.identity_digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
        self.key = self._key(seq)
        self.last_key = f"safeio/{self.digest}/last"
        self.phase_key = self.key + "/phase"
        self.ack_key = self.key + "/acks"
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
        with _counter_lock:
            seq = _counters[target_url, identity] = _counters.get((target_url, identity), 0) + 1
        return cls(group, target_url, identity, seq)

    def _key(self, seq: int) -> str:
        return f"safeio/{self.digest}/{self.identity_digest}/{seq}"

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
        store = self.group.store
        if store is None or self.group.world_size == 1:
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
            store.set(self.phase_key, json.dumps(record))
        except Exception as exc:  # progress is advisory: never fail a save because peers cannot see it
            logger.debug("%s: could not publish phase of %s: %s", who(self.group.rank), self.target_url, exc)
        finally:
            self._publishing.release()

    def publish(self, outcome: Outcome) -> None:
        store = self.group.store
        if store is None or self.group.world_size == 1:
            return
        with self._publishing:
            self._closed = True
        try:
            # For a peer's timeout message: what this writer last saved of the target. Set before the
            # outcome: the last peer to hear the outcome deletes it, and must not do so before it is set.
            last = {"identity": self.identity, "seq": self.seq, "ok": outcome.ok}
            store.set(self.last_key, json.dumps(last))
            store.set(self.key, outcome.encode())
        except Exception as exc:
            # Peers fall back to the filesystem (or time out with a PeerTimeout naming this rank).
            logger.warning(
                "%s: could not publish the outcome of %s to the store: %s",
                who(self.group.rank),
                self.target_url,
                exc,
            )
            return
        if self.seq > KEEP_CALLS:
            old = self._key(self.seq - KEEP_CALLS)
            for key in (old, old + "/phase", old + "/acks"):
                _delete_quietly(store, key)

    # -- non-writer side ---------------------------------------------------------------------------

    def wait(
        self, timeout: float, landed: Callable[[], bool] | None, result: Callable[[], Any] | None = None
    ) -> Outcome:
        """Wait for the writer's outcome for at most ``timeout`` seconds.

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
        start = time.monotonic()
        deadline = start + timeout
        store = self.group.store
        if store is not None:
            outcome = self._wait_store(store, deadline, start)
            if outcome is not None:
                return outcome
        return self._wait_filesystem(landed, deadline, start)

    def wait_visible(self, landed: Callable[[], bool], deadline: float) -> None:
        """After a successful outcome: wait (bounded) until the promoted result is visible to this rank."""
        pause, waited_from = _FIRST_PAUSE, time.monotonic()
        while not landed():
            if time.monotonic() >= deadline:
                raise PeerTimeout(
                    f"rank {self.group.rank}: rank {self.group.writer} promoted {self.target_url}, but this "
                    f"rank still does not see that version after {time.monotonic() - waited_from:.1f} s "
                    "(a stale client cache on a network filesystem?)",
                    self.target_url,
                    waited_for=self.group.writer,
                    phase="done",
                )
            time.sleep(min(pause, max(deadline - time.monotonic(), 0)))  # bounded poll of the filesystem
            pause = min(pause * 2, 0.5)

    def _wait_store(self, store: Any, deadline: float, start: float) -> Outcome | None:
        # store.wait returns as soon as the key is set, so long slices cost no latency; each slice that
        # expires makes c10d print a warning, so slices are as long as the progress-log interval.
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout(time.monotonic() - start)
            try:
                store.wait([self.key], timedelta(seconds=min(_LOG_EVERY, remaining)))
                raw = store.get(self.key)
            except Exception as exc:
                if not is_store_timeout(exc):
                    # Expected at the end of a run: rank 0 hosts the TCPStore and may already have left.
                    logger.info(
                        "%s: the store became unreachable while waiting for %s (%s); "
                        "watching the filesystem instead",
                        who(self.group.rank),
                        self.target_url,
                        exc,
                    )
                    return None
                if time.monotonic() < deadline:
                    logger.info("%s: still waiting: %s", who(self.group.rank), self._writer_status())
                continue
            self._acknowledge(store)
            return Outcome.decode(raw)

    def _acknowledge(self, store: Any) -> None:
        """The last peer to read the outcome deletes this call's keys, and the target's ``last`` record:
        the store holds nothing of a save every peer has heard (a run that saves into a new directory
        every step would otherwise keep one key per directory). If the writer has meanwhile published a
        newer save of the target, its ``last`` record goes too; it only ever informs a timeout message."""
        try:
            if store.add(self.ack_key, 1) >= self.group.world_size - 1:
                for key in (self.key, self.phase_key, self.ack_key, self.last_key):
                    _delete_quietly(store, key)
        except Exception as exc:
            logger.debug("%s: could not acknowledge %s: %s", who(self.group.rank), self.key, exc)

    def _wait_filesystem(self, landed: Callable[[], bool] | None, deadline: float, start: float) -> Outcome:
        pause, next_log = _FIRST_PAUSE, start + _LOG_EVERY
        while True:
            if landed is not None and landed():
                return Outcome(True, self.target_url, self.group.writer, value=self._landed_value)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout(time.monotonic() - start)
            if time.monotonic() >= next_log:
                next_log += _LOG_EVERY
                logger.info(
                    "%s: still waiting for %s to appear on the filesystem",
                    who(self.group.rank),
                    self.target_url,
                )
            time.sleep(min(pause, remaining))  # bounded poll: a filesystem offers nothing to block on
            pause = min(pause * 2, 1.0)

    def _writer_record(self) -> dict[str, Any] | None:
        store = self.group.store
        if store is None:
            return None
        try:
            if not store.check([self.phase_key]):
                return None
            record = json.loads(store.get(self.phase_key))
        except Exception:
            return None
        return record if isinstance(record, dict) else None

    def _writer_status(self) -> str:
        writer = self.group.writer
        record = self._writer_record()
        if record is None:
            return (
                f"rank {writer} has published nothing for this save ({self._this_save()}); "
                f"{self._last_published(writer)}"
            )
        now = time.time()
        return (
            f"rank {writer} ({record.get('host')} pid {record.get('pid')}) has been in "
            f"{record.get('phase')} of {self.target_url} for {now - float(record.get('since', now)):.0f} s "
            f"(last heard {now - float(record.get('heard', now)):.0f} s ago)"
        )

    def _this_save(self) -> str:
        return f"#{self.seq} of {self.identity}"

    def _last_published(self, writer: int) -> str:
        store = self.group.store
        last = None
        with contextlib.suppress(Exception):
            if store is not None and store.check([self.last_key]):
                last = json.loads(store.get(self.last_key))
        if not isinstance(last, dict):
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


def _delete_quietly(store: Any, key: str) -> None:
    try:
        store.delete_key(key)
    except Exception as exc:
        logger.debug("could not delete store key %s: %s", key, exc)
