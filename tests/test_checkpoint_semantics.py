"""Checkpoint semantics for what real jobs do (issue 23): restarts into a root with an earlier run's steps,
rollbacks, another user's steps in a shared root, failures after the commit, a kill during the deletion of
retired steps.

Real gloo ranks, real DCP, on local disk, the NFS-like mount and S3 on a moto server. Where a rule
replaces one that lost data (retention and ``latest`` by the highest step number), the test also shows
what that rule would have picked.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import safeio
from safeio.testing.nfslike import Mount
from safeio.testing.ranks import run_ranks
from tests._bounds import PATIENT, RUN

Action = tuple[Any, ...]


def _job(rank: int, world: int, root: str, actions: list[Action]) -> list[Any]:
    """Run ``actions`` on every rank, in order; return what each gave on this rank."""
    import torch
    import torch.distributed.checkpoint as dcp

    out: list[Any] = []
    for action in actions:
        kind = action[0]
        if kind == "save":
            _, step, keep = action
            with safeio.Checkpoints(root, keep=keep, timeout=PATIENT).save(step) as ckpt:
                dcp.save({"w": torch.full((4,), float(step))}, checkpoint_id=ckpt.path)  # every rank
                safeio.torch_save({"step": step}, os.path.join(ckpt.path, "trainer_state.pt"))  # once
            out.append(ckpt.warnings)
        elif kind == "latest":
            found = safeio.Checkpoints(root, timeout=PATIENT).latest()
            out.append(found.step if found is not None else None)
        elif kind == "steps":
            out.append(safeio.Checkpoints(root, timeout=PATIENT).steps())
        elif kind == "at":
            found = safeio.Checkpoints(root, timeout=PATIENT).at(action[1])
            restored = {"w": torch.zeros(4)}
            dcp.load(restored, checkpoint_id=found.path)
            out.append((found.step, restored["w"].tolist()))
        elif kind == "retention fails once" and rank == 0:
            _fail_retention_once()
    return out


def _fail_retention_once() -> None:
    """The writer's next retention fails as a full or broken disk would make its rename fail."""
    from safeio._checkpoints.step_directories import LocalSteps

    real = LocalSteps._retire

    def failing(self: LocalSteps, root_fd: int, retired: list[Any], replaced: list[str]) -> None:
        LocalSteps._retire = real  # type: ignore[method-assign]
        raise OSError(errno.EIO, "injected: the retired step could not be renamed aside")

    LocalSteps._retire = failing  # type: ignore[method-assign]


def _on_every_rank(results: list[Any]) -> list[Any]:
    values = [r.value for r in results]
    assert all(v == values[0] for v in values), values  # every rank got the same answers
    return list(values[0])


@pytest.fixture(params=["local", "nfslike", "s3"])
def root(request: pytest.FixtureRequest, shared_dir: Path) -> tuple[str, dict[str, str]]:
    """A checkpoint root and the environment its ranks need."""
    if request.param == "local":
        return str(shared_dir / "run"), {}
    if request.param == "nfslike":
        mount: Mount = request.getfixturevalue("nfslike_mount")
        return str(mount.path / "run"), {}
    s3: dict[str, str] = request.getfixturevalue("s3")
    return f"s3://{s3['BUCKET']}/run", s3


def test_a_restarted_job_keeps_the_step_it_just_saved(root: tuple[str, dict[str, str]]) -> None:
    """An earlier run left steps 1000 and 1001; the new job saves step 5 with keep=2. Ranking by number
    retired step 5 itself (and latest() named 1001, and a rank timed out waiting for 5)."""
    path, env = root
    run_ranks(_job, 2, path, [("save", 1000, 2), ("save", 1001, 2)], timeout=RUN, env=env)
    results = run_ranks(_job, 2, path, [("save", 5, 2), ("latest",), ("steps",)], timeout=RUN, env=env)
    warnings, latest, steps = _on_every_rank(results)
    assert warnings == [] and latest == 5
    assert steps == [5, 1001]  # the oldest commit (1000) retired; the new one kept
    assert max(steps) == 1001  # what "the highest number" would have resumed from, and kept


