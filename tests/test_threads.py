"""What safeio starts in the background is finished at exit, bounded (issue 24, "Clean exit, always"): a
process that saved never outlives its work by more than the work's bound, and never hangs on it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

_LOGGING = "import logging, sys; logging.basicConfig(stream=sys.stderr, level=logging.WARNING)\n"


def _python(code: str, bound: float) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _LOGGING + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=bound,
    )
    return done, time.monotonic() - start


def test_a_background_thread_is_finished_before_the_process_exits(tmp_path: Path) -> None:
    done, _ = _python(
        f"""
        import time
        from safeio._threads import start_background

        def work():
            time.sleep(0.5)
            open({str(tmp_path / "done")!r}, "w").close()

        start_background(work, name="safeio-test work", bound=30)
        """,
        bound=60,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "done").exists()


def test_a_hung_background_thread_holds_the_exit_for_its_bound_only() -> None:
    done, took = _python(
        """
        import time
        from safeio._threads import start_background

        start_background(lambda: time.sleep(600), name="safeio-test hung", bound=0.5)
        """,
        bound=60,
    )
    assert done.returncode == 0, done.stderr
    assert took < 30, took
    assert "'safeio-test hung' still running after its bound (0.5 s): left unfinished" in done.stderr


def test_a_retired_step_whose_deletion_hangs_does_not_hold_the_process(tmp_path: Path) -> None:
    # Before: the deletion ran on a non-daemon thread, which the interpreter joins at exit without a
    # bound (a dead NFS server's rmdir): the process, and the job's launcher with it, never ended.
    done, took = _python(
        f"""
        import time
        import safeio
        from safeio._checkpoints.step_directories import LocalSteps

        LocalSteps._delete = lambda self, *aside: time.sleep(600)  # an rmdir on a server that died
        ckpts = safeio.Checkpoints({str(tmp_path / "ckpts")!r}, keep=1, timeout=1)
        for step in (1, 2, 3):
            with ckpts.save(step) as ckpt:
                open(ckpt.path + "/weights", "w").close()
        print("saved", ckpts.latest().step, flush=True)
        """,
        bound=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "saved 3"
    assert took < 30, took
    assert "still running after its bound (1 s): left unfinished" in done.stderr, done.stderr


def test_the_watchdog_threads_are_gone_before_the_interpreter_finalizes(tmp_path: Path) -> None:
    # A handler registered before safeio is imported runs after safeio's own (atexit is last-in first-out).
    done, took = _python(
        f"""
        import atexit, threading

        def left() -> None:
            names = sorted(t.name for t in threading.enumerate() if t.name.startswith("safeio"))
            print("left:", names, flush=True)

        atexit.register(left)
        import safeio

        with safeio.replicated({str(tmp_path / "target")!r}) as stage:
            open(stage.path + "/data", "w").close()
        print("alive:", any(t.name == "safeio-watchdog" for t in threading.enumerate()), flush=True)
        """,
        bound=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["alive: True", "left: []"], done.stdout
    assert took < 30, took
