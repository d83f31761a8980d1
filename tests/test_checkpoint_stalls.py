"""No silent stall on the checkpoint path (issue 33): the rank that is stuck says so itself (phase, step,
path, elapsed, stack) after ``warn_after``, every rank waiting for it says whom it waits for and what that
rank last reported, on the same cadence, and every wait ends by its bound with an error naming the rank
and the phase it was actually in. A rank that gave up knows what it may assume: the writer does not commit
a step a rank gave up on before its commit point ("not committed"); after it, the outcome is the writer's
("unknown": ``latest()`` tells).

Timings here are the subject, so ``warn_after`` and the timeouts are short; the assertions are on the
log records and the order of events (each record's time against the moment a rank raised), never on how
long anything took.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import safeio
from safeio.testing import ranks
from safeio.testing.nfslike import Mount
from safeio.testing.ranks import run_ranks

HOST = socket.gethostname()
WARN = 0.5  # warn_after
TIMEOUT = 4.0  # the checkpoints' timeout: a rank waiting for the writer's outcome gives up after twice it
ENV = {"SAFEIO_WARN_AFTER": str(WARN)}  # as the users set it (Checkpoints(warn_after=) also takes it)


class _Records(logging.Handler):
    """What a rank logged: (time, level, message, the record's safeio_* attributes)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[dict[str, Any]] = []
        logger = logging.getLogger("safeio")
        logger.addHandler(self)
        logger.setLevel(logging.DEBUG)

    def emit(self, record: logging.LogRecord) -> None:
        extra = {k: v for k, v in vars(record).items() if k.startswith("safeio_")}
        self.records.append(
            {"at": record.created, "level": record.levelno, "message": record.getMessage(), **extra}
        )


def _error(exc: BaseException) -> dict[str, Any]:
    names = ("waited_for", "phase", "step", "elapsed", "outcome", "failed", "missing")
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "at": time.time(),
        **{n: getattr(exc, n) for n in names if hasattr(exc, n)},
    }


