"""The store side of a checkpoint: every rank reports, the writer decides, everyone hears it, bounded.

Keys live under ``safeio/ckpt/<root digest>/<call>``, where ``call`` numbers this process's collective
calls on the root (``save`` and ``latest`` are collective: every rank makes them, in the same order).
The writer never blocks forever: it waits for the other ranks' reports at most until the deadline and
then names the ranks that never reported. Keys are deleted once every rank has read them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from datetime import timedelta
from typing import Any

from safeio._coordination.channel import is_store_timeout
from safeio._coordination.group import Group
from safeio._errors import PeerTimeout

_SLICE = 30.0  # one store.wait at most this long, so a long wait still notices its deadline
_counter_lock = threading.Lock()
_counters: dict[str, int] = {}


class StoreGone(PeerTimeout):
    """The store is unreachable: rank 0 hosts it and may have finished (the end of a run)."""


class Exchange:
    """The keys of one collective call on a checkpoint root."""

    def __init__(self, group: Group, root: str, what: str) -> None:
        self.group = group
        self.root = root
        with _counter_lock:
            call = _counters[root] = _counters.get(root, 0) + 1
        digest = hashlib.sha256(root.encode("utf-8", "surrogateescape")).hexdigest()[:16]
        self.prefix = f"safeio/ckpt/{digest}/{call}"
        self.what = what  # "save of step 5", for messages

    @property
    def shared(self) -> bool:
        return self.group.world_size > 1 and self.group.store is not None

    def _set(self, key: str, value: Any) -> None:
        assert self.group.store is not None
        self.group.store.set(f"{self.prefix}/{key}", json.dumps(value))

    def _wait(self, key: str, deadline: float, waiting_for: str) -> Any:
        store = self.group.store
        assert store is not None
        full = f"{self.prefix}/{key}"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                with contextlib.suppress(Exception):  # a report that came in time, read after the deadline
                    if store.check([full]):
                        return json.loads(store.get(full))
                raise PeerTimeout(
                    f"rank {self.group.rank}: {waiting_for} did not arrive within the timeout "
                    f"({self.what} of {self.root})",
                    self.root,
                    waited_for=self.group.writer,
                )
            try:
                store.wait([full], timedelta(seconds=min(_SLICE, remaining)))
                return json.loads(store.get(full))
            except Exception as exc:
                if is_store_timeout(exc):
                    continue
                raise StoreGone(
                    f"rank {self.group.rank}: the store became unreachable while waiting for "
                    f"{waiting_for} ({self.what} of {self.root}): {exc}",
                    self.root,
                    waited_for=self.group.writer,
                ) from exc

    # -- the writer publishes, the others wait -------------------------------------------------------

    def announce(self, value: Any) -> None:
        """The writer: something every rank needs before its body (the stage's name), or a failure."""
        if self.shared:
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
        """The writer: the outcome every rank returns or raises."""
        if self.shared:
            self._set("outcome", value)

    def outcome_if_decided(self) -> dict[str, Any] | None:
        """The writer's outcome if it is already published (never waits)."""
        store = self.group.store
        if store is None:
            return None
        with contextlib.suppress(Exception):
            if store.check([f"{self.prefix}/outcome"]):
                value = json.loads(store.get(f"{self.prefix}/outcome"))
                return value if isinstance(value, dict) else None
        return None

    def hear_outcome(self, deadline: float) -> dict[str, Any]:
        value = self._wait("outcome", deadline, f"rank {self.group.writer}'s commit")
        self._acknowledge()
        return value if isinstance(value, dict) else {"ok": False, "error": "a malformed outcome"}

    def _acknowledge(self) -> None:
        """The last rank to read the outcome deletes the call's keys (the store must not grow)."""
        store = self.group.store
        assert store is not None
        try:
            if store.add(f"{self.prefix}/acks", 1) >= self.group.world_size - 1:
                keys = ["announce", "outcome", "acks", *(f"rank/{r}" for r in range(self.group.world_size))]
                for key in keys:
                    store.delete_key(f"{self.prefix}/{key}")
        except Exception:  # clean-up is best effort; the keys are small
            return
