"""A user-style HF Trainer loop that looks for a checkpoint on some ranks only, as run_clm does:
``get_last_checkpoint(out) if os.path.isdir(out) else None``. Nothing here mentions safeio: it runs under
``SAFEIO_PATCH=1`` as its users run it (issue 32, item 0).

Ranks make different numbers of these readings when the output directory appears between their looks (one
rank creates it; Ray Train's workers start at different moments): seen stalling a Ray Train job at its
first checkpoint in 3 of 7 runs. Here that order is forced, so that every run takes it: rank 0 looks
before the directory exists (then makes it), every other rank after.

    torchrun --nproc_per_node 2 -m tests._diverging_reads_program OUTPUT_DIR REPORT_DIR

``train(output_dir, report_dir)`` is the training function itself (Ray Train's ``train_loop_per_worker``,
see ``tests/_ray_trainer_job.py``). Each rank writes ``REPORT_DIR/rank<r>.json``: what it read, the step it
reached, the checkpoints in the output directory at the end.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import transformers
from transformers import TrainingArguments
from transformers.trainer_utils import get_last_checkpoint  # after `import transformers`, as run_clm

from safeio.testing import hf_objects


class Samples(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = torch.tensor([(i + j) % 60 + 4 for j in range(8)])
        return {"input_ids": ids, "labels": ids}


def _looked_for_a_checkpoint(output_dir: str) -> str | None:
    """run_clm's reading, in the order that makes the ranks' readings differ."""
    rank = dist.get_rank()
    last = None
    if rank == 0:
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        os.makedirs(output_dir, exist_ok=True)  # the main process makes it (logs, arguments)
    dist.barrier()
    if rank != 0:
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    return last


def train(output_dir: str, report_dir: str) -> None:
    if not dist.is_initialized():  # torchrun; Ray Train has made the process group already
        dist.init_process_group("gloo")
    last = _looked_for_a_checkpoint(output_dir)
    model = hf_objects.tiny_model(seed=0)
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=4,
        save_steps=2,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        ddp_backend="gloo",
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Samples())
    trainer.train(resume_from_checkpoint=last)
    report = {
        "rank": dist.get_rank(),
        "last": last,
        "step": trainer.state.global_step,
        "checkpoints": sorted(n for n in os.listdir(output_dir) if n.startswith("checkpoint-")),
        "patched": os.environ.get("SAFEIO_PATCH_ACTIVE", ""),
    }
    with open(os.path.join(report_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[2])
