"""A checkpoint's calls in the store: every rank reports, the writer decides, everyone hears it, bounded.

Keys live under ``safeio/ckpt/<root digest>/<n>``, where ``n`` numbers this process's collective calls on
the root (``save`` and ``latest()`` are collective: every rank makes them, in the same order). The writer
never blocks forever: it waits for the other ranks' reports at most until the deadline and then names the
ranks that never reported. The keys go once every other rank has read the outcome.
"""

from __future__ import annotations

import json
from typing import Any

from safeio._coordination.calls import StoreCall, digest, next_number
from safeio._coordination.group import Group
from safeio._errors import PeerTimeout


class CheckpointCall:
    """One collective call (``what``: "save of step 5", "latest()") on the checkpoint root ``root``."""

    def __init__(self, group: Group, root: str, what: str, *, call: StoreCall | None = None) -> None:
        self.group = group
        self.root = root
        self.what = what
        if call is None:
            prefix = f"safeio/ckpt/{digest(root, 16)}/{next_number(('checkpoints', root))}"
            call = StoreCall(group, prefix, root)
        self._call = call

    def on_group(self, group: Group) -> CheckpointCall:
        """The same call through another connection to the store (the async commit's thread)."""
        return CheckpointCall(group, self.root, self.what, call=self._call.on_group(group))

    @property
    def shared(self) -> bool:
        return self._call.shared

    def _set(self, name: str, value: Any) -> None:
        self._call.set(name, json.dumps(value))

    def _wait(self, name: str, deadline: float, waiting_for: str) -> Any:
        def expired() -> PeerTimeout:
            return PeerTimeout(
                f"rank {self.group.rank}: {waiting_for} did not arrive within the timeout "
                f"({self.what} of {self.root})",
                self.root,
                waited_for=self.group.writer,
            )

        raw = self._call.wait(name, deadline, expired=expired)  # StoreGone: the store's host has left
        try:
            return json.loads(raw)
        except ValueError:
            return None

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
        raw = self._call.get_now("outcome")
        try:
            value = json.loads(raw) if raw is not None else None
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def hear_outcome(self, deadline: float) -> dict[str, Any]:
        value = self._wait("outcome", deadline, f"rank {self.group.writer}'s commit")
        names = ["announce", "outcome", *(f"rank/{r}" for r in range(self.group.world_size))]
        self._call.acknowledge(names, self.group.world_size - 1)
        return value if isinstance(value, dict) else {"ok": False, "error": "a malformed outcome"}
