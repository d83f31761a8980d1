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
after the commit, by the writer). The mixin is explicit in the user's code and touches no class but
theirs; for code the user cannot edit, ``patch_trainer()`` (installed by ``SAFEIO_PATCH``) does the same
to ``Trainer`` itself, every subclass included, through the same functions (a mixin instance is left to
its mixin: nothing is staged twice). Both rely on ``_save_checkpoint(model, trial)`` and
``_get_output_dir(trial)``, checked when the trainer is built or the patch installed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

from safeio._checkpoints.checkpoints import Checkpoints
from safeio._coordination.group import Group
from safeio._errors import InvalidTargetError, UnsupportedSaveError
from safeio._options import seconds
from safeio._promotion import active
from safeio._storage.dirfd import held_directory
from safeio._storage.metadata import read_json

__all__ = [  # and SafeTrainer, built on first use
    "CheckpointsTrainerMixin",
    "TrainerPatch",
    "get_last_checkpoint",
    "patch_trainer",
]

PREFIX = "checkpoint-{step}"


def get_last_checkpoint(folder: str | os.PathLike[str]) -> str | None:
    """``transformers.trainer_utils.get_last_checkpoint`` that returns only a committed checkpoint (its
    marker present, every listed file at its size), the most recent commit (after a rollback, not the
    highest number): a half-written ``checkpoint-N`` is never resumed. A ``checkpoint-N`` the Trainer
    wrote without safeio is not ignored: a complete one (``is_complete_by_trainer``) with a higher step
    than the latest commit is returned, with a WARNING; incomplete ones above it are skipped, each with
    a WARNING naming it.
    Each process reads the directory itself; inside a job prefer ``train(resume_from_checkpoint=True)``
    with the mixin, where every rank gets the writer's answer."""
    # A group of this process alone: latest() is then this process's own reading of the root.
    ckpts = Checkpoints(folder, keep=None, name=PREFIX, group=Group())
    found = ckpts.latest(unmarked=is_complete_by_trainer)
    return os.path.join(os.fspath(folder), os.path.basename(found.path)) if found is not None else None


TRAINER_STATE = "trainer_state.json"  # written last into checkpoint-N, by the process that saves
_STATE_CAP = 256 << 20  # a long run's log_history makes it tens of MB
# The model's weights in a checkpoint-N: whole or sharded, safetensors or pickle, a PEFT adapter; FSDP's
# and DeepSpeed's are directories (pytorch_model_fsdp_0, global_step<N>).
_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)
_WEIGHT_DIRS = ("pytorch_model_fsdp", "global_step")


def is_complete_by_trainer(path: str) -> bool:
    """Whether a ``checkpoint-N`` written without safeio is one the Trainer finished: its own marker,
    ``trainer_state.json`` (written after the model, optimizer and RNG states), is there and parses,
    and so are the model's weights. Read as untrusted input (the share is; ``metadata.read_json``):
    within a memory bound, and only when the directory's owner wrote it (not one another user put in a
    directory others can write)."""
    try:
        with held_directory(path) as fd:
            state = read_json(fd, TRAINER_STATE, _STATE_CAP, owner=os.fstat(fd).st_uid)
            names = os.listdir(fd)
    except OSError:
        return False
    if not (isinstance(state, dict) and isinstance(state.get("global_step"), int)):
        return False
    return any(n in _WEIGHTS or n.startswith(_WEIGHT_DIRS) for n in names)


def _check_trainer(cls: type) -> None:
    save = getattr(cls, "_save_checkpoint", None)
    if save is None or not hasattr(cls, "_get_output_dir"):
        raise UnsupportedSaveError(
            f"{cls.__name__}: this transformers Trainer has no _save_checkpoint/_get_output_dir; "
            "safeio's CheckpointsTrainerMixin (and SAFEIO_PATCH's trainer part) supports transformers 4.45 "
            "to 5.x",
            None,
        )
    params = list(inspect.signature(save).parameters)
    if params[:3] != ["self", "model", "trial"]:
        raise UnsupportedSaveError(
            f"{cls.__name__}._save_checkpoint{inspect.signature(save)} is not the (model, trial) method "
            "safeio's CheckpointsTrainerMixin (and SAFEIO_PATCH's trainer part) wraps; this transformers "
            "version is not supported",
            None,
        )


