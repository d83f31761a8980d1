"""The one protocol safeio speaks through the group's key-value store (torch.distributed's TCPStore).

A *call* is one thing every rank involved does together: a replicated save of one target, or one
collective step on a checkpoint root (``save``, ``latest()``). Like DCP's ``StorageWriter``, whose
docstring numbers its calls and says who makes each, every process numbers its calls per *scope* (a
target and the save's identity; a checkpoint root), so every rank computes the same keys without
talking. One rank sets keys and never waits for them to be read; the others wait for a key in bounded
slices (``store.wait`` returns as soon as the key is set, so long slices cost no latency; each slice that
expires makes c10d log a warning, so they are not short), and tell a timeout from a store that is gone:
rank 0 hosts the TCPStore and may exit as soon as it has published, at the end of a run. The last reader
acknowledges and deletes the call's keys, so the store does not grow over a long run.

Only this package talks to the store (``tests/test_layout.py`` pins it); foreign store errors are sorted
in ``safeio._boundary``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from safeio._boundary import store_timed_out
from safeio._coordination.group import Group
from safeio._errors import PeerTimeout
from safeio._stalls import Cadence
from safeio._storage.metadata import Damaged, parse_json
from safeio._who import who

logger = logging.getLogger("safeio")

SLICE = 30.0  # one store.wait at most this long, so a long wait still logs and notices its deadline
# The largest store value parsed: a durable commit's fsync shares, the largest value safeio sets, name
# every file of the checkpoint (60,000 names of 60 bytes fit; a larger set is synced by the writer alone).
# TCPStore itself refuses values over 8 MiB.
VALUE_CAP = 4 << 20

_counter_lock = threading.Lock()
_counters: dict[object, int] = {}


def next_number(scope: object) -> int:
    """The number of this process's next call in ``scope`` (1, 2, ...). Every rank makes the calls of a
    scope in the same order, so the numbers agree across ranks; saves other ranks never make are in
    scopes of their own and do not shift them."""
    with _counter_lock:
        number = _counters[scope] = _counters.get(scope, 0) + 1
    return number


def digest(text: str, size: int) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:size]


class StoreGone(PeerTimeout):
    """The store is unreachable while a rank waits: rank 0 hosts it and may have finished."""


class MalformedValue(Exception):
    """A store value that is not what safeio sets there. Every value is untrusted input: TCPStore has
    no authentication, so anyone who reaches its port can set any key (JSON nested 100,000 deep made
    ``json.loads`` raise RecursionError and killed the writer of a checkpoint before it published an
    outcome). Callers turn it into the SafeIOError of their call, naming the rank the value is from."""


def parse_value(raw: bytes, key: str) -> Any:
    """``raw`` (the value of ``key``) as JSON, within a size cap and a depth bound; else MalformedValue."""
    parsed = parse_json(raw, f"store value {key}", VALUE_CAP)
    if isinstance(parsed, Damaged):
        raise MalformedValue(parsed.reason)
    return parsed


class StoreCall:
    """The keys of one call: ``<prefix>`` and ``<prefix>/<name>``."""

    def __init__(self, group: Group, prefix: str, path: str) -> None:
        self.group = group
        self.prefix = prefix
        self.path = path  # the target or root the call is about, for errors
        # Whether there are peers to hear this call through a store (else the filesystem is all). An
        # attribute (a Group never changes): every phase a rank publishes asks it.
        self.shared = group.world_size > 1 and group.store is not None

    def on_group(self, group: Group) -> StoreCall:
        """The same call through another connection to the store (a background thread's)."""
        return StoreCall(group, self.prefix, self.path)

    def key(self, name: str = "") -> str:
        return f"{self.prefix}/{name}" if name else self.prefix

    def parse(self, name: str, raw: bytes) -> Any:
        """``raw``, the value heard for ``name``, parsed (``parse_value``: MalformedValue if it is not)."""
        return parse_value(raw, self.key(name))

    def set(self, name: str, value: str | bytes) -> None:
        store = self.group.store
        assert store is not None, "set() on a call without a store"
        store.set(self.key(name), value)

    def claim(self, name: str, value: str) -> bytes | None:
        """Set ``name`` to ``value`` unless it is set; return what it holds then (one round trip,
        atomic: of several ranks claiming one key, exactly one sets it and every one sees its value).
        None when the store cannot tell: a custom store without ``compare_set``, or a store that is gone
        (rank 0, its host, has finished: at the end of a run the ranks after it find none)."""
        store = self.group.store
        assert store is not None, "claim() on a call without a store"
        compare_set = getattr(store, "compare_set", None)
        if compare_set is None:
            return None
        try:
            return bytes(compare_set(self.key(name), "", value))
        except Exception as exc:
            logger.debug("%s: could not claim %s: %s", who(self.group.rank), self.key(name), exc)
            return None

    def get_now(self, name: str) -> bytes | None:
        """The value of ``name`` if it is set; None otherwise, or if the store cannot say. Never waits."""
        store = self.group.store
        if store is None:
            return None
        with contextlib.suppress(Exception):
            if store.check([self.key(name)]):
                return bytes(store.get(self.key(name)))
        return None

    def wait(
        self,
        name: str,
        deadline: float,
        *,
        expired: Callable[[], BaseException],
        progress: Progress | None = None,
    ) -> bytes:
        """The value of ``name`` once it is set. At ``deadline`` raises ``expired()`` (after a last look:
        a value set in time is not lost to a slow read); ``StoreGone`` when the store is unreachable.
        ``progress`` says, on its cadence, that the rank still waits (see ``Progress``)."""
        store = self.group.store
        assert store is not None, "wait() on a call without a store"
        key = self.key(name)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = self.get_now(name)
                if late is not None:
                    return late
                raise expired()
            try:
                store.wait([key], timedelta(seconds=max(0.01, min(SLICE, remaining, _due_in(progress)))))
                return bytes(store.get(key))
            except Exception as exc:
                if not store_timed_out(exc):
                    raise StoreGone(
                        f"rank {self.group.rank}: the store became unreachable while waiting for {key} "
                        f"({self.path}): {exc}",
                        self.path,
                        waited_for=self.group.writer,
                    ) from exc
            if progress is not None and time.monotonic() < deadline:
                progress.after_slice()

    def acknowledge(self, names: Iterable[str], readers: int) -> bool:
        """One of ``readers`` has read the call: the last one deletes ``names`` and the acks (best
        effort), and is told so (True)."""
        store = self.group.store
        if store is None:
            return False
        try:
            if store.add(self.key("acks"), 1) < readers:
                return False
        except Exception as exc:  # clean-up only: the keys are small
            logger.debug("%s: could not acknowledge %s: %s", who(self.group.rank), self.prefix, exc)
            return False
        self.delete([*names, "acks"])
        return True

    def delete(self, names: Iterable[str]) -> None:
        store = self.group.store
        if store is None:
            return
        for name in names:
            delete_quietly(self.group, self.key(name))


def delete_quietly(group: Group, key: str) -> None:
    if group.store is None:
        return
    try:
        group.store.delete_key(key)
    except Exception as exc:
        logger.debug("could not delete store key %s: %s", key, exc)


def poll_until(
    visible: Callable[[], bool],
    deadline: float,
    *,
    expired: Callable[[], BaseException],
    progress: Progress | None = None,
) -> None:
    """Return once ``visible()`` is true; raise ``expired()`` at the deadline. The one bounded poll of
    safeio, with backoff: a filesystem (an NFS client's attribute cache, an object store's listing) offers
    nothing to block on until it shows what another rank did. ``progress`` as a store wait's."""
    pause = 0.02
    while not visible():
        now = time.monotonic()
        if now >= deadline:
            raise expired()
        if progress is not None:
            progress.after_slice()
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, 0.5)


@dataclass
class Progress:
    """What a waiting rank says while it waits: ``tell(elapsed)`` on the cadence every stall line of
    safeio follows (``safeio._stalls``: after ``warn_after``, then each time the wait has doubled), whom
    it waits for and what that rank last reported. ``check()``, between slices, may end the wait with an
    error (the rank waited for has left the call without answering)."""

    cadence: Cadence
    tell: Callable[[float], None]
    check: Callable[[], None] | None = None

    def after_slice(self) -> None:
        elapsed = self.cadence.take()
        if elapsed is not None:
            self.tell(elapsed)
        if self.check is not None:
            self.check()


def _due_in(progress: Progress | None) -> float:
    return progress.cadence.due_in() if progress is not None else math.inf


_TEXT_CAP = 2000  # characters of a rank's error message kept (a value is input: it may be huge)


def text(value: object) -> str:
    """A rank's message heard through the store, bounded for our own messages."""
    message = value if isinstance(value, str) else repr(value)
    return message if len(message) <= _TEXT_CAP else message[:_TEXT_CAP] + "..."
