"""``SAFEIO_PATCH=1``: protection without code changes, in processes the parent's patch never reaches.

Unmodified programs whose workers are fresh interpreters (``mp.spawn``; Lightning's ``ddp_spawn``) save
a tokenizer on every rank into one directory of the NFS-like mount — the seed's failure — first without
the variable (shown failing: hazards, failed saves), then with it (no hazard, no failure, every worker
patched). An unmodified HF Trainer program under torchrun, a rank killed in the middle of a checkpoint:
without the variable the resume takes the partial checkpoint and crashes; with it, it resumes from the
last committed one. Which parts each value of the variable patches. And the hook's cost when the
variable is unset: it imports nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from safeio.testing.nfslike import Mount
from safeio.testing.ranks import free_port

ROOT = Path(__file__).resolve().parent.parent
INTERLOCK = {"hazard_timeout": 0.5}


def _start_program(how: str, target: Path, out: Path, patch: bool, world: int) -> subprocess.Popen[str]:
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFEIO_PATCH")}
    if patch:
        env["SAFEIO_PATCH"] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "tests._spawned_workers", how, str(target), str(out), str(world)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _results(program: subprocess.Popen[str], out: Path, world: int) -> list[dict[str, Any]]:
    _stdout, stderr = program.communicate(timeout=240)
    assert program.returncode == 0, stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.fuse_opts(**INTERLOCK)
@pytest.mark.parametrize(("how", "world"), [("spawn", 2), ("lightning", 2)])
def test_safeio_patch_protects_spawned_workers(
    nfslike_mount: Mount, tmp_path: Path, how: str, world: int
) -> None:
    if how == "lightning":
        pytest.importorskip("lightning")
    plain_dir, patched_dir = nfslike_mount.path / "plain", nfslike_mount.path / "patched"
    # Both programs at once (their start-up, importing torch and transformers, is most of the time).
    programs = [
        _start_program(how, plain_dir, tmp_path / "plain", False, world),
        _start_program(how, patched_dir, tmp_path / "patched", True, world),
    ]
    plain = _results(programs[0], tmp_path / "plain", world)
    patched = _results(programs[1], tmp_path / "patched", world)
    hazards = nfslike_mount.hazards()
    # The failure: every rank truncating the same files under the others' readers.
    assert any(h["path"].startswith("/plain/") for h in hazards) and any(r["errors"] for r in plain), (
        hazards,
        plain,
    )
    assert not any(r["patched"] for r in plain)
    # With SAFEIO_PATCH=1 the hook reached every spawned worker: no hazard, no failed save.
    assert all(r["patched"] for r in patched), patched
    assert [r["errors"] for r in patched] == [[]] * world
    assert not [h for h in hazards if h["path"].startswith("/patched/")]  # paths are the mount's
    import safeio

    assert safeio.verify(patched_dir) == []


def _torchrun(output: Path, report: Path, patch: str | None, *options: str) -> subprocess.Popen[str]:
    report.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFEIO_PATCH")}
    if patch is not None:
        env["SAFEIO_PATCH"] = patch
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master-port", str(free_port()), "-m", "tests._trainer_program", str(output), str(report)]
    return subprocess.Popen(
        [*command, *options], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finished(program: subprocess.Popen[str]) -> tuple[int, str]:
    _stdout, stderr = program.communicate(timeout=240)
    return program.returncode, stderr


def _entries(output: Path) -> list[str]:
    return sorted(n for n in os.listdir(output) if "checkpoint-" in n)


def test_safeio_patch_makes_an_unmodified_trainer_resume_from_a_committed_checkpoint(
    nfslike_mount: Mount, tmp_path: Path
) -> None:
    plain, patched = nfslike_mount.path / "plain", nfslike_mount.path / "patched"
    # Rank 0 SIGKILLed in the middle of writing checkpoint-4 (checkpoint-2 was saved before), both ways.
    killed = [
        _torchrun(plain, tmp_path / "plain-killed", None, "--kill-at", "4"),
        _torchrun(patched, tmp_path / "patched-killed", "1", "--kill-at", "4"),
    ]
    (plain_code, plain_err), (patched_code, patched_err) = map(_finished, killed)
    assert plain_code != 0 and "SIGKILL" in plain_err, plain_err[-3000:]
    assert patched_code != 0 and "SIGKILL" in patched_err, patched_err[-3000:]
    # Without safeio the partial checkpoint stands under its final name; with it, only its stage.
    assert _entries(plain) == ["checkpoint-2", "checkpoint-4"]
    assert "model.safetensors" in os.listdir(plain / "checkpoint-4")
    assert "trainer_state.json" not in os.listdir(plain / "checkpoint-4")
    assert [n for n in _entries(patched) if not n.startswith(".")] == ["checkpoint-2"]
    # The plain run's directory again, restarted with SAFEIO_PATCH=1 (a copy: the plain resume reads it).
    converted = nfslike_mount.path / "converted"
    shutil.copytree(plain, converted, symlinks=True)
    resumed = [
        _torchrun(plain, tmp_path / "plain-resumed", None, "--resume", "last"),  # run_clm's way
        _torchrun(patched, tmp_path / "patched-resumed", "1", "--resume", "true"),
        _torchrun(converted, tmp_path / "converted-resumed", "1", "--resume", "true"),
    ]
    (plain_code, plain_err), (patched_code, patched_err), (converted_code, converted_err) = map(
        _finished, resumed
    )
    # The failure: transformers' get_last_checkpoint takes checkpoint-4 and every rank crashes on it.
    assert plain_code != 0, plain_err[-3000:]
    assert "No such file or directory" in plain_err and "checkpoint-4/trainer_state.json" in plain_err
    # With SAFEIO_PATCH=1: get_last_checkpoint (imported by name) and train(resume_from_checkpoint=True)
    # both give checkpoint-2, every rank resumes from step 2 and the run finishes.
    assert patched_code == 0, patched_err[-3000:]
    reports = [json.loads((tmp_path / "patched-resumed" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["started_at"], r["step"]) for r in reports] == [(2, 6), (2, 6)], reports
    assert {r["last"] for r in reports} == {str(patched / "checkpoint-2")}
    # 1 includes accelerate's part (the Trainer imports accelerate): its checkpoints are still staged once,
    # by the Trainer's part (verified below); the Trainer never calls Accelerator.save_state.
    assert all(r["patched"].endswith(":save_pretrained,trainer,accelerate") for r in reports), reports
    # Every checkpoint committed (the dead writer's stage cleared), rotated to save_total_limit=2.
    assert _entries(patched) == ["checkpoint-4", "checkpoint-6"]
    import safeio

    assert safeio.verify(patched / "checkpoint-6") == [] and safeio.verify(patched / "checkpoint-4") == []
    # Over the plain run's checkpoints: resumed from its complete checkpoint-2 (WARNING), and its save of
    # step 4 moved the plain run's unfinished checkpoint-4 aside, kept as it was (before: the save of
    # step 4 raised InvalidTargetError naming it and the job failed).
    assert converted_code == 0, converted_err[-3000:]
    assert f"resuming from {converted}/checkpoint-2, which safeio did not commit" in converted_err
    aside = [n for n in os.listdir(converted) if n.startswith("incomplete-checkpoint-4.")]
    assert len(aside) == 1, os.listdir(converted)
    assert f"{converted}/checkpoint-4 was written without safeio" in converted_err
    assert f"moved aside to {converted}/{aside[0]}" in converted_err
    assert sorted(os.listdir(converted / aside[0])) == sorted(os.listdir(plain / "checkpoint-4"))
    # Retention retires committed steps only: the plain run's checkpoint-2 stays (never deleted by safeio).
    assert [n for n in _entries(converted) if n.startswith("checkpoint-")] == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
    ]
    assert safeio.verify(converted / "checkpoint-4") == [] and safeio.verify(converted / "checkpoint-6") == []


_PARTS_PROBE = """
import json, os, transformers
from transformers.trainer_utils import get_last_checkpoint
import transformers.trainer as trainer
import accelerate
print(json.dumps({
    "active": os.environ.get("SAFEIO_PATCH_ACTIVE", ":").split(":")[1],
    "trainer": hasattr(trainer.Trainer._save_checkpoint, "__wrapped__"),
    "accelerate": hasattr(accelerate.Accelerator.save_state, "__wrapped__"),
    "lookup": get_last_checkpoint.__module__,
}))
"""


def test_the_values_of_safeio_patch() -> None:
    from safeio._autopatch.startup import parts

    everything = ["save_pretrained", "trainer", "accelerate"]
    assert parts("1") == parts("all") == parts("save_pretrained,trainer,accelerate") == (everything, [])
    assert parts("models") == ([*everything, "models"], [])  # 1 and models, as before
    assert parts("models,-trainer") == (["save_pretrained", "accelerate", "models"], [])
    assert parts("accelerate") == (["accelerate"], [])
    assert parts("1,-accelerate") == (["save_pretrained", "trainer"], [])
    assert parts("save_pretrained") == (["save_pretrained"], [])
    assert parts("trainer, Bogus") == (["trainer"], ["bogus"])
    assert parts("1,0") == parts("off") == parts("-save_pretrained") == ([], [])
    assert parts("trainer,models") == ([*everything, "models"], [])


def test_each_value_of_safeio_patch_patches_its_parts() -> None:
    # The opt-out leaves the Trainer as transformers wrote it; an unknown word never stops the rest.
    values = ["save_pretrained", "trainer,bogus", "accelerate"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFEIO_PATCH")}
    probes = [
        subprocess.Popen(
            [sys.executable, "-c", _PARTS_PROBE],
            env={**env, "SAFEIO_PATCH": value},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for value in values
    ]
    done = {value: probe.communicate(timeout=120) for value, probe in zip(values, probes, strict=True)}
    found = {value: json.loads(out.strip().splitlines()[-1]) for value, (out, _) in done.items()}
    ours, theirs = "safeio.integrations.transformers", "transformers.trainer_utils"
    assert found == {
        "save_pretrained": {
            "active": "save_pretrained",
            "trainer": False,
            "accelerate": False,
            "lookup": theirs,
        },
        "trainer,bogus": {"active": "trainer", "trainer": True, "accelerate": False, "lookup": ours},
        "accelerate": {"active": "accelerate", "trainer": False, "accelerate": True, "lookup": theirs},
    }
    # An unknown word is reported once at start-up, and the rest still applies.
    assert done["trainer,bogus"][1].count("unknown 'bogus' ignored") == 1, done["trainer,bogus"][1]


def test_the_hook_costs_nothing_when_the_variable_is_unset() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFEIO_PATCH")}
    probe = "import sys; print(sorted(m for m in sys.modules if m.startswith('safeio')))"
    unset = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    # Unset, the hook's one line reads one variable: nothing is imported because of it.
    assert unset.returncode == 0 and unset.stdout.strip() == "[]", unset.stdout
    assert "safeio" not in unset.stderr.replace("__editable___safeio", "")  # -X importtime: no safeio import
    # Set, safeio is still not imported until transformers is (start-up stays cheap for every process).
    env["SAFEIO_PATCH"] = "1"
    setting = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    assert setting.returncode == 0 and setting.stdout.strip() == "[]", setting.stdout


def test_safeio_autopatch_reports_the_hook_and_a_patched_process() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFEIO_PATCH")}
    done = subprocess.run(
        [sys.executable, "-m", "safeio", "autopatch", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["hook"].endswith("safeio-autopatch.pth") and report["new_process_patched"] is True
    assert report["parts"] == ["save_pretrained", "trainer", "accelerate"], report


def test_a_broken_hook_never_breaks_start_up(tmp_path: Path) -> None:
    # SAFEIO_PATCH set where safeio cannot patch (transformers raising on import): the program still runs.
    fake = tmp_path / "transformers"
    fake.mkdir()
    (fake / "__init__.py").write_text("PreTrainedTokenizerBase = None\n")
    env = {**os.environ, "SAFEIO_PATCH": "1", "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", "import transformers; print('still running')"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "still running" in done.stdout, done.stderr
    assert "SAFEIO_PATCH is set but the patch failed" in done.stderr