def _checkpoints_of(trainer: Any, run_dir: str | None = None) -> Checkpoints:
    """The ``Checkpoints`` of a trainer's run directory (default: ``args.output_dir``); retention keeps
    the newest ``save_total_limit`` committed checkpoints."""
    return Checkpoints(
        run_dir if run_dir is not None else trainer.args.output_dir,
        # transformers keeps every checkpoint for a limit of None or 0 or less
        keep=limit if (limit := trainer.args.save_total_limit) and limit > 0 else None,
        name=PREFIX,
        timeout=getattr(trainer, "safeio_timeout", None),
    )


def _resume_path(trainer: Any) -> str:
    """``train(resume_from_checkpoint=True)``: the most recent committed checkpoint (or a newer complete
    one written without safeio, with a WARNING), the same on every rank (collective)."""
    found = _checkpoints_of(trainer).latest(unmarked=is_complete_by_trainer)
    if found is None:
        # transformers raises ValueError here; InvalidTargetError is one, and a SafeIOError
        raise InvalidTargetError(
            f"No committed (or complete) checkpoint found in output directory ({trainer.args.output_dir})",
            trainer.args.output_dir,
        )
    return found.path


def _save_committed(trainer: Any, model: Any, trial: Any, save: Callable[[Any, Any], None]) -> None:
    """``save`` (the Trainer's own ``_save_checkpoint``, bound) inside ``Checkpoints.save``, its output
    directory redirected to the stage; rotation is the commit's retention."""
    run_dir = trainer._get_output_dir(trial=trial)
    ckpts = _checkpoints_of(trainer, run_dir)
    step = trainer.state.global_step
    folder = PREFIX.format(step=step)
    best = trainer.state.best_model_checkpoint
    # A checkpoint-N of this step the plain Trainer left unfinished (a kill before safeio) is moved aside.
    saving = ckpts.save(step, protect=[best] if best else [], unmarked=is_complete_by_trainer)
    with saving as ckpt, _viewed_as(ckpt.path, folder) as view:
        # An instance attribute for the duration: the Trainer's method builds its directory from it.
        trainer._get_output_dir = lambda trial=None: view
        try:
            save(model, trial)
        finally:
            del trainer._get_output_dir
        _point_best_at(trainer, run_dir, view, ckpt.path)


def _point_best_at(trainer: Any, run_dir: str, view: str, stage: str) -> None:
    """The Trainer found the best checkpoint in the view (when it is the one being saved): point it,
    and the trainer state saved in the stage, at the run directory."""
    current = trainer.state.best_model_checkpoint
    if current and current.startswith(view + os.sep):
        trainer.state.best_model_checkpoint = os.path.join(run_dir, os.path.relpath(current, view))
        if trainer.args.should_save and os.path.exists(os.path.join(stage, TRAINER_STATE)):
            trainer.state.save_to_json(os.path.join(stage, TRAINER_STATE))


class CheckpointsTrainerMixin:
    """Put before ``Trainer`` (or any subclass) in the bases. ``safeio_timeout`` bounds every wait of a
    checkpoint (default: safeio's timeout, ``SAFEIO_TIMEOUT``)."""

    args: Any

    def __init__(self, *args: Any, safeio_timeout: float | None = None, **kwargs: Any) -> None:
        _check_trainer(type(self))
        if safeio_timeout is not None:  # refused now, not at the first checkpoint hours into the run
            seconds(safeio_timeout, "safeio_timeout")
        self.safeio_timeout = safeio_timeout
        super().__init__(*args, **kwargs)

    def safeio_checkpoints(self, run_dir: str | None = None) -> Checkpoints:
        """The ``Checkpoints`` of a run directory (default: ``args.output_dir``); retention keeps the
        newest ``save_total_limit`` committed checkpoints."""
        return _checkpoints_of(self, run_dir)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            resume_from_checkpoint = _resume_path(self)  # collective: every rank gets the same answer
        return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        _save_committed(self, model, trial, super()._save_checkpoint)  # type: ignore[misc]


@contextlib.contextmanager
def _viewed_as(stage: str, folder: str) -> Iterator[str]:
    """A private directory where ``folder`` is a link to the shared ``stage``; saves nested in the
    Trainer's (the tokenizer's ``save_pretrained`` under the patch) see the view as the stage."""
    view = tempfile.mkdtemp(prefix="safeio-trainer-")
    link = os.path.join(view, folder)
    os.symlink(stage, link)
    covered = active.covering(stage)
    redirect, results = (covered[0], covered[1].results) if covered is not None else (None, None)
    entry = active.ActiveStage(link, stage, replicated=redirect, results=results)
    active.push(entry)
    try:
        yield view
    finally:
        active.pop(entry)
        shutil.rmtree(view, ignore_errors=True)


