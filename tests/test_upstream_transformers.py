"""transformers' own ``examples/pytorch/language-modeling/run_clm.py``, unmodified, under ``SAFEIO_PATCH=1``
and without it, side by side (issue 24): 2 gloo ranks under ``torchrun --standalone``, the output
directory on the NFS-like mount, ``--save_steps 2 --save_total_limit 2``, rank 0 SIGKILLed in the middle
of writing ``checkpoint-4``, then a second job resuming from the last checkpoint.

The script is not kept in this repository: the copy read through the workplace's code search may not be
committed. ``SAFEIO_UPSTREAM_RUN_CLM`` names a copy of it (measured with the file as of transformers
commit 00d481d, the newest stored; the installed transformers is 5.25.0); without it the test is
skipped, saying so. The script imports ``evaluate`` (its requirements.txt lists it); ``--do_eval`` is
off, so no metric is loaded from the hub.

How a job resumes: transformers 5's run_clm no longer looks for a checkpoint itself; it passes
``--resume_from_checkpoint PATH`` to ``Trainer.train``. The second job is given the path
``transformers.trainer_utils.get_last_checkpoint(output_dir)`` answers in a process with the job's
environment (the docs' way; under ``SAFEIO_PATCH=1`` that name is safeio's committed-only lookup).

The kill: the mount makes every operation on ``*checkpoint-4*/optimizer.pt`` (the final directory's and
safeio's stage ``.checkpoint-4.safeio-stage-*``) hang; once both jobs' rank 0 hang there (the mount's
log says so), both are SIGKILLed and the hang released. Every job is bounded; on a timeout the whole
tree is killed (torchrun starts each rank in a session of its own).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import safeio
from safeio.testing import hf_objects
from safeio.testing.nfslike import Mount

RUN_CLM = os.environ.get("SAFEIO_UPSTREAM_RUN_CLM", "")
if not os.path.isfile(RUN_CLM):
    pytest.skip(
        "SAFEIO_UPSTREAM_RUN_CLM does not name a copy of transformers' run_clm.py (not committable here)",
        allow_module_level=True,
    )
pytest.importorskip("datasets")
pytest.importorskip("evaluate")

TORCHRUN = Path(sys.executable).with_name("torchrun")
BOUND = 180.0  # a job takes about 25 s here, two at once about 40 s
KILL_AT = 4
HANG = f"*checkpoint-{KILL_AT}*/optimizer.pt"


def _inputs(where: Path) -> list[str]:
    """run_clm's offline inputs, as its README tells: a local config and tokenizer, a text file."""
    hf_objects.config().save_pretrained(where / "config")
    hf_objects.fast_tokenizer().save_pretrained(where / "tokenizer")
    words = " ".join(hf_objects.TEXTS).split()
    lines = [" ".join(words[(i + j) % len(words)] for j in range(12)) for i in range(64)]
    (where / "train.txt").write_text("\n".join(lines) + "\n")
    return [
        "--model_type", "llama",
        "--config_name", os.fspath(where / "config"),
        "--tokenizer_name", os.fspath(where / "tokenizer"),
        "--train_file", os.fspath(where / "train.txt"),
        "--block_size", "8",
        "--do_train",
        "--max_steps", "6",
        "--save_steps", "2",
        "--save_total_limit", "2",
        "--per_device_train_batch_size", "2",
        "--use_cpu",
        "--ddp_backend", "gloo",
        "--report_to", "none",
        "--disable_tqdm", "true",
    ]  # fmt: skip


