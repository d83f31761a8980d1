"""An unmodified Lightning program under ``ddp_spawn`` (see tests/_spawned_workers.py): every rank saves
the tokenizer in ``on_train_end``, as a callback that saves it with each checkpoint does."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests._spawned_workers import _report, save_until_a_failure


class Model(L.LightningModule):
    def __init__(self, target: str, out: str) -> None:
        super().__init__()
        self.target, self.out = target, out
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self) -> None:
        strategy = self.trainer.strategy

        def failed_anywhere(failed: bool) -> bool:
            return bool(strategy.reduce(torch.tensor(float(failed)), reduce_op="sum") > 0)

        errors = save_until_a_failure(strategy.barrier, failed_anywhere, self.target)  # every rank
        _report(self.out, self.global_rank, errors)


def run_lightning(target: str, out: str, world: int) -> None:
    data = DataLoader(TensorDataset(torch.ones(8, 4)), batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp_spawn",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(target, out), data)
