"""``SAFEIO_PATCH=1``: protection without code changes, in processes the parent's patch never reaches.

Unmodified programs whose workers are fresh interpreters (``mp.spawn``; Lightning's ``ddp_spawn``) save
a tokenizer on every rank into one directory of the NFS-like mount — the seed's failure — first without
the variable (shown failing: hazards, failed saves), then with it (no hazard, no failure, every worker
patched). And the hook's cost when the variable is unset: it imports nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from safeio.testing.nfslike import Mount

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
    done = subprocess.run(
        [sys.executable, "-m", "safeio", "autopatch", "--json"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["hook"].endswith("safeio-autopatch.pth") and report["new_process_patched"] is True


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
