"""An upstream HF Trainer program nobody here wrote, run as its users run it, plain and under
``SAFEIO_PATCH=1`` side by side (issue 24): 2 gloo ranks under ``torchrun --standalone``, the output
directory on the NFS-like mount, ``--save_steps 2 --save_total_limit 2``, rank 0 SIGKILLed in the
middle of writing ``checkpoint-4``, then a second job resuming from the last checkpoint.

Used by tests/test_upstream_trl.py (TRL's SFT script, from the installed package) and by
scripts/upstream_checks.py (transformers' run_clm.py from a checkout the user has: a release check).

The kill: the mount makes every operation on ``*checkpoint-4*/optimizer.pt`` (the final directory's and
safeio's stage ``.checkpoint-4.safeio-stage-*``) hang; once both jobs' rank 0 hang there (the mount's
log says so), both are SIGKILLed and the hang released. How a job resumes: both programs pass
``--resume_from_checkpoint PATH`` to ``Trainer.train`` (neither looks for a checkpoint itself, and the
string ``True`` is taken as a path); the second job is given the path
``transformers.trainer_utils.get_last_checkpoint(output_dir)`` answers in a process with the job's
environment (under ``SAFEIO_PATCH=1`` that name is safeio's committed-only lookup).

Every job is bounded; on a timeout the whole tree is killed (torchrun starts each rank in a session
of its own, so a process group kill would miss them) and AssertionError raised with the job's output.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import safeio
from safeio.testing import hf_objects
from safeio.testing.nfslike import Mount
from tests._bounds import PATIENT
from tests._launcher import descendants, kill_tree, start

TORCHRUN = Path(sys.executable).with_name("torchrun")
LAUNCH = [os.fspath(TORCHRUN), "--standalone", "--nproc_per_node", "2"]
# A job takes 20 to 30 s here, two at once about 40 s, several times that on a loaded machine: the bound
# only ends a job that never exits (issue 37: a generous bound costs nothing when the job works).
BOUND = PATIENT
KILL_AT = 4
HANG = f"*checkpoint-{KILL_AT}*/optimizer.pt"
SIDES = ("plain", "patched")
# What the Trainer logs when it resumes from checkpoint-2 (transformers 4.x and 5.x).
RESUMED_AT_2 = "Resuming training from checkpoint with epoch 0 and global step 2"

# Arguments every Trainer program takes (TrainingArguments): 6 steps, a checkpoint every 2, 2 kept;
# the Trainer's INFO messages shown (TRL's script leaves transformers at WARNING, and the resume's
# "Resuming training from checkpoint" is INFO).
TRAINING = [
    "--max_steps", "6",
    "--save_steps", "2",
    "--save_total_limit", "2",
    "--per_device_train_batch_size", "2",
    "--use_cpu",
    "--ddp_backend", "gloo",
    "--report_to", "none",
    "--disable_tqdm", "true",
    "--log_level", "info",
]  # fmt: skip


def lines_of_text(count: int = 64) -> list[str]:
    """Training text: 12 words a line from the tiny tokenizer's vocabulary."""
    words = " ".join(hf_objects.TEXTS).split()
    return [" ".join(words[(i + j) % len(words)] for j in range(12)) for i in range(count)]


