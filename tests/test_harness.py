"""The suite's own harness (issue 37): the hostile-share runner's bound by progress (tests/_stall.py: a
stall is caught, work never is), test clean-up at any depth (safeio.testing._cleanup), ranks started
again (safeio.testing.ranks), and a launched job hung at exit told from a job hung in its work
(tests/_launcher.py)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from safeio.testing._cleanup import remove_scratch
from tests import _launcher
from tests._bounds import PATIENT
from tests._deep_trees import make_chain
from tests._stall import Hung, stall_alarm

STALL = 1.5  # seconds; each case below runs well past it


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


def test_a_blocked_call_is_hung_once_nothing_moves(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    began = time.monotonic()
    with pytest.raises(Hung, match="no progress"), stall_alarm(STALL, ceiling=600):
        open(fifo).close()  # no writer: blocks for ever
    assert time.monotonic() - began >= STALL


def test_work_longer_than_the_stall_bound_is_not_hung() -> None:
    with stall_alarm(STALL, ceiling=600):
        _busy(3 * STALL)  # on a loaded machine this gets less CPU, never none


def test_a_descendant_at_work_is_progress() -> None:
    busy = f"import time\nend = time.monotonic() + {3 * STALL}\nwhile time.monotonic() < end: pass"
    with stall_alarm(STALL, ceiling=600):
        # This process waits in waitpid; its child (python, below a shell) does the work.
        subprocess.run(["sh", "-c", f'{sys.executable} -c "$0"', busy], check=True, timeout=600)


def test_the_ceiling_ends_work_that_never_ends() -> None:
    with pytest.raises(Hung, match="still running after 2 s"), stall_alarm(60, ceiling=2):
        _busy(600)


def test_clean_up_removes_a_tree_past_the_recursion_limit_and_path_max(tmp_path: Path) -> None:
    deep = tmp_path / "deep"
    deep.mkdir()
    make_chain(deep, 3000)  # what a failed hostile-share case leaves behind
    with pytest.raises(RecursionError):
        shutil.rmtree(deep, ignore_errors=True)  # the fixtures' clean-up before
    (deep / "locked").mkdir(mode=0)  # a directory a test made unusable
    (deep / "link").symlink_to(tmp_path / "kept")  # never followed
    (tmp_path / "kept").mkdir()
    remove_scratch(deep)
    assert sorted(os.listdir(tmp_path)) == ["kept"]
    remove_scratch(tmp_path / "missing")  # nothing there: nothing to do


def _rank_main_hung_at_first(*args: object) -> None:
    """safeio.testing.ranks's rank entry, except that the first attempt's rank 1 never connects, as gloo's
    ranks sat 14 minutes in Pair::waitUntilConnected beside 8 CPU burners (its rank 0 waits for it)."""
    from safeio.testing import ranks

    rank, env = args[1], args[5]
    assert isinstance(env, dict)
    marker = Path(env["HUNG_MARKER"])
    if rank == 1 and not marker.exists():
        marker.touch()
        time.sleep(3600)  # killed by the harness; never returns
    ranks._rank_main(*args)  # type: ignore[arg-type]


def _count_call(rank: int, world: int, calls: str) -> int:
    Path(calls, f"{rank}-{os.getpid()}").touch()
    return rank


@pytest.mark.parametrize("attempts", [1, 10])
def test_ranks_hung_in_connecting_are_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], attempts: int
) -> None:
    from safeio.testing import ranks

    calls = tmp_path / "calls"
    calls.mkdir()
    monkeypatch.setattr(ranks, "_rank_main", _rank_main_hung_at_first)
    # The bound is the group's own timeout (300 s) plus a grace; 15 s here, so that the test does not wait
    # six minutes for the hang it planted. A later attempt slower than that under load is started again.
    monkeypatch.setattr(ranks, "_CONNECT_GRACE", 15.0 - 300.0)
    monkeypatch.setattr(ranks, "_CONNECT_ATTEMPTS", attempts)
    env = {"HUNG_MARKER": str(tmp_path / "hung")}
    results = ranks.run_ranks(_count_call, 2, str(calls), env=env, check=False)
    assert (tmp_path / "hung").exists()
    if attempts == 1:  # without starting again: the hang is the run's end, told as such
        assert [str(r.error) for r in results] == [
            f"rank {r} did not connect: 1 attempt(s) of 15 s each" for r in (0, 1)
        ]
        assert list(calls.iterdir()) == []
    else:
        assert [r.value for r in results] == [0, 1], ranks.describe(results)
        assert "ranks still connecting after 15 s" in capfd.readouterr().err
        # The hung attempt never called the function: each rank ran it once, in the attempt that connected.
        assert sorted(name.split("-")[0] for name in os.listdir(calls)) == ["0", "1"]


def test_ranks_whose_port_was_taken_are_started_again_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Two suites on one machine: another process listened on the port ``free_port`` had just given,
    before rank 0 could (the stress pair: rank 0 failed with EADDRINUSE, rank 1 tried to connect for its
    whole timeout, and the test failed after 637 s). The ranks start again on another port."""
    from safeio.testing import ranks

    calls = tmp_path / "calls"
    calls.mkdir()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [int(taken.getsockname()[1])]  # the first attempt's: another process holds it
        real_free_port = ranks.free_port
        monkeypatch.setattr(ranks, "free_port", lambda: ports.pop() if ports else real_free_port())
        # 20 s: the code before ended this run once rank 1 gave up connecting (its timeout), not 300 s.
        results = ranks.run_ranks(_count_call, 2, str(calls), timeout=20, check=False)
    assert [r.value for r in results] == [0, 1], ranks.describe(results)
    assert "was taken before rank 0 listened on it, attempt 1 of 3" in capfd.readouterr().err
    assert sorted(name.split("-")[0] for name in os.listdir(calls)) == ["0", "1"]


