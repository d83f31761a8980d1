"""The HF Trainer keeps its own semantics under safeio (issue 32): real Trainers on 2 gloo ranks, plain and
through safeio (the mixin, ``patch_trainer`` as ``SAFEIO_PATCH`` installs it) side by side.

safeio changes where and how the checkpoint files are written and committed, and which checkpoint
``resume_from_checkpoint=True`` may choose; step names, saving a step that exists (a rollback, a re-run
into the same output_dir), retention, best-model tracking, the just-in-time checkpoint, and the messages
and exception types code matches on stay the Trainer's — and the output directory lists what the plain
Trainer's lists.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest

import safeio
from safeio.testing import hf_objects
from safeio.testing.ranks import run_ranks
from tests._bounds import RUN


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _trainer(output_dir: str, *, mixin: bool, scores: list[float] | None = None, **options: Any) -> Any:
    """A tiny Llama Trainer on 2 gloo ranks; ``scores``: what each evaluation reports as its loss."""
    from transformers import Trainer, TrainingArguments

    from safeio.integrations.transformers import CheckpointsTrainerMixin

    evaluations = iter(scores or [])

    class Scripted(*((CheckpointsTrainerMixin,) if mixin else ()), Trainer):  # type: ignore[misc]
        def _evaluate(self, trial: Any, ignore_keys_for_eval: Any, skip_scheduler: bool = False) -> Any:
            metrics = {"eval_loss": next(evaluations), "epoch": self.state.epoch}
            self.log(metrics)
            return metrics

    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        ddp_backend="gloo",
        disable_tqdm=True,
        **options,
    )
    return Scripted(
        model=hf_objects.tiny_model(),
        args=args,
        train_dataset=hf_objects.tiny_lm_dataset(8),
        eval_dataset=hf_objects.tiny_lm_dataset(4),
        processing_class=hf_objects.fast_tokenizer(),
    )


def _listing(output_dir: str) -> list[str] | None:
    """The output directory as the process that saves sees it when train() returns (rank 0: the plain
    Trainer's rotation, like safeio's retention, is that process's business, and no other rank waits for
    it)."""
    import torch.distributed as dist

    return sorted(os.listdir(output_dir)) if dist.get_rank() == 0 else None


def _rollback_and_rerun(rank: int, world: int, output: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    _trainer(output, mixin=True, max_steps=4, save_steps=1).train()
    seen["first run"] = _listing(output)
    # A rollback: resume from checkpoint-1 (a loss spike later), train through steps 2 and 3 again.
    rollback = _trainer(output, mixin=True, max_steps=3, save_steps=1)
    rollback.train(resume_from_checkpoint=os.path.join(output, "checkpoint-1"))
    latest = rollback.safeio_checkpoints().latest()
    seen["latest after the rollback"] = os.path.basename(latest.path) if latest else None
    seen["after the rollback"] = _listing(output)
    # A re-run of the script from scratch into the same output_dir.
    _trainer(output, mixin=True, max_steps=2, save_steps=1).train()
    seen["after the re-run"] = _listing(output)
    return seen


def test_a_trainer_saving_steps_already_in_its_output_dir_commits_them_anew(shared_dir: Any) -> None:
    """A rollback (resume from an older checkpoint-N) and a re-run into the same output_dir save steps
    that are committed already. Before, the first of them raised TargetExistsError mid-training, after
    the steps in between were computed; the plain Trainer writes over them. Now each is committed anew
    (the old version whole until then), the newest commit is the latest, and the output directory lists
    the checkpoints and nothing else, as the plain Trainer's does."""
    output = str(shared_dir / "run")
    results = run_ranks(_rollback_and_rerun, 2, output, timeout=RUN)
    steps = [f"checkpoint-{n}" for n in (1, 2, 3, 4)]
    seen = results[0].value
    assert seen["first run"] == steps, seen
    assert seen["after the rollback"] == steps and seen["after the re-run"] == steps, seen
    # Step 3 was committed last: resuming goes on from the branch the job took, not from 4.
    assert [r.value["latest after the rollback"] for r in results] == ["checkpoint-3"] * 2
    assert sorted(os.listdir(output)) == steps  # and once every rank is done
    for name in steps:
        assert safeio.verify(os.path.join(output, name)) == [], name


