"""``SAFEIO_PATCH=accelerate``'s patch of ``Accelerator.save_state`` / ``load_state`` on 2 gloo ranks on
the NFS-like mount: a numbered directory committed as a step of its parent, any other written plain with
one WARNING, a torn numbered directory refused on every rank naming it, a complete one written without
safeio loaded with a WARNING, automatic naming through the adapter, and a save_state made inside a safeio
stage (the adapter's, the Trainer patch's) left to accelerate: nothing staged twice."""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import pytest

import safeio
from safeio.testing.nfslike import Mount
from safeio.testing.ranks import run_ranks

pytest.importorskip("accelerate")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _patched_job(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from safeio.integrations import accelerate as safe_accelerate
    from safeio.integrations._accelerate_patch import patch_accelerator

    records = _Records()
    logging.getLogger("safeio").addHandler(records)
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=f"{root}/project"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    model, _optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    seen: dict[str, Any] = {}
    with patch_accelerator():
        seen["saved to"] = accelerator.save_state(f"{root}/epoch_0")
        accelerator.save_state(f"{root}/final")
        accelerator.save_state(f"{root}/final")  # one WARNING per directory
        if rank == 0:  # what a rank killed mid-save leaves, and a complete one written without safeio
            os.makedirs(f"{root}/epoch_1")
            shutil.copy(f"{root}/epoch_0/model.safetensors", f"{root}/epoch_1/")
            shutil.copytree(f"{root}/epoch_0", f"{root}/epoch_3")
            os.remove(f"{root}/epoch_3/.safeio-manifest.json")
        accelerator.wait_for_everyone()
        for name in ("epoch_1", "epoch_2"):
            try:
                accelerator.load_state(f"{root}/{name}")
            except safeio.InvalidTargetError as exc:
                seen[name] = (type(exc).__name__, str(exc), exc.path)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        accelerator.load_state(f"{root}/epoch_0")
        seen["loaded epoch_0"] = all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
        accelerator.load_state(f"{root}/epoch_3")
        # Inside a save of the adapter (its own accelerator.save_state into the stage): one commit.
        ckpts = safeio.Checkpoints(f"{root}/adapter", name="checkpoint_{step}")
        safe_accelerate.save_state(accelerator, ckpts, step=5)
        # Automatic naming: the adapter's default layout, and load_state() its latest.
        accelerator.project_configuration.automatic_checkpoint_naming = True
        accelerator.save_state()
        accelerator.load_state()
    seen["warnings"] = records.messages
    return seen


def test_the_patch_commits_numbered_directories_and_refuses_torn_ones(nfslike_mount: Mount) -> None:
    root = nfslike_mount.path / "run"
    results = run_ranks(_patched_job, 2, os.fspath(root), timeout=300)
    for rank, result in enumerate(results):
        seen = result.value
        assert seen["saved to"] == os.fspath(root / "epoch_0")
        # Refused on every rank, naming the directory: torn (rank 0 killed in it) and missing.
        for name in ("epoch_1", "epoch_2"):
            kind, message, path = seen[name]
            assert kind == "InvalidTargetError" and path == os.fspath(root / name), seen[name]
            assert "not a checkpoint safeio committed" in message and "committed steps: 0" in message, message
        assert seen["loaded epoch_0"]
        unprotected = [m for m in seen["warnings"] if "is not protected by safeio" in m]
        assert len(unprotected) == 1 and os.fspath(root / "final") in unprotected[0], seen["warnings"]
        # Judged by the writer for every rank (Checkpoints.at): the writer says so.
        said = any(f"loading {root / 'epoch_3'}, which safeio did not commit" in m for m in seen["warnings"])
        assert said == (rank == 0), seen["warnings"]
    assert safeio.Checkpoints(root, name="epoch_{step}").committed() == [(0, "epoch_0")]
    assert safeio.verify(root / "epoch_0") == []
    assert ".safeio-manifest.json" not in os.listdir(root / "final")
    # The adapter's own save: checkpoint_5 committed once, nothing nested in it.
    assert safeio.Checkpoints(root / "adapter", name="checkpoint_{step}").committed() == [(5, "checkpoint_5")]
    assert not [n for n in os.listdir(root / "adapter" / "checkpoint_5") if n.startswith("checkpoint")]
    # Numbered by accelerate's own counter: every save_state before it counted (epoch_0, final twice, 5).
    automatic = root / "project" / "checkpoints"
    assert safeio.Checkpoints(automatic, name="checkpoint_{step}").committed() == [(4, "checkpoint_4")]
    assert nfslike_mount.hazards() == []