def test_a_rollback_then_a_save_makes_the_new_branch_the_latest(root: tuple[str, dict[str, str]]) -> None:
    """Steps 10, 20, 30; the job resumes from 10 on purpose (a loss spike) and saves 15: 15 is the latest
    commit, for this job and for the next one, while 30 stays the highest number."""
    path, env = root
    run_ranks(_job, 2, path, [("save", s, None) for s in (10, 20, 30)], timeout=RUN, env=env)
    results = run_ranks(_job, 2, path, [("at", 10), ("save", 15, None), ("latest",)], timeout=RUN, env=env)
    resumed, warnings, latest = _on_every_rank(results)
    assert tuple(resumed) == (10, [10.0] * 4) and warnings == [] and latest == 15
    results = run_ranks(_job, 2, path, [("latest",), ("steps",)], timeout=RUN, env=env)
    latest, steps = _on_every_rank(results)
    assert latest == 15 and steps == [10, 15, 20, 30] and max(steps) == 30


def test_at_a_step_that_is_not_committed_names_what_is(shared_dir: Path) -> None:
    path = str(shared_dir / "run")
    run_ranks(_job, 2, path, [("save", 1, None), ("save", 2, None)], timeout=RUN)
    (shared_dir / "run" / "step_3").mkdir()  # a step directory without a marker: never resumed from
    results = run_ranks(_job, 2, path, [("at", 3)], timeout=RUN, check=False)
    for r in results:  # every rank raises the same error, naming the committed steps
        assert isinstance(r.error, safeio.InvalidTargetError), r
        assert "step 3 is not a committed checkpoint" in str(r.error), r
        assert "committed steps: 1, 2" in str(r.error), r


def test_a_pointer_that_cannot_be_written_after_the_commit_is_a_warning(shared_dir: Path) -> None:
    """A directory planted where ``latest`` goes: the step is committed all the same, every rank is told
    so with a warning, latest() finds it; once the name is free, the next save writes the pointer."""
    path = str(shared_dir / "run")
    run_ranks(_job, 2, path, [("save", 1, None)], timeout=RUN)
    (shared_dir / "run" / "latest").unlink()
    (shared_dir / "run" / "latest").mkdir()
    results = run_ranks(_job, 2, path, [("save", 2, None), ("latest",)], timeout=RUN)
    warnings, latest = _on_every_rank(results)
    assert len(warnings) == 1 and "step 2 is committed, but the pointer" in warnings[0], warnings
    assert latest == 2 and safeio.verify(shared_dir / "run" / "step_2") == []
    (shared_dir / "run" / "latest").rmdir()
    results = run_ranks(_job, 2, path, [("save", 3, None), ("latest",)], timeout=RUN)
    assert _on_every_rank(results) == [[], 3]
    assert (shared_dir / "run" / "latest").read_text() == "step_3"


@pytest.mark.fuse_opts(entry_timeout=0.0, attr_timeout=0.0)
def test_a_pointer_write_failing_on_the_filesystem_is_a_warning(nfslike_mount: Mount) -> None:
    """The same with a real I/O error: EIO when the new pointer is fsynced."""
    path = str(nfslike_mount.path / "run")
    run_ranks(_job, 2, path, [("save", 1, None)], timeout=RUN)
    nfslike_mount.set_faults(eio_on_fsync="*latest.safeio-tmp-*")
    try:
        results = run_ranks(_job, 2, path, [("save", 2, None), ("latest",)], timeout=RUN)
    finally:
        nfslike_mount.set_faults(eio_on_fsync=None)
    warnings, latest = _on_every_rank(results)
    assert len(warnings) == 1 and "pointer" in warnings[0] and latest == 2, warnings
    assert (nfslike_mount.path / "run" / "latest").read_text() == "step_1"  # the old pointer, whole
    results = run_ranks(_job, 2, path, [("save", 3, None)], timeout=RUN)
    assert (nfslike_mount.path / "run" / "latest").read_text() == "step_3"


