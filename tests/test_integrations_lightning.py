"""Lightning with ``SafeCheckpointIO`` and ``SafeModelCheckpoint``: real Trainers on gloo ranks (launched
as torchrun launches them: the environment set, the process group up) on the NFS-like mount."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from safeio import InvalidTargetError
from safeio.testing.nfslike import Mount
from safeio.testing.ranks import run_ranks
from tests._bounds import RUN

pytest.importorskip("lightning")


class _DieWhilePickled:
    """Put into a checkpoint: ``torch.save`` is killed in the middle of writing it (a SIGKILL mid-save)."""

    def __reduce__(self) -> Any:
        os._exit(9)


def _fit(
    rank: int,
    world: int,
    root: str,
    max_steps: int,
    resume: bool,
    die_at: int | None,
    use_async: bool,
    callback: str = "safe",
    callback_options: dict[str, Any] | None = None,
) -> Any:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from torch.utils.data import DataLoader, TensorDataset

    from safeio.integrations.lightning import SafeCheckpointIO, SafeModelCheckpoint

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)
            self.started_at: int | None = None
            self.best_at_start: str | None = None

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.layer(batch[0]).pow(2).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def on_train_start(self) -> None:
            self.started_at = self.global_step
            self.best_at_start = self.trainer.checkpoint_callback.best_model_path  # restored by then

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            if die_at is not None and self.global_step == die_at:
                checkpoint["poison"] = _DieWhilePickled()

    io = SafeCheckpointIO()
    model = Model()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        max_steps=max_steps,
        plugins=[AsyncCheckpointIO(io) if use_async else io],
        callbacks=[
            (SafeModelCheckpoint if callback == "safe" else ModelCheckpoint)(
                dirpath=root,
                save_last="link",
                save_top_k=2,
                monitor="step",
                mode="max",
                every_n_train_steps=1,
                **(callback_options or {}),
            )
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(torch.ones(64, 4)), batch_size=2)
    trainer.fit(model, data, ckpt_path="last" if resume else None)
    # With AsyncCheckpointIO the last save may still be in flight when a rank that writes nothing returns
    # from fit: rank 0's teardown waits for it, so the ranks meet after that before reading (without this
    # rank 1 met a last.ckpt naming a file not written yet, under load; Lightning's own link is the same).
    trainer.strategy.barrier()
    last = os.path.join(root, "last.ckpt")
    saved = torch.load(last, weights_only=False)  # every rank loads what rank 0 saved for it
    same = all(torch.equal(saved["state_dict"][k], v) for k, v in model.state_dict().items())
    return {
        "started_at": model.started_at,
        "best_at_start": os.path.basename(model.best_at_start or ""),
        "step": trainer.global_step,
        "last_step": saved["global_step"],
        "same": same,
        "link": os.readlink(last) if os.path.islink(last) else None,
    }


def test_ddp_checkpoints_are_atomic_and_resume(nfslike_mount: Mount) -> None:
    root = str(nfslike_mount.path / "ckpt")
    results = run_ranks(_fit, 2, root, 4, False, None, True, timeout=RUN)
    for r in results:
        assert r.value["step"] == 4 and r.value["last_step"] == 4 and r.value["same"], r
        assert r.value["link"] == "epoch=0-step=4.ckpt", r  # a relative link, replaced atomically
    names = sorted(os.listdir(root))
    assert [n for n in names if n.endswith(".ckpt")] == [
        "epoch=0-step=3.ckpt",
        "epoch=0-step=4.ckpt",
        "last.ckpt",
    ]
    assert [n for n in names if ".safeio-" in n] == []  # no temporary file, no removal left behind
    assert nfslike_mount.hazards() == []
    # Resume from last.ckpt on both ranks.
    results = run_ranks(_fit, 2, root, 6, True, None, True, timeout=RUN)
    assert [(r.value["started_at"], r.value["step"]) for r in results] == [(4, 6), (4, 6)]


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_to_resume(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    died = run_ranks(_fit, 1, root, 5, False, 3, False, timeout=RUN, check=False)
    assert died[0].error is not None  # killed inside torch.save of step 3's checkpoint
    names = sorted(os.listdir(root))
    assert "epoch=0-step=3.ckpt" not in names  # never a torn file under the final name
    assert os.readlink(os.path.join(root, "last.ckpt")) == "epoch=0-step=2.ckpt"
    left = [n for n in names if n.startswith(".epoch=0-step=3.ckpt.safeio-tmp-")]
    assert len(left) == 1, names  # the killed save's temporary file
    resumed = run_ranks(_fit, 1, root, 4, True, None, False, timeout=RUN)
    assert resumed[0].value["started_at"] == 2 and resumed[0].value["step"] == 4
    # The next save in that directory (of another checkpoint) removed it: its writer is gone.
    assert [n for n in os.listdir(root) if ".safeio-" in n] == []


@pytest.mark.parametrize(("first", "then"), [("plain", "safe"), ("safe", "plain"), ("plain", "plain")])
def test_resume_keeps_the_best_checkpoint_across_the_two_callbacks(
    tmp_path: Path, first: str, then: str
) -> None:
    """A run ModelCheckpoint wrote resumes under SafeModelCheckpoint with its best path, and back; the
    plain-to-plain pair is Lightning's own behaviour, which the drop-in must match."""
    root = str(tmp_path / "ckpt")
    run_ranks(_fit, 1, root, 3, False, None, False, first, timeout=RUN)
    resumed = run_ranks(_fit, 1, root, 4, True, None, False, then, timeout=RUN)
    assert resumed[0].value["started_at"] == 3
    assert resumed[0].value["best_at_start"] == "epoch=0-step=3.ckpt", resumed[0].value