def _env(patch: bool, hf_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFEIO_PATCH")}
    env.update(HF_HOME=os.fspath(hf_home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    if patch:
        env["SAFEIO_PATCH"] = "1"
    return env


class Job:
    """One torchrun of run_clm.py, its output in ``log``."""

    def __init__(self, out: Path, args: list[str], env: dict[str, str], log: Path) -> None:
        self.out, self.log = out, log
        command = [os.fspath(TORCHRUN), "--standalone", "--nproc_per_node", "2", RUN_CLM]
        with open(log, "wb") as sink:
            self.proc = subprocess.Popen(
                [*command, *args, "--output_dir", os.fspath(out)],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.started = time.monotonic()

    def ranks(self) -> dict[int, int]:
        """rank -> pid of the launcher's children."""
        found = {}
        for pid in _descendants(self.proc.pid):
            with contextlib.suppress(OSError):
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                rank = next((v[5:] for v in environ if v.startswith(b"RANK=")), None)
                if rank is not None:
                    found[int(rank)] = pid
        return found

    def finish(self) -> tuple[int, str, float]:
        """The launcher's exit code within ``BOUND`` of its start, the ranks' output, the wall time."""
        try:
            code = self.proc.wait(max(1.0, BOUND - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(
                f"run_clm into {self.out}: no exit within {BOUND:g} s (killed):\n{self.text()[-6000:]}"
            )
        return code, self.text(), time.monotonic() - self.started

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        for pid in {self.proc.pid, *_descendants(self.proc.pid)}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


def _descendants(pid: int) -> list[int]:
    tree: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            tree.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        children = tree.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _hung(mount: Mount, *dirs: str) -> bool:
    """Whether the mount's log shows an operation hung on checkpoint-4's optimizer.pt under each of
    ``dirs`` (nothing to block on: the daemon only logs it)."""
    lines = [ln for ln in mount.state_dir.joinpath("daemon.log").read_text().splitlines() if "hanging" in ln]
    return all(any(f"'/{d}/" in ln and "optimizer.pt" in ln for ln in lines) for d in dirs)


def _last_checkpoint(out: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """What ``transformers.trainer_utils.get_last_checkpoint`` answers in the job's environment."""
    probe = (
        "import sys; from transformers.trainer_utils import get_last_checkpoint as g; print(g(sys.argv[1]))"
    )
    return subprocess.Popen(
        [sys.executable, "-c", probe, os.fspath(out)], env=env, stdout=subprocess.PIPE, text=True
    )


def _entries(out: Path) -> list[str]:
    return sorted(n for n in os.listdir(out) if "checkpoint-" in n)


@pytest.mark.fuse_opts(hazard_timeout=0.5)
def test_run_clm_resumes_from_a_committed_checkpoint_with_safeio_patch(
    nfslike_mount: Mount, shared_dir: Path
) -> None:
    args = _inputs(shared_dir)
    where = {"plain": nfslike_mount.path / "plain", "patched": nfslike_mount.path / "patched"}
    env = {name: _env(name == "patched", shared_dir / f"hf-{name}") for name in where}
    nfslike_mount.set_faults(hang=HANG, hang_timeout=BOUND)
    jobs = {n: Job(where[n], args, env[n], shared_dir / f"{n}-killed.log") for n in where}
    try:
        deadline = time.monotonic() + BOUND
        while not _hung(nfslike_mount, *where):
            running = {n: j.proc.poll() for n, j in jobs.items()}
            assert None in running.values() and time.monotonic() < deadline, {
                n: (code, jobs[n].text()[-3000:]) for n, code in running.items()
            }
            time.sleep(0.2)  # a bounded poll of the mount's log; the kill below is the event under test
        writers = {n: j.ranks()[0] for n, j in jobs.items()}
        for pid in writers.values():
            os.kill(pid, signal.SIGKILL)
    finally:
        # A process blocked in a FUSE request dies once the request is answered: let the hung ones go.
        nfslike_mount.set_faults(hang=None)
        nfslike_mount.release()
    killed = {n: j.finish() for n, j in jobs.items()}
    for n, (code, text, _took) in killed.items():
        assert code != 0 and "SIGKILL" in text, (n, code, text[-3000:])
    # Without safeio the partial checkpoint stands under its final name; with it, only its stage.
    plain, patched = where["plain"], where["patched"]
    assert _entries(plain) == ["checkpoint-2", "checkpoint-4"]
    assert "trainer_state.json" not in os.listdir(plain / "checkpoint-4")
    assert [n for n in _entries(patched) if not n.startswith(".")] == ["checkpoint-2"]

    lookups = {n: _last_checkpoint(where[n], env[n]) for n in where}
    last = {n: p.communicate(timeout=120)[0].strip().splitlines()[-1] for n, p in lookups.items()}
    assert last == {"plain": str(plain / "checkpoint-4"), "patched": str(patched / "checkpoint-2")}
    again = {n: [*args, "--resume_from_checkpoint", last[n]] for n in where}
    resumed = {n: Job(where[n], again[n], env[n], shared_dir / f"{n}-resumed.log") for n in where}
    (plain_code, plain_text, plain_took), (patched_code, patched_text, patched_took) = (
        resumed["plain"].finish(),
        resumed["patched"].finish(),
    )
    # The failure: the partial checkpoint-4 is taken and every rank crashes on it.
    assert plain_code != 0, plain_text[-3000:]
    assert f"No such file or directory: '{plain}/checkpoint-4/trainer_state.json'" in plain_text
    # With SAFEIO_PATCH=1: resumed from step 2, finished, exit 0.
    assert patched_code == 0, patched_text[-6000:]
    resumed_at = "Resuming training from checkpoint with epoch 0 and global step 2"
    assert resumed_at in patched_text, patched_text[-6000:]
    assert _entries(patched) == ["checkpoint-4", "checkpoint-6"]  # the dead writer's stage cleared
    assert json.loads((patched / "checkpoint-6" / "trainer_state.json").read_text())["global_step"] == 6
    assert safeio.verify(patched / "checkpoint-6") == [] and safeio.verify(patched / "checkpoint-4") == []
    hazards = nfslike_mount.hazards()
    assert not [h for h in hazards if h["path"].startswith("/patched/")], hazards
    print(
        f"killed jobs {killed['plain'][2]:.1f} s / {killed['patched'][2]:.1f} s; resumed plain exit "
        f"{plain_code} in {plain_took:.1f} s, patched exit 0 in {patched_took:.1f} s; hazards on the mount "
        f"plain {sum(h['path'].startswith('/plain/') for h in hazards)}, patched 0"
    )