def _job(tmp_path: Path, says: str, then: str) -> list[str]:
    """A job (one process: what the launcher's watch sees is the same) that prints ``says`` and then
    runs ``then``; its command line names ``tmp_path``, so that ``naming`` finds it while it lives."""
    return [sys.executable, "-c", f"# {tmp_path}\nimport signal, sys\nprint({says!r}, flush=True)\n{then}"]


def _ended(output: str) -> bool:
    return "ended 0" in output and "ended 1" in output


def test_a_job_hung_after_every_rank_ended_is_hung_at_exit(tmp_path: Path) -> None:
    """The accelerate program's plain job once printed its metrics and did not exit in 600 s (gloo's
    teardown race): the launcher now ends such a job ``teardown`` s after every rank said it was done,
    and tells it apart (None) from a job that fails or hangs in its work."""
    hung = _job(tmp_path, "ended 0\nended 1", "signal.pause()")
    output, _took, code = _launcher.launch(
        hung, tmp_path, tmp_path / "hung.log", PATIENT, "hung", None, _ended, 1.0
    )
    assert code is None and "ended 1" in output
    assert _launcher.naming(os.fspath(tmp_path)) == [], "the hung job was left running"
    done = _job(tmp_path, "ended 0\nended 1", "sys.exit(3)")
    assert (
        _launcher.launch(done, tmp_path, tmp_path / "done.log", PATIENT, "exits", None, _ended, 1.0)[2] == 3
    )
    # Hung before every rank said so: a hang in the work, the test fails at its bound, as before.
    working = _job(tmp_path, "ended 0", "signal.pause()")
    with pytest.raises(pytest.fail.Exception, match="did not exit within 3 s"):
        _launcher.launch(working, tmp_path, tmp_path / "working.log", 3.0, "working", None, _ended, 1.0)
    assert _launcher.naming(os.fspath(tmp_path)) == []