def test_a_retention_failure_after_the_commit_is_a_warning_and_the_next_save_retries(
    shared_dir: Path,
) -> None:
    path = str(shared_dir / "run")
    actions = [("save", 1, 2), ("save", 2, 2), ("retention fails once",), ("save", 3, 2), ("steps",)]
    warnings_1, warnings_2, warnings_3, steps = _on_every_rank(run_ranks(_job, 2, path, actions, timeout=RUN))
    assert warnings_1 == warnings_2 == []
    assert len(warnings_3) == 1 and "step 3 is committed, but retention" in warnings_3[0], warnings_3
    assert steps == [1, 2, 3]  # nothing retired, nothing lost: step 3 committed
    warnings_4, latest, steps = _on_every_rank(
        run_ranks(_job, 2, path, [("save", 4, 2), ("latest",), ("steps",)], timeout=RUN)
    )
    assert warnings_4 == [] and latest == 4 and steps == [3, 4]


OTHER_UID = 4242


def _save_as_another_user(root: str, steps: tuple[int, ...]) -> None:
    """In a forked child: become OTHER_UID (no groups) and commit ``steps`` under ``root``. A fork, not a
    new interpreter: that user may not be able to reach the checkout safeio is imported from."""
    import traceback

    try:
        os.setgroups([])
        os.setgid(OTHER_UID)
        os.setuid(OTHER_UID)
        # lock=False: this user cannot open the lock file of the root's owner for writing (and needs
        # none: nobody else saves here meanwhile)
        ckpts = safeio.Checkpoints(root, keep=None, timeout=PATIENT, lock=False)
        for step in steps:
            with ckpts.save(step) as ckpt:
                Path(ckpt.path, "weights.bin").write_bytes(b"theirs")
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def test_another_users_steps_in_a_shared_root_are_never_chosen_nor_retired(shared_dir: Path) -> None:
    """A sticky, world-writable root: uid 4242 commits steps 50 and 60 there first; our job (root) saves
    1, 2, 3 with keep=2. By number, 60 would be resumed from and ours retired."""
    shared = shared_dir / "share"
    shared.mkdir()
    shared.chmod(0o1777)
    path = str(shared / "run")
    os.mkdir(path)
    os.chmod(path, 0o1777)
    import multiprocessing

    theirs = multiprocessing.get_context("fork").Process(target=_save_as_another_user, args=(path, (50, 60)))
    theirs.start()
    theirs.join(PATIENT)
    assert theirs.exitcode == 0, theirs.exitcode
    assert {(shared / "run" / f"step_{s}").stat().st_uid for s in (50, 60)} == {OTHER_UID}
    actions = [("save", s, 2) for s in (1, 2, 3)] + [("latest",), ("steps",)]
    *_, latest, steps = _on_every_rank(run_ranks(_job, 2, path, actions, timeout=RUN))
    assert latest == 3 and steps == [2, 3]
    assert (shared / "run" / "step_50").is_dir() and (shared / "run" / "step_60").is_dir()  # untouched
    assert safeio.verify(shared / "run" / "step_60") == []
    listed = subprocess.run(
        [sys.executable, "-m", "safeio", "ls", "--json", path],
        capture_output=True,
        text=True,
        timeout=PATIENT,
    )
    rows = {row["name"]: row for row in json.loads(listed.stdout)["checkpoints"]}
    assert rows["step_60"]["state"] == "another-users" and rows["step_3"]["state"] == "committed"
    assert rows["step_60"]["detail"].startswith(f"another user's (uid {OTHER_UID})")