def _best_model(rank: int, world: int, plain_dir: str, patched_dir: str) -> dict[str, Any]:
    from safeio.integrations.transformers import patch_trainer

    # Evaluated at the end of each epoch, saved at every step: the best checkpoint (the first epoch's,
    # step 2) was saved before the evaluation that made it best; save_total_limit=2 keeps it beside the
    # newest one (not the two newest) only if the Trainer knows it is the best.
    options: dict[str, Any] = {
        "num_train_epochs": 3,
        "eval_strategy": "epoch",
        "save_strategy": "steps",
        "save_steps": 1,
        "save_total_limit": 2,
        "metric_for_best_model": "loss",
        "greater_is_better": False,
    }
    seen: dict[str, Any] = {}
    for name, output in (("plain", plain_dir), ("patched", patched_dir)):
        if name == "patched":
            patch = patch_trainer().install()
        try:
            trainer = _trainer(output, mixin=False, scores=[0.1, 0.5, 0.9], **options)
            trainer.train()
        finally:
            if name == "patched":
                patch.uninstall()
        best = trainer.state.best_model_checkpoint
        seen[name] = {
            "best_model_checkpoint": os.path.relpath(best, output) if best else None,
            "best_global_step": trainer.state.best_global_step,
            "listing": _listing(output),
        }
    return seen


def test_the_best_checkpoint_and_retention_are_the_trainers(shared_dir: Any) -> None:
    """Before, the Trainer's output directory was a view holding the current step alone: it never found
    the best checkpoint saved before the evaluation that made it best (best_model_checkpoint stayed
    None), and retention deleted that checkpoint, which the plain Trainer keeps."""
    results = run_ranks(_best_model, 2, str(shared_dir / "plain"), str(shared_dir / "patched"), timeout=RUN)
    for rank, result in enumerate(results):
        plain, patched = result.value["plain"], result.value["patched"]
        assert plain == {
            "best_model_checkpoint": "checkpoint-2",
            "best_global_step": 2,
            "listing": ["checkpoint-2", "checkpoint-6"] if rank == 0 else None,
        }, plain
        assert patched == plain
    assert safeio.verify(shared_dir / "patched" / "checkpoint-2") == []


def _jit_and_no_checkpoint(rank: int, world: int, output: str, empty: str) -> dict[str, Any]:
    from transformers import TrainerCallback
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback

    records = _Warnings()
    logging.getLogger("safeio").addHandler(records)
    trainer = _trainer(output, mixin=True, max_steps=5, save_strategy="no", enable_jit_checkpoint=True)
    (jit,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, JITCheckpointCallback)]

    class Preempted(TrainerCallback):
        """SIGTERM's timer has fired on every rank (the JIT manager's own flag) after step 2."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 2:
                jit.jit_manager.is_checkpoint_requested = True

    trainer.add_callback(Preempted())
    trainer.train()
    seen: dict[str, Any] = {"listing": _listing(output), "step": trainer.state.global_step}
    seen["in checkpoint-2"] = sorted(os.listdir(os.path.join(output, "checkpoint-2")))
    seen["warnings"] = records.messages
    try:
        _trainer(empty, mixin=True, max_steps=1).train(resume_from_checkpoint=True)
    except Exception as exc:  # what code around train() catches and matches
        seen["no checkpoint"] = (isinstance(exc, ValueError), str(exc))
    return seen


@pytest.mark.parametrize("where", ["local", "nfslike"])
def test_the_just_in_time_checkpoint_and_the_message_of_no_checkpoint_are_the_trainers(
    where: str, shared_dir: Any, request: pytest.FixtureRequest
) -> None:
    """transformers' just-in-time checkpoint makes checkpoint-N holding only checkpoint-is-incomplete.txt,
    saves, and removes it: before, safeio moved that directory aside as a torn checkpoint of the plain
    Trainer's (incomplete-checkpoint-N.<time> left beside every such save, with a WARNING). And
    train(resume_from_checkpoint=True) with no checkpoint said safeio's words, not the Trainer's. On the
    NFS-like mount, which refuses renameat2's exchange as NFS does, the placeholder is replaced without
    a word too."""
    base = shared_dir if where == "local" else request.getfixturevalue("nfslike_mount").path
    output, empty = str(base / "run"), str(base / "empty")
    results = run_ranks(_jit_and_no_checkpoint, 2, output, empty, timeout=RUN)
    for rank, result in enumerate(results):
        seen = result.value
        assert seen["listing"] == (["checkpoint-2"] if rank == 0 else None) and seen["step"] == 2, seen
        assert "checkpoint-is-incomplete.txt" not in seen["in checkpoint-2"], seen
        assert seen["warnings"] == [], seen
        is_value_error, message = seen["no checkpoint"]
        assert is_value_error and f"No valid checkpoint found in output directory ({empty})" in message, seen
    assert safeio.verify(os.path.join(output, "checkpoint-2")) == []
