"""The HF Trainer with ``CheckpointsTrainerMixin``: real Trainers on gloo ranks (launched the way torchrun
launches them) on the NFS-like mount. Every ``checkpoint-N`` committed once with every rank's files,
rotation after the commit, resume only from a committed checkpoint, a rank killed mid-save."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import safeio
from safeio.testing import hf_objects
from safeio.testing.nfslike import Mount
from safeio.testing.ranks import run_ranks
from tests._bounds import PATIENT, RUN
from tests.test_checkpoints import _every_rank_past_dcp


def _run(
    rank: int,
    world: int,
    output_dir: str,
    max_steps: int,
    resume: bool,
    die_at: int | None,
    plain: bool = False,
) -> Any:
    import logging

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from safeio.integrations.transformers import CheckpointsTrainerMixin

    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("safeio").addHandler(Collect(logging.WARNING))

    bases = (Trainer,) if plain else (CheckpointsTrainerMixin, Trainer)

    class MyTrainer(*bases):  # type: ignore[misc]
        def _save_rng_state(self, output_dir: str) -> None:
            super()._save_rng_state(output_dir)
            if die_at is not None and rank == 1 and self.state.global_step == die_at:
                os._exit(9)  # killed after writing part of its checkpoint, before reporting it

    class Started(TrainerCallback):
        at: int | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            Started.at = state.global_step

    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=max_steps,
        save_steps=1,
        save_total_limit=2,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        ddp_backend="gloo",
    )
    safeio_options = {} if plain else {"safeio_timeout": 2.5 if die_at is not None else PATIENT}
    trainer = MyTrainer(
        model=hf_objects.tiny_model(),
        args=args,
        train_dataset=hf_objects.tiny_lm_dataset(64),
        processing_class=hf_objects.fast_tokenizer(),
        callbacks=[Started()],
        **safeio_options,
    )
    error = None
    try:
        trainer.train(resume_from_checkpoint=True if resume else None)
    except safeio.CheckpointError as exc:
        error = str(exc)
    _every_rank_past_dcp(rank, world, "end", dead=(1,) if die_at is not None else ())
    return {"started_at": Started.at, "step": trainer.state.global_step, "error": error, "warnings": warnings}


def _checkpoints(output_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(output_dir) if n.startswith("checkpoint-"))


def test_trainer_checkpoints_are_committed_rotated_and_resumed(nfslike_mount: Mount) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from safeio.integrations.transformers import get_last_checkpoint

    output = str(nfslike_mount.path / "run")
    results = run_ranks(_run, 2, output, 3, False, None, timeout=RUN)
    assert [r.value["step"] for r in results] == [3, 3]
    assert _checkpoints(output) == ["checkpoint-2", "checkpoint-3"]  # save_total_limit=2, after commits
    newest = Path(output, "checkpoint-3")
    files = set(os.listdir(newest))
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json", "tokenizer.json"} <= files, files
    assert safeio.verify(newest) == []  # every rank's files listed by the commit marker
    assert [n for n in os.listdir(output) if ".safeio-stage" in n] == []
    assert nfslike_mount.hazards() == []
    AutoModelForCausalLM.from_pretrained(newest)
    AutoTokenizer.from_pretrained(newest)
    # A half-written checkpoint-4 (a crash without safeio) is never resumed from.
    os.mkdir(Path(output, "checkpoint-4"))
    Path(output, "checkpoint-4", "model.safetensors").write_bytes(b"torn")
    assert get_last_checkpoint(output) == str(newest)
    shutil.rmtree(Path(output, "checkpoint-4"))  # safeio never overwrites what it did not write
    results = run_ranks(_run, 2, output, 5, True, None, timeout=RUN)
    assert [(r.value["started_at"], r.value["step"]) for r in results] == [(3, 5), (3, 5)]


def test_a_rank_killed_during_a_trainer_save_leaves_the_previous_checkpoint(shared_dir: Path) -> None:
    output = str(shared_dir / "run")
    results = run_ranks(_run, 2, output, 4, False, 3, timeout=RUN, check=False)
    assert results[1].error is not None and results[0].error is None, results[0].traceback
    assert "rank 1 never reported" in results[0].value["error"], results[0].value
    assert _checkpoints(output) == ["checkpoint-1", "checkpoint-2"]  # nothing of step 3 committed
    results = run_ranks(_run, 2, output, 4, True, None, timeout=RUN)
    assert [(r.value["started_at"], r.value["step"]) for r in results] == [(2, 4), (2, 4)]


def test_safe_trainer_and_an_unsupported_trainer_shape() -> None:
    import pytest
    from transformers import Trainer

    from safeio.integrations import transformers as safe_transformers
    from safeio.integrations.transformers import CheckpointsTrainerMixin, SafeTrainer

    assert issubclass(SafeTrainer, Trainer) and issubclass(SafeTrainer, CheckpointsTrainerMixin)
    assert safe_transformers.SafeTrainer is SafeTrainer  # one class, built once

    class Renamed(CheckpointsTrainerMixin, Trainer):
        def _save_checkpoint(self, trainer_model: Any, trial: Any) -> None:  # type: ignore[override]
            raise AssertionError("never reached")

    with pytest.raises(safeio.UnsupportedSaveError, match="not the \\(model, trial\\) method"):
        Renamed()


def test_patch_trainer_installs_and_uninstalls_in_process() -> None:
    import transformers.trainer as trainer_module
    from transformers import Trainer, trainer_utils

    from safeio.integrations import transformers as safe_transformers
    from safeio.integrations.transformers import CheckpointsTrainerMixin, patch_trainer

    before = (vars(Trainer)["_save_checkpoint"], vars(Trainer)["train"], trainer_utils.get_last_checkpoint)
    assert trainer_module.get_last_checkpoint is before[2]
    with patch_trainer():
        with patch_trainer():  # installs nest; the outer one still holds the patch after this one
            pass
        assert vars(Trainer)["_save_checkpoint"].__wrapped__ is before[0]
        assert vars(Trainer)["train"].__wrapped__ is before[1]
        # Wherever it was imported by name: transformers.trainer's namespace, and a script's afterwards.
        assert trainer_utils.get_last_checkpoint is safe_transformers.get_last_checkpoint
        assert trainer_module.get_last_checkpoint is safe_transformers.get_last_checkpoint
        from transformers.trainer_utils import get_last_checkpoint

        assert get_last_checkpoint is safe_transformers.get_last_checkpoint

        # A mixin instance is the mixin's business: the patch calls the Trainer's own method, unstaged.
        class Stepped(CheckpointsTrainerMixin, Trainer):
            def __init__(self) -> None:  # no model, no arguments: only _save_checkpoint is called
                pass

        calls: list[str] = []
        wrapper = safe_transformers._patched_save_checkpoint(lambda self, model, trial: calls.append("own"))
        wrapper(Stepped(), None, None)
        assert calls == ["own"]
    after = (vars(Trainer)["_save_checkpoint"], vars(Trainer)["train"], trainer_utils.get_last_checkpoint)
    assert after == before and trainer_module.get_last_checkpoint is before[2]


def test_checkpoints_written_without_safeio_are_never_silently_ignored(
    nfslike_mount: Mount, caplog: Any
) -> None:
    from safeio.integrations.transformers import get_last_checkpoint

    output = str(nfslike_mount.path / "run")
    # The plain Trainer (no safeio) saved checkpoint-2 and checkpoint-3 (save_total_limit=2).
    run_ranks(_run, 2, output, 3, False, None, True, timeout=RUN)
    assert _checkpoints(output) == ["checkpoint-2", "checkpoint-3"]
    # Restarted with the mixin: it resumes from the plain Trainer's last checkpoint, saying so.
    results = run_ranks(_run, 2, output, 4, True, None, timeout=RUN)
    assert [(r.value["started_at"], r.value["step"]) for r in results] == [(3, 4), (3, 4)]
    plain = os.path.join(output, "checkpoint-3")
    assert [w for w in results[0].value["warnings"] if plain in w and "safeio did not commit" in w], results
    assert safeio.verify(Path(output, "checkpoint-4")) == []  # its own next one is committed
    # A committed checkpoint wins over a plain one at a lower (or equal) step, without a word.
    caplog.set_level("WARNING", logger="safeio")
    assert get_last_checkpoint(output) == os.path.join(output, "checkpoint-4")
    assert not caplog.records
    # A plain checkpoint torn before the Trainer's marker (trainer_state.json) is skipped, named.
    torn = Path(output, "checkpoint-5")
    shutil.copytree(Path(output, "checkpoint-3"), torn)
    (torn / "trainer_state.json").unlink()
    assert get_last_checkpoint(output) == os.path.join(output, "checkpoint-4")
    assert [
        r.getMessage()
        for r in caplog.records
        if str(torn) in r.getMessage() and "incomplete" in r.getMessage()
    ]
    # A complete plain one above every commit is the answer, with its warning.
    caplog.clear()
    shutil.copytree(Path(output, "checkpoint-3"), Path(output, "checkpoint-6"))
    assert get_last_checkpoint(output) == os.path.join(output, "checkpoint-6")
    assert "checkpoint-6, which safeio did not commit" in caplog.text
    # Another user's plain checkpoint, however complete and high, is never resumed from.
    foreign = Path(output, "checkpoint-7")
    shutil.copytree(Path(output, "checkpoint-3"), foreign)
    for path in [foreign, *foreign.rglob("*")]:
        os.lchown(path, 4242, 4242)
    assert get_last_checkpoint(output) == os.path.join(output, "checkpoint-6")


def test_patch_trainer_refuses_an_unsupported_trainer_and_leaves_nothing(monkeypatch: Any) -> None:
    import pytest
    from transformers import Trainer, trainer_utils

    from safeio.integrations.transformers import patch_trainer

    def _save_checkpoint(self: Any, trainer_model: Any, trial: Any) -> None:
        raise AssertionError("never reached")

    monkeypatch.setattr(Trainer, "_save_checkpoint", _save_checkpoint)
    lookup = trainer_utils.get_last_checkpoint
    with pytest.raises(safeio.UnsupportedSaveError, match="not the \\(model, trial\\) method"):
        patch_trainer().install()
    assert (
        vars(Trainer)["_save_checkpoint"] is _save_checkpoint and trainer_utils.get_last_checkpoint is lookup
    )