def environment(patch: bool, hf_home: Path) -> dict[str, str]:
    """The job's environment: offline, its own HF cache, ``SAFEIO_PATCH=1`` or no ``SAFEIO_PATCH*``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFEIO_PATCH")}
    env.update(HF_HOME=os.fspath(hf_home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    if patch:
        env["SAFEIO_PATCH"] = "1"
    return env


class Job:
    """One torchrun of the program, its output in ``log``."""

    def __init__(self, command: list[str], out: Path, env: dict[str, str], log: Path) -> None:
        self.out, self.log = out, log
        self.proc = start([*command, "--output_dir", os.fspath(out)], log, env)
        self.started = time.monotonic()

    def ranks(self) -> dict[int, int]:
        """rank -> pid of the launcher's children."""
        found = {}
        for pid in descendants(self.proc.pid):
            with contextlib.suppress(OSError):
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                rank = next((v[5:] for v in environ if v.startswith(b"RANK=")), None)
                if rank is not None:
                    found[int(rank)] = pid
        return found

    def finish(self) -> Ended:
        """The launcher's exit code within ``BOUND`` of its start, the ranks' output, the wall time."""
        try:
            code = self.proc.wait(max(1.0, BOUND - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"job into {self.out}: no exit within {BOUND:g} s (killed):\n{self.text()[-6000:]}"
            ) from None
        return Ended(code, self.text(), time.monotonic() - self.started)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        kill_tree(self.proc, self.out)


@dataclass(frozen=True)
class Ended:
    code: int
    text: str
    took: float


@dataclass(frozen=True)
class Side:
    """One side's story: the killed job, what was left, the resume's path and the resumed job."""

    out: Path
    killed: Ended
    left: list[str]  # checkpoint entries after the kill, stages included
    last: str  # get_last_checkpoint's answer, given to the resumed job
    resumed: Ended


def _hung(mount: Mount, *dirs: str) -> bool:
    """Whether the mount holds an operation on checkpoint-4's optimizer.pt under each of ``dirs``."""
    paths = [held["path"] for held in mount.hung()]
    return all(any(f"{d}/" in path and "optimizer.pt" in path for path in paths) for d in dirs)


def _last_checkpoint(out: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """What ``transformers.trainer_utils.get_last_checkpoint`` answers in the job's environment."""
    probe = (
        "import sys; from transformers.trainer_utils import get_last_checkpoint as g; print(g(sys.argv[1]))"
    )
    return subprocess.Popen(
        [sys.executable, "-c", probe, os.fspath(out)], env=env, stdout=subprocess.PIPE, text=True
    )


def entries(out: Path) -> list[str]:
    return sorted(n for n in os.listdir(out) if "checkpoint-" in n)


def kill_mid_checkpoint_then_resume(mount: Mount, work: Path, command: list[str]) -> dict[str, Side]:
    """Run ``command`` (a torchrun command line and the program's arguments, without
    ``--output_dir``) into ``plain/`` and ``patched/`` on ``mount`` at once, SIGKILL both jobs' rank 0
    while it writes checkpoint-4, then resume both from ``get_last_checkpoint``. Logs go to ``work``.

    The mount needs a hazard timeout well under the hang's (``hazard_timeout=0.5``)."""
    where = {side: mount.path / side for side in SIDES}
    env = {side: environment(side == "patched", work / f"hf-{side}") for side in SIDES}
    mount.set_faults(hang=HANG, hang_timeout=BOUND)
    jobs = {s: Job(command, where[s], env[s], work / f"{s}-killed.log") for s in SIDES}
    try:
        deadline = time.monotonic() + BOUND
        while not _hung(mount, *SIDES):
            running = {s: j.proc.poll() for s, j in jobs.items()}
            if None not in running.values() or time.monotonic() > deadline:
                raise AssertionError(
                    f"no hang at {HANG} within {BOUND:g} s: "
                    + repr({s: (code, jobs[s].text()[-3000:]) for s, code in running.items()})
                )
            time.sleep(0.2)  # a bounded poll of the mount's log; the kill below is the event under test
        for job in jobs.values():
            os.kill(job.ranks()[0], signal.SIGKILL)
    except BaseException:
        for job in jobs.values():
            job.kill()
        raise
    finally:
        # A process blocked in a FUSE request dies once the request is answered: let the hung ones go.
        mount.set_faults(hang=None)
        mount.release()
    killed = {s: j.finish() for s, j in jobs.items()}
    left = {s: entries(where[s]) for s in SIDES}
    lookups = {s: _last_checkpoint(where[s], env[s]) for s in SIDES}
    last = {s: p.communicate(timeout=120)[0].strip().splitlines()[-1] for s, p in lookups.items()}
    again = [*command, "--resume_from_checkpoint"]
    resumed = {s: Job([*again, last[s]], where[s], env[s], work / f"{s}-resumed.log") for s in SIDES}
    ended = {s: j.finish() for s, j in resumed.items()}
    return {s: Side(where[s], killed[s], left[s], last[s], ended[s]) for s in SIDES}


def unmet(sides: dict[str, Side], mount: Mount) -> list[str]:
    """The expectations the side-by-side run did not meet (empty: safeio made the difference)."""
    plain, patched = sides["plain"], sides["patched"]
    problems: list[str] = []

    def expect(ok: bool, what: str, evidence: str = "") -> None:
        if not ok:
            problems.append(f"{what}\n{evidence[-4000:]}" if evidence else what)

    for name, side in sides.items():
        expect(
            side.killed.code != 0 and "SIGKILL" in side.killed.text,
            f"{name}: the killed job ended {side.killed.code}, not by rank 0's SIGKILL",
            side.killed.text,
        )
    # Without safeio the partial checkpoint stands under its final name; with it, only its stage.
    expect(plain.left == ["checkpoint-2", "checkpoint-4"], f"plain left {plain.left}")
    expect(
        not (plain.out / "checkpoint-4" / "trainer_state.json").exists(),
        "plain: checkpoint-4 has its trainer_state.json (the kill came too late)",
    )
    expect(
        [n for n in patched.left if not n.startswith(".")] == ["checkpoint-2"], f"patched left {patched.left}"
    )
    expect(plain.last == f"{plain.out}/checkpoint-4", f"plain: get_last_checkpoint said {plain.last}")
    expect(patched.last == f"{patched.out}/checkpoint-2", f"patched: get_last_checkpoint said {patched.last}")
    # The failure: the partial checkpoint-4 is taken and every rank crashes on it.
    expect(plain.resumed.code != 0, "plain: the resumed job exited 0", plain.resumed.text)
    crash = f"No such file or directory: '{plain.out}/checkpoint-4/trainer_state.json'"
    expect(
        crash in plain.resumed.text, f"plain: the resumed job did not fail with {crash!r}", plain.resumed.text
    )
    # With SAFEIO_PATCH=1: resumed from step 2, finished, exit 0, the dead writer's stage cleared.
    expect(
        patched.resumed.code == 0,
        f"patched: the resumed job exited {patched.resumed.code}",
        patched.resumed.text,
    )
    expect(RESUMED_AT_2 in patched.resumed.text, "patched: not resumed from step 2", patched.resumed.text)
    now = entries(patched.out)
    expect(now == ["checkpoint-4", "checkpoint-6"], f"patched: {now} after the resumed job")
    if now == ["checkpoint-4", "checkpoint-6"]:
        state = json.loads((patched.out / "checkpoint-6" / "trainer_state.json").read_text())
        expect(state["global_step"] == 6, f"patched: checkpoint-6 is of step {state['global_step']}")
        for name in now:
            found = safeio.verify(patched.out / name)
            expect(found == [], f"patched: safeio.verify({name}) found {found}")
    hazards = [h for h in mount.hazards() if h["path"].startswith("/patched/")]
    expect(hazards == [], f"patched: hazards on the mount {hazards}")
    return problems


def summary(sides: dict[str, Side], mount: Mount) -> str:
    plain, patched = sides["plain"], sides["patched"]
    hazards = mount.hazards()
    return (
        f"killed jobs {plain.killed.took:.1f} s / {patched.killed.took:.1f} s; resumed plain exit "
        f"{plain.resumed.code} in {plain.resumed.took:.1f} s, patched exit {patched.resumed.code} in "
        f"{patched.resumed.took:.1f} s; hazards on the mount plain "
        f"{sum(h['path'].startswith('/plain/') for h in hazards)}, patched "
        f"{sum(h['path'].startswith('/patched/') for h in hazards)}"
    )