# -- patch_trainer: the same, for every Trainer of the process (SAFEIO_PATCH) --------------------------

_MISSING = object()
_patch_lock = threading.RLock()
_installed: list[TrainerPatch] = []
# What the patch replaced, to put back: (owner, attribute, its own value before or _MISSING, ours).
_replaced: list[tuple[Any, str, Any, Any]] = []


class TrainerPatch:
    """Every ``transformers.Trainer`` (and subclass) of the process saves its ``checkpoint-N`` through
    ``safeio.Checkpoints`` and resumes (``train(resume_from_checkpoint=True)``) from the newest committed
    one, like ``CheckpointsTrainerMixin``; ``get_last_checkpoint`` of ``transformers.trainer_utils`` (and
    wherever it was imported by name) is safeio's. ``install()``/``uninstall()`` or a context manager;
    installs are counted, the last uninstall restores exactly what was there."""

    def __init__(self) -> None:
        self.installed = False

    def install(self, *, load: bool = True) -> TrainerPatch:
        """``load=False``: patch only the transformers modules imported so far (the start-up hook calls
        ``refresh()`` as the others are imported, without importing the Trainer for a program that
        never uses it)."""
        if load:
            import transformers.trainer  # noqa: F401 - the module to patch
        with _patch_lock:
            if not self.installed:
                _installed.append(self)
                self.installed = True
            try:
                _sync()
            except BaseException:  # an unsupported Trainer: nothing of this install stays
                self.uninstall()
                raise
        return self

    def uninstall(self) -> None:
        with _patch_lock:
            if self.installed:
                _installed.remove(self)
                self.installed = False
                _sync()

    @staticmethod
    def refresh() -> None:
        """Patch the transformers modules imported since the install (a no-op when none is installed)."""
        with _patch_lock:
            _sync()

    def __enter__(self) -> TrainerPatch:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def patch_trainer() -> TrainerPatch:
    """The patch ``SAFEIO_PATCH`` installs for the HF Trainer (see ``TrainerPatch``)."""
    return TrainerPatch()


def _sync() -> None:
    if not _installed:
        while _replaced:
            owner, name, before, ours = _replaced.pop()
            if vars(owner).get(name) is ours:  # never undo what someone patched over ours
                if before is _MISSING:
                    delattr(owner, name)
                else:
                    setattr(owner, name, before)
        return
    done = {(id(owner), name) for owner, name, _, _ in _replaced}
    trainer_module = sys.modules.get("transformers.trainer")
    trainer = vars(trainer_module).get("Trainer") if trainer_module is not None else None
    if isinstance(trainer, type) and (id(trainer), "_save_checkpoint") not in done:
        _check_trainer(trainer)
        _replace(trainer, "_save_checkpoint", _patched_save_checkpoint(vars(trainer)["_save_checkpoint"]))
        _replace(trainer, "train", _patched_train(vars(trainer)["train"]))
    utils = sys.modules.get("transformers.trainer_utils")
    theirs = vars(utils).get("get_last_checkpoint") if utils is not None else None
    if theirs is not None and theirs is not get_last_checkpoint:
        # Every module that imported it by name (transformers.trainer, a script's namespace).
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if isinstance(namespace, dict) and namespace.get("get_last_checkpoint") is theirs:
                _replace(module, "get_last_checkpoint", get_last_checkpoint)


def _replace(owner: Any, name: str, ours: Any) -> None:
    _replaced.append((owner, name, vars(owner).get(name, _MISSING), ours))
    setattr(owner, name, ours)


def _patched_save_checkpoint(original: Any) -> Any:
    @functools.wraps(original)
    def _save_checkpoint(self: Any, model: Any, trial: Any) -> None:
        if not _installed or isinstance(self, CheckpointsTrainerMixin):
            original(self, model, trial)  # the mixin already stages this save: once only
        else:
            _save_committed(self, model, trial, functools.partial(original, self))

    return _save_checkpoint


def _patched_train(original: Any) -> Any:
    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _installed and not isinstance(self, CheckpointsTrainerMixin):
            if args and args[0] is True:
                args = (_resume_path(self), *args[1:])
            elif kwargs.get("resume_from_checkpoint") is True:
                kwargs["resume_from_checkpoint"] = _resume_path(self)
        return original(self, *args, **kwargs)

    return train


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
