"""A Lightning job built from Lightning's own classes (``tests/_lightning_cli_job.py``: LightningCLI over
the installed demos' ``DemoModel`` and ``BoringDataModule``), plain and with ``safeio.integrations.lightning``
chosen on the command line (two class paths, no code), run as its users run it: LightningCLI's flags under
``torchrun --standalone``, 2 gloo ranks (``ddp`` on the CPU), the run directory on the NFS-like mount, to
the launcher's exit code.

Issue 24: rank 0 is SIGKILLed in the middle of writing ``last.ckpt`` (the mount holds its write 64 KiB
into the file until the kill), then the same job is started again and resumes with ``ckpt_path="last"``.
Plain Lightning leaves the torn ``last.ckpt`` under its name and the resumed job dies loading it; through
safeio ``last.ckpt`` is still the previous save's, the resumed job trains from it and exits 0, and the
killed save's temporary file is gone after its next save (issue 24 item 4: the sweep of afa41c7; without
it the file stays). That resumed job is also the clean-exit check (issue 24 item 1): started with no fault
armed, it trains and saves, and its launcher exits 0 within ``BOUND`` with no rank left.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from safeio.testing.nfslike import Mount
from tests._bounds import PATIENT
from tests._launcher import finish, kill_tree, launch, naming, start, torchrun

pytest.importorskip("lightning")
# LightningCLI, which the example runs through, needs jsonargparse: a test dependency, so missing it is
# an error here, never a skip.
importlib.import_module("jsonargparse")

JOB = Path(__file__).parent / "_lightning_cli_job.py"
# What each side asks LightningCLI for: a ModelCheckpoint keeping last.ckpt, Lightning's or safeio's.
PLAIN = ("plain", ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.save_last=true"])
SAFE = (
    "safeio",
    [
        "--trainer.callbacks+=safeio.integrations.lightning.SafeModelCheckpoint",
        "--trainer.callbacks.save_last=true",
        "--trainer.plugins=safeio.integrations.lightning.SafeCheckpointIO",
    ],
)
# A job takes 13-32 s here, several times that on a loaded machine; a hang never ends (issue 37: the
# bound only ends a job that hangs, so it is generous).
BOUND = PATIENT
# BoringDataModule's 64 training samples over 2 ranks, one a batch: 32 steps an epoch, a save at the end
# of each (epoch=E-step=S.ckpt, then last.ckpt), so epoch 1's save is at step 64.
FIRST_STEPS, SECOND_SAVE = 32, "epoch=1-step=64"
OUT_DIM = 10_000  # DemoModel's Linear(32, OUT_DIM) with Adam: a checkpoint of about 3.8 MB
TORN_AT = 64 * 1024


def _job(side: tuple[str, list[str]], run: Path) -> list[str]:
    return torchrun(
        JOB,
        "fit",
        *side[1],
        f"--model.out_dim={OUT_DIM}",
        "--ckpt_path=last",  # Lightning's way to resume a job; nothing to resume the first time
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        "--trainer.strategy=ddp",
        "--trainer.max_epochs=2",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.limit_val_batches=0",
        f"--trainer.default_root_dir={run}",
    )


def _held(mount: Mount, proc: subprocess.Popen[bytes], log: Path, name: str) -> dict[str, Any]:
    """The operation the mount holds on ``name``, waited for with a bounded poll (the job runs in other
    processes and tells nobody when it reaches the save)."""
    deadline = time.monotonic() + BOUND
    while True:
        held = [h for h in mount.hung() if name in h["path"]]
        if held:
            return held[0]
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the job never reached {name} (exit {proc.poll()}):\n{log.read_text()[-6000:]}")
        time.sleep(0.05)


def _let_go(mount: Mount) -> None:
    # A process blocked in a FUSE request dies once the request is answered: let the held one go.
    mount.set_faults(hang=None, hang_after_bytes=None)
    mount.release()


def _killed_while_writing_last(mount: Mount, side: tuple[str, list[str]], run: Path, log: Path) -> int:
    """The first job, its rank 0 SIGKILLed in the middle of epoch 1's ``last.ckpt``; its exit code."""
    # Epoch 0's save writes last.ckpt too: hold the job at epoch 1's save first (its first touch of
    # that epoch's checkpoint name; every rank passed a barrier after each of epoch 0's saves, so its
    # last.ckpt is complete), then move the hold to last.ckpt's bytes past TORN_AT (moving it lets the
    # first hold go, and nothing runs between the two).
    mount.set_faults(hang=f"*{SECOND_SAVE}*", hang_after_bytes=None, hang_timeout=BOUND)
    proc = start(_job(side, run), log)
    try:
        _held(mount, proc, log, SECOND_SAVE)
        mount.set_faults(hang="*last.ckpt*", hang_after_bytes=TORN_AT)
        writer = _held(mount, proc, log, "last.ckpt")
        os.kill(writer["pid"], signal.SIGKILL)
    except BaseException:
        _let_go(mount)
        kill_tree(proc, run)  # the job never reached the save: it goes, with its ranks
        raise
    _let_go(mount)
    code = finish(proc, run, log, BOUND, f"{side[0]}, killed")
    assert naming(os.fspath(run)) == [], "a rank outlived its launcher"
    return code


