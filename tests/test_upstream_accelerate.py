"""accelerate's own checkpoint program, as its wheel installs it
(``accelerate/test_utils/scripts/external_deps/test_checkpointing.py``), run unmodified through
``tests/_offline_accelerate.py`` (offline stand-ins for the hub's dataset, metric and model), plain and
with ``SAFEIO_PATCH=accelerate``, side by side: 2 gloo ranks under ``torchrun --standalone``, output on the
NFS-like mount, each job to the launcher's exit code.

- A clean run of one epoch, then ``--resume_from_checkpoint .../epoch_0``: the program's own asserts
  (accuracy, learning rates, epoch as saved in ``state_0.json``) pass on both sides.
- Rank 0 SIGKILLed inside ``save_state`` of ``epoch_1`` (hung there by the mount's fault injection),
  then a resume: plain leaves ``epoch_1`` torn under its final name and the resume from it crashes on
  every rank; with safeio nothing is under that name, and the resume from the last commit exits 0.

Every run is bounded; on a timeout the whole tree goes (torchrun starts each rank in a session of its
own, so killing the launcher's process group leaves the ranks running) and the test fails with the
ranks' output (issue 24: a job that never exited).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

import safeio
from safeio.testing.nfslike import Mount
from tests import _offline_accelerate
from tests._bounds import PATIENT
from tests._launcher import TEARDOWN, finish, kill_tree, launch, naming, start, torchrun

pytest.importorskip("accelerate")
pytest.importorskip("datasets")
pytest.importorskip("evaluate")

RUNNER = Path(_offline_accelerate.__file__)
# A run takes about 10 s here, several times that on a loaded machine; a hung teardown never ends by
# itself (issue 37: the bound only ends a job that hangs, so it is generous).
BOUND = PATIENT
SIDES = {"plain": "0", "safeio": "accelerate"}  # SAFEIO_PATCH of each side
RANKS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-bert")
    _offline_accelerate.build_model(os.fspath(path))
    path.chmod(0o755)
    return path


# torch's own teardown race, not safeio's (docs/troubleshooting.md, "A job that does not exit"; measured
# with accelerate's examples: 1 job in ~30 on both sides): a gloo worker still dropping the last
# collective's Python-owned tensors needs the GIL after finalization began, and the rank aborts; or the
# main thread, freeing the DDP model after end_training() destroyed its group, joins that worker holding
# the GIL, and the rank hangs. A job that dies of exactly that, or has not exited TEARDOWN s after every
# rank called end_training() (the runner says so; no checkpoint work is left after it), is run again,
# once; a second time, a hang or any other failure fails the test.
TEARDOWN_RACE = "terminate called without an active exception"


def _command(out: Path, model: Path, *extra: str) -> list[str]:
    args = ("--model_name_or_path", os.fspath(model), "--output_dir", os.fspath(out), *extra)
    return torchrun(RUNNER, *args, nproc=RANKS)


def _env(side: str) -> dict[str, str]:
    # ACCELERATE_USE_CPU: what `accelerate launch --cpu` sets; the program's Accelerator() then runs
    # MULTI_CPU on gloo (without it, each torchrun rank is a job of its own).
    return dict(
        os.environ,
        SAFEIO_PATCH=SIDES[side],
        ACCELERATE_USE_CPU="true",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )


def _said(marker: str, output: str) -> bool:
    """Every rank said ``marker`` (the runner's, tests/_offline_accelerate.py)."""
    return all(f"{marker} {rank}" in output for rank in range(RANKS))


def _every_rank_ended_its_work(output: str) -> bool:
    """Every rank called end_training() or returned from the program (a resume returns before it): only
    torch's teardown is left, and safeio's exit work, which is bounded."""
    return all(
        f"{_offline_accelerate.ENDING} {r}" in output or f"{_offline_accelerate.RETURNED} {r}" in output
        for r in range(RANKS)
    )


def _launch(side: str, out: Path, model: Path, log: Path, *extra: str) -> tuple[str, float, int | None]:
    what = f"{side} {' '.join(extra)}"
    return launch(_command(out, model, *extra), out, log, BOUND, what, _env(side), _every_rank_ended_its_work)


def _teardown_race(code: int | None, output: str) -> str | None:
    """How the job met torch's teardown race, if it did: hung or aborted after its work."""
    if code is None:
        stuck = [r for r in range(RANKS) if f"{_offline_accelerate.RETURNED} {r}" not in output]
        return f"hung at exit, {TEARDOWN:g} s after every rank ended its work (rank(s) {stuck} still in the program)"
    if code != 0 and TEARDOWN_RACE in output:
        return f"a rank died of the gloo teardown race (exit {code})"
    return None


def _run(side: str, out: Path, model: Path, log: Path, *extra: str, fresh: bool = False) -> str:
    """One job to the launcher's exit code 0 within ``BOUND``; its output (every rank's). ``fresh``: a
    rerun starts from an empty ``out`` (a job that saves)."""
    output, took, code = _launch(side, out, model, log, *extra)
    if (race := _teardown_race(code, output)) is not None:
        print(f"{side}: {race}; running the job again")
        if fresh:
            shutil.rmtree(out)
            out.mkdir()
        output, took, code = _launch(side, out, model, log, *extra)
    ended = "hung at exit, killed" if code is None else f"exited with {code}"
    assert code == 0, f"{side}: torchrun {ended} after {took:.1f} s:\n{output[-6000:]}"
    assert naming(os.fspath(out)) == [], "a rank outlived its launcher"
    # What tells a hang at exit from a hang in the work reaches the launcher (else its watch never fires).
    assert _said(_offline_accelerate.RETURNED, output), output[-6000:]
    print(f"{side} {' '.join(extra)}: exit 0 after {took:.1f} s")
    return output


@pytest.mark.parametrize("side", SIDES)
def test_the_program_saves_and_resumes(
    side: str, nfslike_mount: Mount, shared_dir: Path, model_dir: Path
) -> None:
    out = nfslike_mount.path / "out"
    out.mkdir()
    first = _run(side, out, model_dir, shared_dir / "first.log", "--partial_train_epoch", "1", fresh=True)
    assert _said(_offline_accelerate.ENDING, first), first[-6000:]
    epoch = out / "epoch_0"
    assert (epoch / "optimizer.bin").is_file() and (out / "state_0.json").is_file(), sorted(os.listdir(out))
    if side == "safeio":
        assert safeio.Checkpoints(out, name="epoch_{step}").committed() == [(0, epoch.name)]
        assert safeio.verify(epoch) == [], sorted(os.listdir(epoch))
    else:
        assert ".safeio-manifest.json" not in os.listdir(epoch)
    # The program loads epoch_0 and asserts accuracy, learning rates and epoch against state_0.json.
    again = _run(side, out, model_dir, shared_dir / "again.log", "--resume_from_checkpoint", os.fspath(epoch))
    assert "resumed checkpoint performance:" in again, again[-6000:]


# Only the main process writes optimizer.bin: plain into epoch_1, safeio into epoch_1's stage.
HANG = "*epoch_1*/optimizer.bin"
INTERLOCK = {"hazard_timeout": 10.0}  # the mount counts a truncation blocked this long by an open file


def _kill_mid_save(side: str, out: Path, model: Path, log: Path, mount: Mount) -> tuple[int | None, str]:
    """A job whose rank 0 hangs opening epoch_1's optimizer.bin (the mount's fault) and is SIGKILLed
    there; the launcher's exit code and the ranks' output."""
    mount.set_faults(hang=HANG, hang_timeout=BOUND)
    proc = start(_command(out, model), log, _env(side))
    try:
        deadline = time.monotonic() + BOUND
        # A bounded poll of the mount (nothing to block on): rank 0 is now inside save_state.
        while not (held := mount.hung()):
            assert proc.poll() is None, f"{side} ended before the hang:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no hang within {BOUND:g} s:\n{log.read_text()[-4000:]}"
            time.sleep(0.05)
        os.kill(held[0]["pid"], signal.SIGKILL)
    except BaseException:
        kill_tree(proc, out)
        raise
    finally:
        # A process blocked in a FUSE request dies once the request is answered: let it go.
        mount.set_faults(hang=None)
        mount.release()
    code = finish(proc, out, log, BOUND, f"{side}, killed")
    assert naming(os.fspath(out)) == [], "a rank outlived its launcher"
    return code, log.read_text(errors="replace")


@pytest.mark.fuse_opts(**INTERLOCK)
@pytest.mark.parametrize("side", SIDES)
def test_a_rank_killed_mid_save_then_a_resume(
    side: str, nfslike_mount: Mount, shared_dir: Path, model_dir: Path
) -> None:
    """Side by side: rank 0 SIGKILLed inside epoch_1's ``save_state``, then the program is started again
    with ``--resume_from_checkpoint``. Plain: epoch_1 is torn under its final name, and the resume from
    it crashes on every rank. safeio: nothing is under epoch_1; the resume from the last commit (epoch_0,
    ``Checkpoints.latest()``) passes the program's own asserts and exits 0."""
    out = nfslike_mount.path / "out"
    out.mkdir()
    code, first = _kill_mid_save(side, out, model_dir, shared_dir / "killed.log", nfslike_mount)
    assert code != 0, first  # torchrun ends the job when a rank dies
    torn = out / "epoch_1"
    if side == "plain":
        assert torn.is_dir() and not (torn / "random_states_0.pkl").exists(), sorted(os.listdir(out))
        again, took, code = _launch(
            side, out, model_dir, shared_dir / "again.log", "--resume_from_checkpoint", os.fspath(torn)
        )
        assert code != 0, again[-6000:]
        # The hung open of optimizer.bin never created it; the model's weights and rank 1's files are there.
        failure = [line for line in again.splitlines() if line.startswith("[rank") and "Error" in line]
        missing = f"FileNotFoundError: [Errno 2] No such file or directory: '{torn / 'optimizer.bin'}'"
        assert [f"[rank{r}]: {missing}" for r in (0, 1)] == sorted(failure), again[-6000:]
        print(f"plain: the resume from the torn {torn.name} exited {code} after {took:.1f} s: {failure}")
    else:
        assert not torn.exists(), sorted(os.listdir(out))
        last = safeio.Checkpoints(out, name="epoch_{step}").latest()
        assert last is not None and last.step == 0, last
        again = _run(side, out, model_dir, shared_dir / "again.log", "--resume_from_checkpoint", last.path)
        assert "resumed checkpoint performance:" in again, again[-6000:]
    hazards = nfslike_mount.hazards()
    print(f"{side}: {len(hazards)} hazards on the mount")
    if side == "safeio":
        assert hazards == [], hazards
