"""Jobs run the way their users launch them (``torchrun --standalone``), to the launcher's exit code,
bounded: on a timeout the whole tree goes and the test fails with the ranks' output.

torchrun starts each rank in a session of its own, so killing the launcher's process group leaves the
ranks running: the tree is found through /proc (parents, and command lines naming the job's directory).

A job whose every rank has said it finished its work (``ended``, from the ranks' output) and that still
has not exited ``teardown`` seconds later is killed and reported as hung at exit (None for its code),
not failed: torch's gloo teardown race hangs a rank there, with or without safeio (docs/troubleshooting.md,
"A job that does not exit"), and waiting out the whole bound for it cost 600 s. The caller decides what
that means for its test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

TORCHRUN = Path(sys.executable).with_name("torchrun")
# Seconds from the moment every rank has said it finished to the launcher's exit, before the job counts
# as hung at exit: a rank's teardown takes about a second here, tens on a loaded machine; the race's hang
# never ends. Only ever a reason to run a job again, never a failure by itself.
TEARDOWN = 120.0


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def descendants(pid: int) -> list[int]:
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def naming(text: str) -> list[int]:
    """Processes whose command line names ``text`` (a job's output directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def kill_tree(proc: subprocess.Popen[bytes], out: Path) -> None:
    """The launcher and every rank: the ranks are in sessions of their own (torchrun's start_new_session)."""
    pids = {proc.pid, *descendants(proc.pid), *naming(os.fspath(out))}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(10)


def torchrun(script: Path, *args: str, nproc: int = 2) -> list[str]:
    return [os.fspath(TORCHRUN), "--standalone", "--nproc_per_node", str(nproc), os.fspath(script), *args]


def start(cmd: Sequence[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """The job, its output (every rank's) into ``log``; one thread per rank (two cores, two ranks); ``env``
    (default: this process's) offline for the hub."""
    env = dict(
        env if env is not None else os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    with open(log, "wb") as sink:
        return subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def finish(
    proc: subprocess.Popen[bytes],
    out: Path,
    log: Path,
    bound: float,
    what: str,
    ended: Callable[[str], bool] | None = None,
    teardown: float = TEARDOWN,
) -> int | None:
    """The launcher's exit code within ``bound`` seconds; on a timeout the tree is killed and the test
    fails with the ranks' output. None: the job was killed ``teardown`` seconds after ``ended`` became
    true of its output (hung at exit)."""
    deadline = time.monotonic() + bound
    ended_at: float | None = None
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(min(1.0, max(deadline - time.monotonic(), 0.0)))
        now = time.monotonic()
        if ended is not None and ended_at is None and ended(log.read_text(errors="replace")):
            ended_at = now
        if ended_at is not None and now - ended_at >= teardown:
            kill_tree(proc, out)
            return None
        if now >= deadline:
            kill_tree(proc, out)
            pytest.fail(
                f"{what}: the job did not exit within {bound:g} s (killed); its ranks "
                f"said:\n{log.read_text(errors='replace')[-6000:]}"
            )


def launch(
    cmd: Sequence[str],
    out: Path,
    log: Path,
    bound: float,
    what: str,
    env: dict[str, str] | None = None,
    ended: Callable[[str], bool] | None = None,
    teardown: float = TEARDOWN,
) -> tuple[str, float, int | None]:
    """One job to its launcher's exit: its output, how long it took, its exit code (None: hung at exit,
    see ``finish``)."""
    began = time.monotonic()
    code = finish(start(cmd, log, env), out, log, bound, what, ended, teardown)
    return log.read_text(errors="replace"), time.monotonic() - began, code