def _loads(path: Path) -> Any:
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=False)["global_step"]
    except Exception as exc:  # what a resume meets: torch's own error for a torn archive
        return f"{type(exc).__name__}: {exc}"


def _killed_then_resumed(mount: Mount, side: tuple[str, list[str]], logs: Path) -> dict[str, Any]:
    run = mount.path / side[0]
    last = run / "checkpoints" / "last.ckpt"
    killed = _killed_while_writing_last(mount, side, run, logs / f"{side[0]}.log")
    job = {
        "killed": killed,
        "after_kill": sorted(os.listdir(last.parent)),
        "size": last.stat().st_size,
        "last": _loads(last),
    }
    job["output"], job["took"], job["code"] = launch(
        _job(side, run), run, logs / f"{side[0]}-again.log", BOUND, f"{side[0]}, resumed"
    )
    assert naming(os.fspath(run)) == [], "a rank outlived its launcher"
    job["after_resume"] = sorted(os.listdir(last.parent))
    job["resumed_last"] = _loads(last)
    return job


@pytest.mark.fuse_opts(hazard_timeout=5.0)
def test_a_rank_killed_while_last_ckpt_is_written_then_the_job_resumes(
    nfslike_clients: tuple[Mount, Mount], shared_dir: Path
) -> None:
    # Side by side, at the same time (the jobs mostly wait for imports): plain on one NFS-like client,
    # safeio on another, each with its own faults.
    plain_mount, safe_mount = nfslike_clients
    with ThreadPoolExecutor(2) as pool:
        plain_job = pool.submit(_killed_then_resumed, plain_mount, PLAIN, shared_dir)
        safe_job = pool.submit(_killed_then_resumed, safe_mount, SAFE, shared_dir)
        plain, safe = plain_job.result(), safe_job.result()
    print(
        {
            name: {k: v for k, v in job.items() if k != "output"}
            for name, job in (("plain", plain), ("safe", safe))
        }
    )

    # Plain: a torn last.ckpt under its name, and the resumed job dies loading it.
    assert plain["killed"] != 0 and safe["killed"] != 0
    assert TORN_AT <= plain["size"] < safe["size"], (plain["size"], safe["size"])
    assert plain["last"].startswith("RuntimeError: PytorchStreamReader failed reading zip archive"), plain
    assert plain["code"] != 0, plain["output"][-6000:]
    assert "PytorchStreamReader failed reading zip archive" in plain["output"], plain["output"][-8000:]

    # safeio: last.ckpt is epoch 0's, whole; the killed save left only its temporary file.
    temporary = [n for n in safe["after_kill"] if n.startswith(".last.ckpt.safeio-tmp-")]
    assert safe["last"] == FIRST_STEPS and len(temporary) == 1, safe
    assert safe["code"] == 0, safe["output"][-6000:]
    last = safe_mount.path / SAFE[0] / "checkpoints" / "last.ckpt"
    assert f"Restoring states from the checkpoint path at {last}" in safe["output"], safe["output"][-6000:]
    assert safe["resumed_last"] == 2 * FIRST_STEPS  # epoch 1 trained again from epoch 0's end, whole
    # The resumed job's first save into the directory removed the dead writer's temporary file.
    assert [n for n in safe["after_resume"] if ".safeio-" in n] == [], safe["after_resume"]
    assert plain_mount.hazards() == [] and safe_mount.hazards() == []
