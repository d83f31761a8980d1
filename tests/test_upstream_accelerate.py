"""accelerate's own ``examples/by_feature/checkpointing.py`` (offline copy in ``tests/upstream/accelerate``),
plain and with ``safeio.integrations.accelerate`` (its 7-line variant), run to the launcher's exit code:
2 gloo ranks under ``torchrun --standalone``, ``--use_stateful_dataloader``, on the NFS-like mount and on
local disk; then a second job resumes mid-epoch from the checkpoint the first committed.

Issue 24 ("Clean exit, always"): the safeio variant trained through every save, then ranks hung at
interpreter teardown and the launcher never returned. Every run here is bounded; on a timeout the whole
tree goes (torchrun starts each rank in a session of its own, so killing the launcher's process group
leaves the ranks running) and the test fails with the ranks' output.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import safeio
from safeio.testing.nfslike import Mount
from tests._launcher import launch, naming, torchrun

pytest.importorskip("accelerate")
pytest.importorskip("datasets")
pytest.importorskip("torchdata")

UPSTREAM = Path(__file__).parent / "upstream" / "accelerate"
BOUND = 120.0  # a run takes about 6 s here; a hung teardown never ends by itself
SAVE_EVERY = 5  # 2 ranks, 2 batches per epoch, 3 epochs: step_5 is saved one batch into epoch 2


# torch's own teardown race, not safeio's (measured: 1 in 31 jobs of the plain example and 1 in 32 of
# the safeio one under load): the example's last collective, an all_gather, ends about 1 ms before the
# interpreter exits, and a gloo worker still dropping that work's Python-owned tensors needs the GIL after
# finalization began: pthread_exit through a noexcept destructor, SIGABRT. A job that dies of exactly that
# is run again, once; a second time, a hang or any other failure fails the test.
TEARDOWN_RACE = "terminate called without an active exception"


def _run(script: str, out: Path, log: Path, *extra: str, fresh: bool = False) -> tuple[str, float]:
    """One job to the launcher's exit code 0 within ``BOUND``; its output (every rank's). ``fresh``: a
    rerun starts from an empty ``out`` (a job that saves)."""
    output, took, code = _launch(script, out, log, *extra)
    if code != 0 and TEARDOWN_RACE in output:
        print(f"{script}: a rank died of the gloo teardown race (exit {code}); running the job again")
        if fresh:
            shutil.rmtree(out)
            out.mkdir()
        output, took, code = _launch(script, out, log, *extra)
    assert code == 0, f"{script}: torchrun exited with {code} after {took:.1f} s:\n{output[-6000:]}"
    assert naming(os.fspath(out)) == [], "a rank outlived its launcher"
    return output, took


def _launch(script: str, out: Path, log: Path, *extra: str) -> tuple[str, float, int]:
    cmd = torchrun(
        UPSTREAM / script,
        "--cpu",
        "--use_stateful_dataloader",
        "--checkpointing_steps",
        str(SAVE_EVERY),
        "--output_dir",
        os.fspath(out),
        *extra,
    )
    return launch(cmd, out, log, BOUND, f"{script} {' '.join(extra)}")


@pytest.fixture(params=["nfslike", "local"])
def where(request: pytest.FixtureRequest, shared_dir: Path) -> Path:
    if request.param == "local":
        return shared_dir
    mount: Mount = request.getfixturevalue("nfslike_mount")
    return mount.path


@pytest.mark.parametrize("script", ["checkpointing.py", "checkpointing_safeio.py"])
def test_the_job_exits_and_resumes(script: str, where: Path, shared_dir: Path) -> None:
    out = where / "out"
    out.mkdir()
    first, took = _run(script, out, shared_dir / "first.log", fresh=True)
    assert "epoch 2:" in first, first
    step = out / f"step_{SAVE_EVERY}"
    assert step.is_dir() and (step / "dl_state_dict.bin").is_file(), sorted(os.listdir(out))
    if script == "checkpointing_safeio.py":
        assert safeio.verify(step) == [], sorted(os.listdir(step))
        assert safeio.Checkpoints(out, name="step_{step}").committed() == [(SAVE_EVERY, step.name)]
    # A second job loads step_5 (the stateful dataloader's position with it) and trains the last batch.
    again, took_again = _run(
        script, out, shared_dir / "again.log", "--resume_from_checkpoint", os.fspath(step)
    )
    assert f"Resumed from checkpoint: {step}" in again, again
    assert "epoch 2:" in again and "epoch 0:" not in again and "epoch 1:" not in again, again
    print(f"{script} on {where}: {took:.1f} s, resumed in {took_again:.1f} s")