def test_a_directory_at_the_link_path_is_refused_by_name(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    (root / "last.ckpt").mkdir(parents=True)
    (root / "last.ckpt" / "kept").write_text("someone's file")
    # Without the version counter, Lightning links last.ckpt itself instead of making last-v1.ckpt.
    options = {"enable_version_counter": False}
    failed = run_ranks(_fit, 1, str(root), 2, False, None, False, "safe", options, timeout=RUN, check=False)
    error = failed[0].error
    assert isinstance(error, InvalidTargetError) and str(root / "last.ckpt") in str(error), failed
    assert (root / "last.ckpt" / "kept").read_text() == "someone's file"
    assert [n for n in os.listdir(root) if ".safeio-" in n] == []  # the new link was not left behind


@pytest.mark.fuse_opts(no_symlinks=True)
@pytest.mark.parametrize("callback", ["plain", "safe"])
def test_a_share_without_symlinks_gets_last_ckpt_as_a_copy(nfslike_mount: Mount, callback: str) -> None:
    """Where symbolic links are refused (SMB/CIFS, FAT; here the mount's ``no_symlinks``), ModelCheckpoint
    copies the checkpoint to last.ckpt (the plain case: Lightning's behaviour the drop-in must match), and
    so does SafeModelCheckpoint, atomically: Lightning's own test_model_checkpoint_link_checkpoint checks
    this after its directory case, which the drop-in refuses, so it never got that far."""
    root = str(nfslike_mount.path / "ckpt")
    [result] = run_ranks(_fit, 1, root, 3, False, None, False, callback, timeout=RUN)
    assert result.value["link"] is None and result.value["same"] and result.value["last_step"] == 3
    assert [n for n in os.listdir(root) if ".safeio-" in n] == []


def test_the_copy_fallback_never_reads_a_link_planted_at_the_checkpoints_name(tmp_path: Path) -> None:
    # Where links are refused, last.ckpt is a copy of the checkpoint just saved. A link planted under the
    # checkpoint's name in the shared directory must not make that copy of a file it names elsewhere.
    from safeio.integrations.lightning import _copy_into_place

    secret = tmp_path / "home" / "secret"
    secret.parent.mkdir()
    secret.write_text("another user's file")
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "epoch=0-step=2.ckpt").symlink_to(secret)
    with pytest.raises(InvalidTargetError, match=r"epoch=0-step=2\.ckpt"):
        _copy_into_place(str(root / "epoch=0-step=2.ckpt"), str(root / "last.ckpt"))
    assert sorted(os.listdir(root)) == ["epoch=0-step=2.ckpt"]  # no last.ckpt, no temporary file

    (root / "epoch=0-step=2.ckpt").unlink()
    (root / "epoch=0-step=2.ckpt").write_bytes(b"weights")
    _copy_into_place(str(root / "epoch=0-step=2.ckpt"), str(root / "last.ckpt"))
    assert (root / "last.ckpt").read_bytes() == b"weights" and not (root / "last.ckpt").is_symlink()
