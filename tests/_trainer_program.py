"""An unmodified HF Trainer program: nothing here mentions safeio, as in a script users run but do not edit
(run_clm, TRL's CLI). Launched as its users launch it:

    torchrun --nproc_per_node 2 -m tests._trainer_program OUTPUT_DIR REPORT_DIR [--kill-at N] [--resume last|true]

A tiny Llama built in code, a few dozen synthetic samples, ``save_steps=2``, ``save_total_limit=2``,
gloo on CPU. ``--kill-at N``: rank 0 is SIGKILLed in the middle of writing ``checkpoint-N`` (its model and
tokenizer written, not yet its optimizer nor ``trainer_state.json``): an OOM kill or a preemption at that
moment. ``--resume last``: the way run_clm resumes, ``get_last_checkpoint(output_dir)`` passed to
``train``; ``--resume true``: ``train(resume_from_checkpoint=True)``. Each rank writes
``REPORT_DIR/rank<r>.json``: the step training started from, the last step, what ``get_last_checkpoint``
answered, and ``SAFEIO_PATCH_ACTIVE`` (set by the start-up hook when the variable is set).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint  # after `import transformers`, as run_clm


class Samples(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = torch.tensor([(i + j) % 60 + 4 for j in range(8)])
        return {"input_ids": ids, "labels": ids}


class Started(TrainerCallback):
    at: int | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        Started.at = state.global_step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("report_dir")
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--resume", choices=["last", "true"])
    parser.add_argument("--max-steps", type=int, default=6)
    options = parser.parse_args()

    class Trainer(transformers.Trainer):  # the program's own subclass, as TRL's SFTTrainer is one
        def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
            if self.state.global_step == options.kill_at and self.args.process_index == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            super()._save_optimizer_and_scheduler(output_dir)

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    args = TrainingArguments(
        output_dir=options.output_dir,
        max_steps=options.max_steps,
        save_steps=2,
        save_total_limit=2,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        ddp_backend="gloo",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Samples(), callbacks=[Started()])
    last = get_last_checkpoint(options.output_dir) if options.resume else None
    resume: str | bool | None = {"last": last, "true": True, None: None}[options.resume]
    trainer.train(resume_from_checkpoint=resume)
    report = {
        "started_at": Started.at,
        "step": trainer.state.global_step,
        "last": last,
        "patched": os.environ.get("SAFEIO_PATCH_ACTIVE", ""),
    }
    with open(os.path.join(options.report_dir, f"rank{args.process_index}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
