"""The suite's own harness (issue 37): the hostile-share runner's bound by progress (tests/_stall.py: a
stall is caught, work never is), and test clean-up at any depth (safeio.testing._cleanup)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from safeio.testing._cleanup import remove_scratch
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
