"""The examples users copy run as documented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("transformers")


def test_checkpoint_loop_example_saves_crashes_and_resumes(tmp_path: Path) -> None:
    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        argv = ["--ranks", "2", "--steps", "3", "--dir", str(tmp_path), "--timeout", "3", *extra]
        return subprocess.run(
            [sys.executable, "examples/checkpoint_loop.py", *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )

    crashed = run("--crash-at", "3")  # rank 1 dies in the middle of step 3's save
    assert crashed.returncode == 1, crashed.stdout + crashed.stderr[-3000:]
    assert "CheckpointError" in crashed.stdout and "rank 1 never reported" in crashed.stdout, crashed.stdout
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint-")) == [
        "checkpoint-1",
        "checkpoint-2",
    ]
    resumed = run()
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr[-3000:]
    assert resumed.stdout.count("{'resumed_from': 2, 'latest': 3, 'steps': [2, 3]}") == 2, resumed.stdout
    last = tmp_path / "checkpoint-3"
    assert {".metadata", "tokenizer.json", "config.json", "trainer_state.pt"} <= set(os.listdir(last))
    assert len([n for n in os.listdir(last) if n.endswith(".distcp")]) == 2  # one shard file per rank


def test_replicated_tokenizer_example(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "examples/replicated_tokenizer.py", "--ranks", "2", "--dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rank 0/2: wrote it" in out.stdout and "rank 1/2: waited for rank 0" in out.stdout
    assert "complete per manifest: True" in out.stdout