_KILLED_WHILE_DELETING = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import safeio
    ckpts = safeio.Checkpoints(sys.argv[1], keep=1, timeout=float(sys.argv[2]), durable=False)
    for step in (1, 2):
        with ckpts.save(step) as ckpt:
            for i in range(200 if step == 1 else 1):
                Path(ckpt.path, f"shard_{i}.bin").write_bytes(b"x" * 100)
    print("saved", flush=True)
    """
)


def test_a_kill_while_retired_steps_are_deleted_leaves_no_half_step_and_gc_finishes(
    nfslike_mount: Mount,
) -> None:
    """Deleting a retired step happens after the save returned, on a background thread: the process is
    SIGKILLed in the middle of it (its unlinks hang on the mount). No step is half deleted under its
    name; ``safeio gc`` removes what is left."""
    run = nfslike_mount.path / "run"
    # Only names inside a retired step's aside match: the saves themselves never hang.
    nfslike_mount.set_faults(hang="*.step_1.safeio-tmp-*/shard_1*", hang_timeout=600)
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WHILE_DELETING, str(run), str(PATIENT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + PATIENT
        assert proc.stdout.readline().strip() == "saved"  # step 2 committed; step 1 being deleted
        while not any(n.startswith(".step_1.safeio-tmp-") for n in os.listdir(run)):
            assert time.monotonic() < deadline, os.listdir(run)
            time.sleep(0.05)  # a bounded poll of the directory; the kill below is the event under test
        proc.send_signal(signal.SIGKILL)
        # A process blocked in a FUSE request dies once the request is answered: let the hung one go.
        nfslike_mount.set_faults(hang=None)
        nfslike_mount.release()
        assert proc.wait(PATIENT) == -signal.SIGKILL
    finally:
        nfslike_mount.set_faults(hang=None)
        nfslike_mount.release()
        if proc.poll() is None:
            proc.kill()
    names = os.listdir(run)
    aside = [n for n in names if n.startswith(".step_1.safeio-tmp-")]
    assert "step_1" not in names and len(aside) == 1, names  # aside, never half deleted under its name
    assert os.listdir(run / aside[0])  # its deletion did not finish (it hung on a shard, then the kill)
    assert safeio.Checkpoints(str(run), timeout=PATIENT).steps() == [2]
    done = subprocess.run([sys.executable, "-m", "safeio", "gc", str(run)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not any(n.startswith(".step_1.safeio-") for n in os.listdir(run)), os.listdir(run)


def _announce_a_crafted_stage(rank: int, world: int, root: str, crafted: str) -> str:
    """Rank 0 announces ``crafted`` as the stage (a compromised or buggy writer); what each rank raised."""
    from safeio._coordination.checkpoint_call import CheckpointCall

    if rank == 0:
        real = CheckpointCall.announce

        def crafted_announce(self: CheckpointCall, value: Any) -> None:
            real(self, {**value, "stage": crafted} if value.get("ok") else value)

        CheckpointCall.announce = crafted_announce  # type: ignore[method-assign]
    try:
        with safeio.Checkpoints(root, timeout=PATIENT).save(1) as ckpt:
            Path(ckpt.path, f"shard_{rank}").write_text("x")
    except safeio.CheckpointError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("crafted", ["/tmp/elsewhere", "../elsewhere", ".step_1.safeio-stage-x/../../e"])
def test_a_stage_name_heard_through_the_store_must_be_one_safeio_gives(
    shared_dir: Path, crafted: str
) -> None:
    results = run_ranks(_announce_a_crafted_stage, 2, str(shared_dir / "run"), crafted, timeout=RUN)
    assert "is not one safeio gives" in results[1].value, results[1].value
    # Rank 1 tells the writer at once (it waited out its timeout for rank 1's report before), and
    # nothing is committed.
    assert "rank 1: CheckpointError" in results[0].value and "is not one safeio gives" in results[0].value
    assert not (shared_dir / "run" / "step_1").exists() and not (shared_dir / "elsewhere").exists()
