"""No silent hangs: a stalled writer logs where it is stuck, and waiting ranks say whom they wait for."""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import safeio
import safeio._diagnostics.watchdog
from safeio._diagnostics.watchdog import Watchdog
from safeio._options import DEFAULT_WARN_AFTER
from safeio._options import warn_after_or_default as resolve_warn_after
from safeio.testing import ranks
from safeio.testing.ranks import run_ranks

HOST = socket.gethostname()


class _Phases:
    """Stands for the writer's Channel: a phase record, and heartbeats counted."""

    def __init__(self, target_url: str) -> None:
        self.target_url = target_url
        self.phase, self.phase_since = "body", time.time()
        self.beats: list[bool] = []

    def enter(self, phase: str) -> None:
        self.phase, self.phase_since = phase, time.time()

    def heartbeat(self, *, wait: bool = True) -> None:
        self.beats.append(wait)


def _poll(condition: Any, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)  # a bounded poll of a log: there is nothing to block on
    return bool(condition())


def _stuck_in_body(release: threading.Event) -> None:
    release.wait(30)  # stands for a write blocked in the kernel


def test_warn_after_comes_from_the_argument_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SAFEIO_WARN_AFTER", raising=False)
    assert resolve_warn_after(None) == DEFAULT_WARN_AFTER == 60.0
    monkeypatch.setenv("SAFEIO_WARN_AFTER", "2.5")
    assert resolve_warn_after(None) == 2.5
    assert resolve_warn_after(7) == 7.0
    assert resolve_warn_after(float("inf")) == float("inf")
    monkeypatch.setenv("SAFEIO_WARN_AFTER", "soon")
    with pytest.raises(ValueError, match="SAFEIO_WARN_AFTER"):
        resolve_warn_after(None)
    with pytest.raises(ValueError, match="positive"):
        resolve_warn_after(0)
    with pytest.raises(ValueError, match="positive"):
        safeio.replicated("/tmp/x", warn_after=-1)


def test_a_stalled_phase_warns_with_the_stack_and_backs_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="safeio")
    phases = _Phases("/ckpt/step_500/tokenizer")
    release = threading.Event()
    stalls: list[logging.LogRecord] = []

    def writer() -> None:
        with Watchdog(phases, 0.2, rank=3):
            _stuck_in_body(release)
            phases.enter("promote")  # the stall ends: the next phase is quick

    def stall_warnings() -> list[logging.LogRecord]:
        stalls[:] = [r for r in caplog.records if "has been in body of /ckpt/step_500/tok" in r.getMessage()]
        return stalls

    thread = threading.Thread(target=writer, name="writer-thread")
    thread.start()
    try:
        assert _poll(lambda: len(stall_warnings()) >= 3, within=10), caplog.text
    finally:
        release.set()
        thread.join(30)
    first = stalls[0]
    message = first.getMessage()
    assert first.levelno == logging.WARNING and first.name == "safeio"
    assert f"rank 3 ({HOST} pid {os.getpid()})" in message
    assert "in body of /ckpt/step_500/tokenizer for 0.2 s" in message
    assert "writer-thread" in message and "_stuck_in_body" in message and "release.wait(30)" in message
    # Backoff: each warning comes once the elapsed time has doubled (0.2, 0.4, 0.8 s ...).
    elapsed = [r.safeio_elapsed for r in stalls[:3]]  # type: ignore[attr-defined]
    assert elapsed[1] >= 1.8 * elapsed[0] and elapsed[2] >= 1.8 * elapsed[1], elapsed
    left = [r.getMessage() for r in caplog.records if "left body of /ckpt/step_500/tok" in r.getMessage()]
    assert len(left) == 1 and "/ckpt/step_500/tokenizer" in left[0], caplog.text
    assert not any("in promote" in r.getMessage() for r in caplog.records)


def test_a_quick_save_is_silent_and_heartbeats_never_wait(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="safeio")
    phases = _Phases("/ckpt/tok")
    with Watchdog(phases, 60.0, heartbeat_every=0.1) as watchdog:
        assert _poll(lambda: len(phases.beats) >= 3, within=10)
    assert set(phases.beats) == {False}  # the writer thread may hold the channel: never block on it
    assert not caplog.records
    # Stopped means forgotten by the shared monitor thread: nothing touches the channel any more.
    assert watchdog not in safeio._diagnostics.watchdog._monitor._watches
    assert watchdog.tick() == float("inf")