def _warnings(records: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    return [r for r in records if r["level"] == logging.WARNING and text in r["message"]]


def _event() -> Any:
    return multiprocessing.get_context(ranks._START_METHOD).Event()


def _stuck_in_the_body(release: Any) -> None:
    release.wait(120)  # stands for a body that does not return (a hung write, a collective)


def _save_with_one_rank_stuck(
    rank: int, world: int, root: str, stuck: int, release: Any, durable: bool
) -> dict[str, Any]:
    log = _Records()
    out: dict[str, Any] = {"pid": os.getpid()}
    ckpts = safeio.Checkpoints(root, timeout=TIMEOUT, durable=durable)
    try:
        with ckpts.save(1) as ckpt:
            Path(ckpt.path, f"shard-{rank}").write_text(str(rank))
            if rank == stuck:
                _stuck_in_the_body(release)
    except safeio.SafeIOError as exc:
        out["error"] = _error(exc)
        if rank != stuck:
            release.set()  # the stuck rank comes back once the other gave up
    out["log"] = log.records
    return out


def _no_step_1(root: Path) -> None:
    left = [p.name for p in root.iterdir() if "step_1" in p.name] if root.exists() else []
    assert left == [], left  # neither the step nor its stage


def _backs_off(warnings: list[dict[str, Any]]) -> None:
    elapsed = [w["safeio_elapsed"] for w in warnings]
    assert elapsed[0] >= WARN, elapsed
    assert all(b >= 1.8 * a for a, b in itertools.pairwise(elapsed)), elapsed


def test_a_writer_stuck_in_its_body_is_told_by_itself_and_by_the_rank_waiting_for_it(
    shared_dir: Path,
) -> None:
    """Issue 33's measured scenario, scaled down (there: timeout 30 s, SAFEIO_WARN_AFTER=15, rank 0 stuck
    75 s in its body). On the code before, neither rank logged anything; rank 1 raised "rank 0's fsync
    shares did not arrive" (a phase rank 0 never reached) and rank 0 then committed step 1 and returned
    success: the two ranks were told different things."""
    root = shared_dir / "ckpts"
    results = run_ranks(_save_with_one_rank_stuck, 2, str(root), 0, _event(), True, timeout=120, env=ENV)
    writer, peer = results[0].value, results[1].value
    gave_up = peer["error"]["at"]
    # The stuck rank says so itself, with its stack, repeating with backoff, before the other gives up.
    stalls = _warnings(writer["log"], f"this rank has been in body of save of step 1 of {root}")
    assert stalls and stalls[0]["at"] < gave_up, writer["log"]
    assert stalls[0]["message"].startswith(f"rank 0 ({HOST} pid {writer['pid']}): "), stalls[0]
    assert "_stuck_in_the_body" in stalls[0]["message"] and "release.wait(120)" in stalls[0]["message"]
    assert "`with ckpts.save(...)`" in stalls[0]["message"]  # what the user can do
    _backs_off([s for s in stalls if s["at"] < gave_up])
    # The waiting rank names it, and its phase, on the same cadence.
    waiting = _warnings(peer["log"], "still waiting after")
    assert waiting and waiting[0]["at"] < gave_up, peer["log"]
    assert f"rank 0 ({HOST} pid {writer['pid']}) has been in body of save of step 1" in waiting[0]["message"]
    assert waiting[0]["safeio_waited_for"] == 0 and waiting[0]["safeio_phase"] == "body"
    # At its bound: the rank, the phase it was actually in, the step, and what the waiting rank may assume.
    error = peer["error"]
    assert error["type"] == "PeerTimeout", error
    assert (error["waited_for"], error["phase"], error["step"], error["outcome"]) == (
        0,
        "body",
        1,
        "not committed",
    )
    assert f"rank 0 ({HOST} pid {writer['pid']}) has been in body of save of step 1" in error["message"]
    assert "This rank gave up: step 1 is not committed" in error["message"]
    # ... and the writer, back from its body, agrees: nothing is committed.
    assert writer["error"]["type"] == "CheckpointError", writer
    assert writer["error"]["failed"][1].startswith("gave up waiting"), writer
    assert _warnings(writer["log"], "this rank left body of save of step 1")
    _no_step_1(root)


def test_a_rank_stuck_in_its_body_is_named_by_the_writer_waiting_for_its_report(shared_dir: Path) -> None:
    """The other way round: the writer collects the reports and names the rank it waits for, and that
    rank's phase, in its lines and in its error; the stuck rank warns itself."""
    root = shared_dir / "ckpts"
    results = run_ranks(_save_with_one_rank_stuck, 2, str(root), 1, _event(), False, timeout=120, env=ENV)
    writer, peer = results[0].value, results[1].value
    failed_at = writer["error"]["at"]
    stalls = _warnings(peer["log"], f"this rank has been in body of save of step 1 of {root}")
    assert stalls and stalls[0]["at"] < failed_at, peer["log"]
    waiting = _warnings(writer["log"], "still waiting after")
    assert waiting and waiting[0]["at"] < failed_at, writer["log"]
    assert f"for rank 1's report (save of step 1 of {root})" in waiting[0]["message"]
    assert f"rank 1 ({HOST} pid {peer['pid']}) has been in body of save of step 1" in waiting[0]["message"]
    error = writer["error"]
    assert error["type"] == "CheckpointError" and error["missing"] == [1], error
    assert f"rank 1 never reported (rank 1 ({HOST} pid {peer['pid']}) has been in body" in error["message"]
    assert peer["error"]["type"] == "CheckpointError" and peer["error"]["missing"] == [1], peer
    _no_step_1(root)


def _save_with_the_writer_hung_in_the_commit(
    rank: int, world: int, root: str, in_body: Any, armed: Any, gave_up: Any
) -> dict[str, Any]:
    log = _Records()
    out: dict[str, Any] = {"pid": os.getpid()}
    ckpts = safeio.Checkpoints(root, timeout=TIMEOUT)
    try:
        with ckpts.save(1) as ckpt:
            Path(ckpt.path, f"shard-{rank}").write_text(str(rank))
            if rank == 0:
                in_body.set()
                armed.wait(60)  # the mount hangs from now on, on the path the test chose
    except safeio.SafeIOError as exc:
        out["error"] = _error(exc)
        if rank == 1:
            gave_up.set()
    out["log"] = log.records
    out["latest"] = None
    if rank == 0:
        found = safeio.Checkpoints(root, group=safeio.Group()).latest()  # what latest() decides
        out["latest"] = found.step if found is not None else None
    return out


def _hang_the_commit(mount: Mount, pattern: str, root: Path) -> list[dict[str, Any]]:
    in_body, armed, gave_up = _event(), _event(), _event()

    def test_side() -> None:
        try:
            if in_body.wait(120):
                mount.set_faults(hang=pattern)
                armed.set()
                gave_up.wait(120)
        finally:
            mount.set_faults(hang=None)  # the server answers again
            mount.release()
            armed.set()

    helper = threading.Thread(target=test_side)
    helper.start()
    try:
        results = run_ranks(
            _save_with_the_writer_hung_in_the_commit,
            2,
            str(root),
            in_body,
            armed,
            gave_up,
            timeout=180,
            env=ENV,
        )
    finally:
        gave_up.set()
        helper.join(60)
    return [r.value for r in results]


def test_a_writer_hung_in_the_filesystem_before_its_commit_point_commits_nothing(
    nfslike_mount: Mount,
) -> None:
    """The NFS-like mount stops answering on the step's name while the writer commits (its check that
    nothing took the name, under the root's lock, before the rename): the writer warns about itself in
    promote, rank 1 names it there and gives up at its bound; once the mount answers again the writer
    sees that rank 1 gave up and commits nothing, as rank 1 was told. On the code before, nobody logged
    anything and the writer committed after rank 1 had raised."""
    root = nfslike_mount.path / "run"
    writer, peer = _hang_the_commit(nfslike_mount, "run/step_1", root)
    gave_up = peer["error"]["at"]
    stalls = _warnings(writer["log"], f"this rank has been in promote of save of step 1 of {root}")
    assert stalls and stalls[0]["at"] < gave_up, writer["log"]
    assert "Renaming the stage into place" in stalls[0]["message"]
    waiting = _warnings(
        peer["log"], f"rank 0 ({HOST} pid {writer['pid']}) has been in promote of save of step 1"
    )
    assert waiting and waiting[0]["at"] < gave_up, peer["log"]
    error = peer["error"]
    assert (error["type"], error["waited_for"], error["phase"], error["outcome"]) == (
        "PeerTimeout",
        0,
        "promote",
        "not committed",
    ), error
    assert writer["error"]["type"] == "CheckpointError" and writer["error"]["failed"][1].startswith("gave up")
    assert writer["latest"] is None
    _no_step_1(root)


def test_a_step_replaced_after_a_rank_gave_up_stays_the_old_version(nfslike_mount: Mount) -> None:
    """The same with step 1 committed already (a rollback saves it again): its commit point is the swap
    that replaces the old version, which the writer must not make once rank 1 gave up. The mount hangs
    the stage's manifest, written under the root's lock just before the swap (the old step's name is in
    the kernel's cache, so a lookup of it would not reach the mount). The old version stays whole under
    the name, as rank 1 was told ("not committed")."""
    root = nfslike_mount.path / "run"
    with safeio.Checkpoints(root, group=safeio.Group()).save(1) as ckpt:  # the earlier commit
        Path(ckpt.path, "shard-0").write_text("old")
    writer, peer = _hang_the_commit(nfslike_mount, "run/.step_1.safeio-stage*/.safeio-manifest.json", root)
    assert (peer["error"]["type"], peer["error"]["outcome"]) == ("PeerTimeout", "not committed"), peer
    assert writer["error"]["type"] == "CheckpointError" and writer["error"]["failed"][1].startswith("gave up")
    assert (root / "step_1" / "shard-0").read_text() == "old"  # not swapped for the abandoned stage
    assert not (root / "step_1" / "shard-1").exists()


def test_a_writer_hung_after_its_commit_point_leaves_the_outcome_to_latest(nfslike_mount: Mount) -> None:
    """The mount stops answering while the writer points ``latest`` at the step it has just renamed
    into place: rank 1 gives up knowing that the writer had begun the commit ("unknown"); the writer,
    once the mount answers, finishes and the step is committed: latest() says so."""
    root = nfslike_mount.path / "run"
    writer, peer = _hang_the_commit(nfslike_mount, "run/*latest*", root)
    gave_up = peer["error"]["at"]
    stalls = _warnings(writer["log"], f"this rank has been in pointer of save of step 1 of {root}")
    assert stalls and stalls[0]["at"] < gave_up, writer["log"]
    error = peer["error"]
    assert (error["type"], error["phase"], error["outcome"]) == ("PeerTimeout", "pointer", "unknown"), error
    assert "had begun the commit of step 1" in error["message"] and "latest() tells" in error["message"]
    assert "error" not in writer, writer  # committed: the writer returned normally
    assert writer["latest"] == 1


def _latest_with_the_root_hung(rank: int, world: int, root: str, gave_up: Any) -> dict[str, Any]:
    log = _Records()
    out: dict[str, Any] = {"pid": os.getpid()}
    try:
        found = safeio.Checkpoints(root, timeout=TIMEOUT).latest()
        out["found"] = found.step if found is not None else None
    except safeio.SafeIOError as exc:
        out["error"] = _error(exc)
        gave_up.set()
    out["log"] = log.records
    return out


def test_latest_with_the_writer_hung_reading_the_root_names_it_in_resolve(nfslike_mount: Mount) -> None:
    root = nfslike_mount.path / "run"
    root.mkdir()
    gave_up = _event()
    nfslike_mount.set_faults(hang="run/latest")  # the pointer: the first thing latest() reads
    helper = threading.Thread(target=lambda: (gave_up.wait(120), nfslike_mount.release()))
    helper.start()
    try:
        results = run_ranks(_latest_with_the_root_hung, 2, str(root), gave_up, timeout=180, env=ENV)
    finally:
        gave_up.set()
        helper.join(60)
        nfslike_mount.set_faults(hang=None)
        nfslike_mount.release()
    writer, peer = results[0].value, results[1].value
    gave_up_at = peer["error"]["at"]
    stalls = _warnings(writer["log"], f"this rank has been in resolve of latest() of {root}")
    assert stalls and stalls[0]["at"] < gave_up_at, writer["log"]
    waiting = _warnings(peer["log"], f"rank 0 ({HOST} pid {writer['pid']}) has been in resolve of latest()")
    assert waiting and waiting[0]["at"] < gave_up_at, peer["log"]
    error = peer["error"]
    assert (error["type"], error["waited_for"], error["phase"], error["step"]) == (
        "PeerTimeout",
        0,
        "resolve",
        None,
    )
    assert writer["found"] is None  # the writer answers once the mount does


def _async_save_whose_future_never_completes(rank: int, world: int, root: str) -> dict[str, Any]:
    import concurrent.futures

    log = _Records()
    out: dict[str, Any] = {"pid": os.getpid()}
    ckpts = safeio.Checkpoints(root, timeout=TIMEOUT)
    upload: concurrent.futures.Future[None] = concurrent.futures.Future()
    with ckpts.save(1) as ckpt:
        Path(ckpt.path, f"shard-{rank}").write_text(str(rank))
        ckpt.commit_after(upload)
    if rank == 1:
        upload.set_result(None)  # rank 0's upload never finishes
    try:
        ckpts.wait()
    except safeio.SafeIOError as exc:
        out["error"] = _error(exc)
    out["log"] = log.records
    return out


def test_an_async_commit_waiting_for_its_upload_is_told_and_bounded(shared_dir: Path) -> None:
    """``commit_after(future)`` whose future never completes on rank 0: its commit thread warns with its
    own stack in "async save", its training thread's ``wait()`` says what the commit is doing, rank 1
    names rank 0 in "async save"; at the timeout rank 0's commit thread gives up on its own upload
    (PeerTimeout), nothing is committed and every rank hears it."""
    root = shared_dir / "ckpts"
    results = run_ranks(_async_save_whose_future_never_completes, 2, str(root), timeout=120, env=ENV)
    writer, peer = results[0].value, results[1].value
    stalls = _warnings(writer["log"], f"this rank has been in async save of save of step 1 of {root}")
    assert stalls and "Stack of thread 'safeio-commit step 1" in stalls[0]["message"], writer["log"]
    assert "wait_for_future" in stalls[0]["message"]
    joined = _warnings(writer["log"], "still waiting after")
    assert any(
        f"the commit of the async save of step 1 of {root} is in async save" in j["message"] for j in joined
    )
    assert writer["error"]["type"] == "PeerTimeout" and writer["error"]["phase"] == "async save", writer
    assert "did not finish within the timeout" in writer["error"]["message"]
    waiting = _warnings(peer["log"], f"rank 0 ({HOST} pid {writer['pid']}) has been in async save")
    assert waiting and waiting[0]["at"] < peer["error"]["at"], peer["log"]
    assert peer["error"]["type"] == "CheckpointError" and 0 in peer["error"]["failed"], peer
    _no_step_1(root)


def test_a_retired_steps_deletion_stuck_in_the_filesystem_is_told_and_left_at_its_bound(
    nfslike_mount: Mount, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention deletes retired steps in the background; the next save waits for that deletion (bounded
    by the timeout). On the code before it waited silently for the whole timeout."""
    caplog.set_level(logging.WARNING, logger="safeio")
    root = nfslike_mount.path / "run"
    monkeypatch.setenv("SAFEIO_WARN_AFTER", str(WARN))
    ckpts = safeio.Checkpoints(root, keep=1, timeout=TIMEOUT, group=safeio.Group())
    with ckpts.save(1) as ckpt:
        Path(ckpt.path, "weights").write_text("1")
    nfslike_mount.set_faults(hang="run/.step_1.safeio-tmp-*/*")  # the deletion of step 1's files hangs
    try:
        with ckpts.save(2) as ckpt:  # retires step 1: renamed aside, then deleted in the background
            Path(ckpt.path, "weights").write_text("2")
        with ckpts.save(3) as ckpt:  # first joins that deletion, bounded
            Path(ckpt.path, "weights").write_text("3")
    finally:
        nfslike_mount.set_faults(hang=None)
        nfslike_mount.release()
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    waiting = [m for m in messages if "still waiting after" in m and "safeio-retention" in m]
    assert waiting and f"retention of {root}" in waiting[0] and "_delete" in waiting[0], messages
    left = [m for m in messages if f"is still running after {TIMEOUT:g} s (the timeout)" in m]
    assert left and f"safeio gc {root}" in left[0], messages
    assert ckpts.steps() == [3]


def test_the_exit_waiting_for_a_commit_says_what_it_waits_for(tmp_path: Path) -> None:
    """A job that ends without ``ckpts.wait()`` while its async commit still runs: the exit joins the
    commit's thread, bounded, saying what it waits for. On the code before it waited silently."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import concurrent.futures, logging
        import safeio

        logging.basicConfig(level=logging.WARNING)
        ckpts = safeio.Checkpoints({str(tmp_path / "ckpts")!r}, timeout={TIMEOUT})
        with ckpts.save(1) as ckpt:
            open(ckpt.path + "/weights", "w").close()
            ckpt.commit_after(concurrent.futures.Future())  # an upload that never finishes
        print("training ended", flush=True)
        """
    )
    env = {**os.environ, "SAFEIO_WARN_AFTER": str(WARN)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout.strip() == "training ended", done.stderr
    lines = [line for line in done.stderr.splitlines() if "exiting: still waiting after" in line]
    assert lines and "'safeio-commit step 1 of" in lines[0], done.stderr
    assert "the commit of the async save of step 1" in lines[0] and "is in async save" in lines[0]
    assert "did not finish within the timeout" in done.stderr or "not committed" in done.stderr


def test_warn_after_is_an_option_of_checkpoints_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAFEIO_WARN_AFTER", "7")
    assert safeio.Checkpoints(tmp_path / "a").options.warn_after == 7.0
    assert safeio.Checkpoints(tmp_path / "a", warn_after=2).options.warn_after == 2.0
    assert safeio.Checkpoints(tmp_path / "a", warn_after=float("inf")).options.warn_after == float("inf")
    with pytest.raises(safeio.InvalidOptionError, match="warn_after"):
        safeio.Checkpoints(tmp_path / "a", warn_after=-1)
