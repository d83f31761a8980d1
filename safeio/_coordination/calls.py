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
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from safeio._boundary import store_timed_out
from safeio._coordination.group import Group
from safeio._errors import PeerTimeout
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

    def on_group(self, group: Group) -> StoreCall:
        """The same call through another connection to the store (a background thread's)."""
        return StoreCall(group, self.prefix, self.path)

    @property
    def shared(self) -> bool:
        """Whether there are peers to hear this call through a store (else the filesystem is all)."""
        return self.group.world_size > 1 and self.group.store is not None

    def key(self, name: str = "") -> str:
        return f"{self.prefix}/{name}" if name else self.prefix

    def set(self, name: str, value: str | bytes) -> None:
        store = self.group.store
        assert store is not None, "set() on a call without a store"
        store.set(self.key(name), value)

    def claim(self, name: str, value: str) -> bytes:
        """Set ``name`` to ``value`` unless it is set; return what it holds then (one round trip,
        atomic: of several ranks claiming one key, exactly one sets it and every one sees its value). A
        store without ``compare_set`` (a custom one) cannot tell: each rank sees its own value."""
        store = self.group.store
        assert store is not None, "claim() on a call without a store"
        compare_set = getattr(store, "compare_set", None)
        if compare_set is None:
            return value.encode()
        return bytes(compare_set(self.key(name), "", value))

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
        still_waiting: Callable[[], None] | None = None,
    ) -> bytes:
        """The value of ``name`` once it is set. At ``deadline`` raises ``expired()`` (after a last look:
        a value set in time is not lost to a slow read); ``StoreGone`` when the store is unreachable.
        ``still_waiting`` is called after each slice that expired without the key."""
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
                store.wait([key], timedelta(seconds=min(SLICE, remaining)))
                return bytes(store.get(key))
            except Exception as exc:
                if not store_timed_out(exc):
                    raise StoreGone(
                        f"rank {self.group.rank}: the store became unreachable while waiting for {key} "
                        f"({self.path}): {exc}",
                        self.path,
                        waited_for=self.group.writer,
                    ) from exc
                if still_waiting is not None and time.monotonic() < deadline:
                    still_waiting()

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
    still_waiting: Callable[[], None] | None = None,
) -> None:
    """Return once ``visible()`` is true; raise ``expired()`` at the deadline. The one bounded poll of
    safeio, with backoff: a filesystem (an NFS client's attribute cache, an object store's listing) offers
    nothing to block on until it shows what another rank did. ``still_waiting`` is called every
    ``SLICE`` seconds, as a store wait's is."""
    pause, next_log = 0.02, time.monotonic() + SLICE
    while not visible():
        now = time.monotonic()
        if now >= deadline:
            raise expired()
        if still_waiting is not None and now >= next_log:
            next_log += SLICE
            still_waiting()
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, 0.5)
