"""transformers: the Trainer's ``checkpoint-N`` directories staged and committed once, rotated after
the commit by one rank, and found again only when committed.

``Trainer._save_checkpoint`` writes straight into ``output_dir/checkpoint-N`` from every rank (the model,
tokenizer and ``training_args.bin`` from process 0, ``rng_state_<rank>.pth`` from each, the optimizer
from process 0 or every rank when sharded), then deletes old checkpoints (``save_total_limit``); its
staging directory was reverted (transformers #36112), and ``get_last_checkpoint`` takes the highest
``checkpoint-N`` whether complete or not. A ``TrainerCallback`` runs after those writes and cannot
change them, so this is a mixin:

    class MyTrainer(CheckpointsTrainerMixin, Trainer): ...  # or SFTTrainer, any Trainer subclass
    trainer = MyTrainer(model=..., args=..., ...)  # or SafeTrainer from this module
    trainer.train(resume_from_checkpoint=True)     # resumes from the newest committed one

``_save_checkpoint`` runs inside ``safeio.Checkpoints.save``: the Trainer's own method still does the
writing (so its file set follows the installed transformers), with its output directory redirected to
the shared stage through a private view (``<tmp>/checkpoint-N``, a link to the stage); rotation is
``Checkpoints``' retention (``save_total_limit`` newest committed, the best model's checkpoint kept,
after the commit, by the writer). A patch of the private method was the alternative; a mixin is explicit
in the user's code and touches no class but theirs. It relies on ``_save_checkpoint(model, trial)`` and
``_get_output_dir(trial)``, checked when the trainer is built.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from safeio._checkpoints.checkpoints import Checkpoints
from safeio._coordination.group import Group
from safeio._errors import InvalidTargetError, UnsupportedSaveError
from safeio._promotion import active

__all__ = ["CheckpointsTrainerMixin", "get_last_checkpoint"]  # and SafeTrainer, built on first use

PREFIX = "checkpoint-{step}"


def get_last_checkpoint(folder: str | os.PathLike[str]) -> str | None:
    """``transformers.trainer_utils.get_last_checkpoint`` that returns only a committed checkpoint (its
    marker present, every listed file at its size), the most recent commit (after a rollback, not the
    highest number): a half-written ``checkpoint-N`` is never resumed.
    Each process reads the directory itself; inside a job prefer ``train(resume_from_checkpoint=True)``
    with the mixin, where every rank gets the writer's answer."""
    # A group of this process alone: latest() is then this process's own reading of the root.
    found = Checkpoints(folder, keep=None, name=PREFIX, group=Group()).latest()
    return os.path.join(os.fspath(folder), os.path.basename(found.path)) if found is not None else None


def _check_trainer(cls: type) -> None:
    save = getattr(cls, "_save_checkpoint", None)
    if save is None or not hasattr(cls, "_get_output_dir"):
        raise UnsupportedSaveError(
            f"{cls.__name__}: this transformers Trainer has no _save_checkpoint/_get_output_dir; "
            "safeio's CheckpointsTrainerMixin supports transformers 4.45 to 5.x",
            None,
        )
    params = list(inspect.signature(save).parameters)
    if params[:3] != ["self", "model", "trial"]:
        raise UnsupportedSaveError(
            f"{cls.__name__}._save_checkpoint{inspect.signature(save)} is not the (model, trial) method "
            "safeio's CheckpointsTrainerMixin wraps; this transformers version is not supported",
            None,
        )


class CheckpointsTrainerMixin:
    """Put before ``Trainer`` (or any subclass) in the bases. ``safeio_timeout`` bounds every wait of a
    checkpoint (default: safeio's timeout, ``SAFEIO_TIMEOUT``)."""

    args: Any
    state: Any
    _get_output_dir: Any

    def __init__(self, *args: Any, safeio_timeout: float | None = None, **kwargs: Any) -> None:
        _check_trainer(type(self))
        self.safeio_timeout = safeio_timeout
        super().__init__(*args, **kwargs)

    def safeio_checkpoints(self, run_dir: str | None = None) -> Checkpoints:
        """The ``Checkpoints`` of a run directory (default: ``args.output_dir``); retention keeps the
        newest ``save_total_limit`` committed checkpoints."""
        return Checkpoints(
            run_dir if run_dir is not None else self.args.output_dir,
            # transformers keeps every checkpoint for a limit of None or 0 or less
            keep=limit if (limit := self.args.save_total_limit) and limit > 0 else None,
            name=PREFIX,
            timeout=self.safeio_timeout,
        )

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            found = self.safeio_checkpoints().latest()  # collective: every rank gets the same answer
            if found is None:
                # transformers raises ValueError here; InvalidTargetError is one, and a SafeIOError
                raise InvalidTargetError(
                    f"No committed checkpoint found in output directory ({self.args.output_dir})",
                    self.args.output_dir,
                )
            resume_from_checkpoint = found.path
        return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        run_dir = self._get_output_dir(trial=trial)
        ckpts = self.safeio_checkpoints(run_dir)
        step = self.state.global_step
        folder = PREFIX.format(step=step)
        best = self.state.best_model_checkpoint
        with ckpts.save(step, protect=[best] if best else []) as ckpt, _viewed_as(ckpt.path, folder) as view:
            # An instance attribute for the duration: the Trainer's method builds its directory from it.
            self._get_output_dir = lambda trial=None: view
            try:
                super()._save_checkpoint(model, trial)  # type: ignore[misc]
            finally:
                del self._get_output_dir
            self._point_best_at(run_dir, view, ckpt.path)

    def _point_best_at(self, run_dir: str, view: str, stage: str) -> None:
        """The Trainer found the best checkpoint in the view (when it is the one being saved): point it,
        and the trainer state saved in the stage, at the run directory."""
        current = self.state.best_model_checkpoint
        if current and current.startswith(view + os.sep):
            self.state.best_model_checkpoint = os.path.join(run_dir, os.path.relpath(current, view))
            if self.args.should_save and os.path.exists(os.path.join(stage, "trainer_state.json")):
                self.state.save_to_json(os.path.join(stage, "trainer_state.json"))


@contextlib.contextmanager
def _viewed_as(stage: str, folder: str) -> Iterator[str]:
    """A private directory where ``folder`` is a link to the shared ``stage``; saves nested in the
    Trainer's (the tokenizer's ``save_pretrained`` under the patch) see the view as the stage."""
    view = tempfile.mkdtemp(prefix="safeio-trainer-")
    link = os.path.join(view, folder)
    os.symlink(stage, link)
    redirect = active.redirect(stage)
    entry = active.ActiveStage(link, stage, replicated=redirect)
    active.push(entry)
    try:
        yield view
    finally:
        active.pop(entry)
        shutil.rmtree(view, ignore_errors=True)


@functools.cache
def _safe_trainer() -> type:
    from transformers import Trainer

    class SafeTrainer(CheckpointsTrainerMixin, Trainer):
        """``transformers.Trainer`` with ``CheckpointsTrainerMixin``."""

    return SafeTrainer


def __getattr__(name: str) -> Any:
    if name == "SafeTrainer":  # built on first use: importing this module must not import transformers
        return _safe_trainer()
    raise AttributeError(name)