def test_warnings_do_not_wait_for_a_blocked_store(caplog: pytest.LogCaptureFixture) -> None:
    """A TCPStore client serialises its requests: a heartbeat can block behind another thread's wait."""
    caplog.set_level(logging.WARNING, logger="safeio")
    store_free = threading.Event()

    class BlockedStore(_Phases):
        def heartbeat(self, *, wait: bool = True) -> None:
            store_free.wait(30)

    phases = BlockedStore("/ckpt/tok")
    try:
        with Watchdog(phases, 0.3, heartbeat_every=0.05):
            assert _poll(lambda: any("has been in body" in r.getMessage() for r in caplog.records), within=10)
    finally:
        store_free.set()


# -- on real gloo ranks ----------------------------------------------------------------------------


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelno, record.getMessage()))


def _hang_in_body(rank: int, world: int, target: str, timeout: float, release: Any) -> dict[str, Any]:
    from torch.distributed import distributed_c10d as c10d

    log = _Collect()
    logger = logging.getLogger("safeio")
    logger.addHandler(log)
    logger.setLevel(logging.DEBUG)
    store = c10d._get_default_store()

    # Without safeio, a rank waiting for a stuck peer learns nothing about it.
    plain_error = ""
    if rank == 1:
        try:
            store.wait(["never-set"], timedelta(seconds=0.5))
        except Exception as exc:
            plain_error = str(exc)

    start = time.monotonic()
    out: dict[str, Any] = {"pid": os.getpid(), "plain": plain_error}
    try:
        with safeio.replicated(target, timeout=timeout, warn_after=0.5) as stage:
            Path(stage.path, "tokenizer.json").write_text(str(rank))
            if stage.is_writer:
                # Stands for a write stuck in the kernel; the last peer to time out releases it.
                release.wait(60)
    except safeio.PeerTimeout as exc:
        out.update(error=str(exc), phase=exc.phase, waited_for=exc.waited_for)
        if store.add("timed-out", 1) == world - 1:
            release.set()
    out["took"] = time.monotonic() - start
    out["log"] = log.records
    out["complete"] = safeio.is_complete(target) if rank == 0 else None
    return out


def test_a_writer_hung_in_its_body_is_loud_on_every_rank(shared_dir: Path) -> None:
    target = str(shared_dir / "ckpt" / "step_500" / "tokenizer")
    timeout = 2.5
    release = multiprocessing.get_context(ranks._START_METHOD).Event()
    results = run_ranks(_hang_in_body, 3, target, timeout, release, timeout=90)
    writer = results[0].value
    writer_id = f"rank 0 ({HOST} pid {writer['pid']})"

    stalls = [m for level, m in writer["log"] if level == logging.WARNING and "has been in body" in m]
    assert stalls, writer["log"]
    assert stalls[0].startswith(f"{writer_id}: the writer has been in body of {target} for 0.5 s")
    assert "_hang_in_body" in stalls[0] and "release.wait(60)" in stalls[0]
    assert any(f"left body of {target}" in m for _l, m in writer["log"])
    assert writer["complete"]  # the watchdog reports, it never stops the save

    for r in results[1:]:
        v = r.value
        assert timeout <= v["took"] < timeout + 4, v
        assert v["phase"] == "body" and v["waited_for"] == 0
        message = v["error"]
        assert f"rank {r.rank} waited" in message and target in message
        match = re.search(
            r"rank 0 \((\S+) pid (\d+)\) has been in body of (\S+) for (\d+) s \(last heard (\d+) s ago\)",
            message,
        )
        assert match, message
        host, pid, path, elapsed, heard = match.groups()
        assert (host, int(pid), path) == (HOST, writer["pid"], target)
        assert int(elapsed) >= 2 and int(heard) <= 1, message  # the watchdog's heartbeat keeps it fresh
        # The waiting ranks say so on the writer's cadence (after warn_after), whom they wait for, and
        # what it last reported.
        waiting = [m for level, m in v["log"] if level == logging.WARNING and "still waiting" in m]
        assert waiting and f"rank 0 ({HOST} pid {writer['pid']}) has been in body of {target}" in waiting[0]

    # The contrast: the same wait without safeio says only that a key never came.
    plain = results[1].value["plain"]
    assert plain and "body" not in plain and "rank 0" not in plain and target not in plain
