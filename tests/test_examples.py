"""The examples users copy run as documented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("transformers")


def test_checkpoint_loop_example(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "examples/checkpoint_loop.py",
            "--ranks",
            "2",
            "--steps",
            "2",
            "--dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("'resumed_step': 2, 'weights_match': True") == 2, out.stdout
    last = tmp_path / "checkpoint-2"
    names = set(os.listdir(last))
    assert {"dcp", "tokenizer.json", "config.json", "generation_config.json", "trainer"} <= names
    assert len(os.listdir(last / "dcp")) >= 3  # DCP's metadata plus one shard file per rank


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
