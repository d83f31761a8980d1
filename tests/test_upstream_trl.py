"""TRL's SFT script (``trl/scripts/sft.py``), run unmodified from the installed package under
``SAFEIO_PATCH=1`` and without it, side by side (issue 24): ``torchrun --standalone --nproc_per_node 2
-m trl.scripts.sft``, the output directory on the NFS-like mount, rank 0 SIGKILLed in the middle of
writing ``checkpoint-4``, then a job resuming with ``--resume_from_checkpoint`` the path
``get_last_checkpoint`` gives (the script passes the value to ``Trainer.train`` as a string: a path,
never ``True``). See tests/_upstream_jobs.py for the kill and the expectations.

Offline inputs, as TRL's docs take them from the hub: a tiny Llama and its tokenizer built in code and
saved to a directory (``--model_name_or_path``), a JSON-lines file of ``text`` in a directory
(``--dataset_name``, loaded by ``datasets.load_dataset`` offline).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from safeio.testing import hf_objects
from safeio.testing.nfslike import Mount
from tests._upstream_jobs import (
    LAUNCH,
    TRAINING,
    kill_mid_checkpoint_then_resume,
    lines_of_text,
    summary,
    unmet,
)


def _sft_command(where: Path) -> list[str]:
    hf_objects.tiny_model().save_pretrained(where / "model")
    hf_objects.fast_tokenizer().save_pretrained(where / "model")
    (where / "data").mkdir()
    rows = [json.dumps({"text": line}) for line in lines_of_text()]
    (where / "data" / "train.jsonl").write_text("\n".join(rows) + "\n")
    inputs = ["--model_name_or_path", os.fspath(where / "model"), "--dataset_name", os.fspath(where / "data")]
    return [*LAUNCH, "-m", "trl.scripts.sft", *inputs, *TRAINING]


@pytest.mark.fuse_opts(hazard_timeout=0.5)
def test_trl_sft_resumes_from_a_committed_checkpoint_with_safeio_patch(
    nfslike_mount: Mount, shared_dir: Path
) -> None:
    # Not a skip: the test extra pins trl, and a missing dependency must not pass for a green run.
    assert importlib.util.find_spec("trl") is not None, "trl is not installed: pip install -e '.[test]'"
    sides = kill_mid_checkpoint_then_resume(nfslike_mount, shared_dir, _sft_command(shared_dir))
    print(summary(sides, nfslike_mount))
    assert unmet(sides, nfslike_mount) == []
