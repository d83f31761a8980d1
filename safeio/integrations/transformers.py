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

``_save_checkpoint`` runs inside ``safeio.Checkpoints.save``: the Trainer's own method still does
everything it does (so its file set, its best-model tracking and its rotation follow the installed
transformers), with its output directory pointed at a private view of the run directory
(``_RunView``): ``checkpoint-N`` there is a link to the shared stage, and every other ``checkpoint-*``
of the run directory stands there as an empty directory with the real one's modification time. The
Trainer finds its earlier checkpoints there (the best one's existence decides ``best_model_checkpoint``)
and rotates them by its own order and rules (``save_total_limit``, the best one and the newest kept);
what it deleted in the view, safeio retires after the commit (renamed aside under the root's lock,
deleted after it), among the checkpoints this user committed. The run directory holds nothing but the
checkpoints: no pointer file (``Checkpoints(pointer=False)``), the root locked as a directory, a
retired checkpoint's deletion finished before ``train()`` returns.

Fidelity: step names, saving a step that exists (a rollback, a re-run: the commit replaces it),
retention, best-model tracking, the just-in-time checkpoint (its ``checkpoint-N`` holding only
``checkpoint-is-incomplete.txt`` is the Trainer's placeholder, replaced by the commit) and the messages
and exception types code matches on stay the Trainer's; safeio changes where and how files are
written and committed, and which checkpoint ``resume_from_checkpoint=True`` may choose.

The mixin is explicit in the user's code and touches no class but theirs; for code the user cannot
edit, ``patch_trainer()`` (installed by ``SAFEIO_PATCH``) does the same to ``Trainer`` itself, every
subclass included, through the same functions (a mixin instance is left to its mixin: nothing is
staged twice). Both rely on ``_save_checkpoint(model, trial)`` and ``_get_output_dir(trial)``, checked
when the trainer is built or the patch installed.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import inspect
import os
import shutil
import stat
import sys
import tempfile
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from safeio import Checkpoints, Group, InvalidTargetError, UnsupportedSaveError
from safeio.frameworks import Patch, check_timeout, open_shared_directory, stage_view

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
# transformers' just-in-time checkpoint (enable_jit_checkpoint) makes checkpoint-N holding only this
# before it saves, and removes it after (transformers/trainer_jit_checkpoint.py).
JIT_SENTINEL = "checkpoint-is-incomplete.txt"
_SENTINEL_CAP = 4096
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
    and so are the model's weights. Read as untrusted input (the share is; ``SharedDirectory.read_json``):
    within a memory bound, and only when the directory's owner wrote it (not one another user put in a
    directory others can write)."""
    try:
        with open_shared_directory(path) as directory:
            state = directory.read_json(TRAINER_STATE, _STATE_CAP)
            names = directory.names()
    except OSError:
        return False
    if not (isinstance(state, dict) and isinstance(state.get("global_step"), int)):
        return False
    return any(n in _WEIGHTS or n.startswith(_WEIGHT_DIRS) for n in names)


def is_jit_placeholder(path: str) -> bool:
    """Whether ``path`` is the directory transformers' just-in-time checkpoint makes before it saves:
    nothing in it but its small ``checkpoint-is-incomplete.txt``. The commit replaces it (nothing in it
    is worth keeping), where a directory written without safeio would be moved aside."""
    try:
        with open_shared_directory(path) as directory:
            if directory.names() != [JIT_SENTINEL]:
                return False
            st = directory.lstat(JIT_SENTINEL)
    except OSError:
        return False
    return st is not None and stat.S_ISREG(st.st_mode) and st.st_size <= _SENTINEL_CAP


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


# Each trainer's Checkpoints by run directory: one object across its saves, so that a retired
# checkpoint's deletion is joined by the next save and at the end of train().
_checkpoints: weakref.WeakKeyDictionary[Any, dict[str, Checkpoints]] = weakref.WeakKeyDictionary()


def _checkpoints_of(trainer: Any, run_dir: str | None = None) -> Checkpoints:
    """The ``Checkpoints`` of a trainer's run directory (default: ``args.output_dir``). Retention is
    the Trainer's own rotation (``save_total_limit``), which ``_save_committed`` carries out:
    ``keep=None`` here. No pointer file in the run directory (``pointer=False``)."""
    where = os.fspath(run_dir if run_dir is not None else trainer.args.output_dir)
    known = _checkpoints.setdefault(trainer, {})
    if where not in known:
        known[where] = Checkpoints(
            where, keep=None, name=PREFIX, timeout=getattr(trainer, "safeio_timeout", None), pointer=False
        )
    return known[where]


def _finish_deletions(trainer: Any) -> None:
    """At the end of ``train()``: the deletion of the checkpoints the last save retired is finished, as
    the Trainer's own rotation deletes them before ``_save_checkpoint`` returns (a listing of the run
    directory afterwards finds none of them, nor their renamed-aside remains)."""
    for ckpts in _checkpoints.get(trainer, {}).values():
        ckpts.wait()


def _resume_path(trainer: Any) -> str:
    """``train(resume_from_checkpoint=True)``: the most recent committed checkpoint (or a newer complete
    one written without safeio, with a WARNING), the same on every rank (collective)."""
    found = _checkpoints_of(trainer).latest(unmarked=is_complete_by_trainer)
    if found is None:
        # transformers' own message and type (ValueError: InvalidTargetError is one, and a SafeIOError),
        # with what safeio looked for after it
        raise InvalidTargetError(
            f"No valid checkpoint found in output directory ({trainer.args.output_dir}): safeio resumes "
            "from a committed checkpoint-N (or a complete one written without safeio) and found none",
            trainer.args.output_dir,
        )
    return found.path


def _save_committed(trainer: Any, model: Any, trial: Any, save: Callable[[Any, Any], None]) -> None:
    """``save`` (the Trainer's own ``_save_checkpoint``, bound) inside ``Checkpoints.save``, its output
    directory pointed at a view of the run directory (``_RunView``); the checkpoints the Trainer's own
    rotation deleted there are retired after the commit."""
    run_dir = trainer._get_output_dir(trial=trial)
    ckpts = _checkpoints_of(trainer, run_dir)
    step = trainer.state.global_step
    folder = PREFIX.format(step=step)
    best = trainer.state.best_model_checkpoint
    # A checkpoint-N of this step the plain Trainer left (a kill before safeio, or a plain run's) is moved
    # aside; the just-in-time checkpoint's placeholder is replaced.
    saving = ckpts.save(
        step, protect=[best] if best else [], unmarked=is_complete_by_trainer, placeholder=is_jit_placeholder
    )
    with saving as ckpt, _RunView.of(run_dir, folder, ckpt.path, _mirrored(trainer, run_dir)) as view:
        # An instance attribute for the duration: the Trainer's method builds its directories from it, and
        # finds its best checkpoint there (its rotation compares paths).
        trainer._get_output_dir = lambda trial=None: view.path
        trainer.state.best_model_checkpoint = _moved(best, run_dir, view.path)
        try:
            save(model, trial)
        finally:
            del trainer._get_output_dir
            _point_best_at(trainer, run_dir, view.path, ckpt.path)
        if ckpt.is_writer:
            ckpt.retire(*view.rotated())


def _moved(path: str | None, old: str, new: str) -> str | None:
    """``path`` below directory ``old``, as the same path below ``new``; anything else unchanged."""
    if path and path.startswith(old.rstrip(os.sep) + os.sep):
        return os.path.join(new, os.path.relpath(path, old))
    return path


def _mirrored(trainer: Any, run_dir: str) -> Callable[[str], bool]:
    """Which of the run directory's checkpoints the view shows: every ``checkpoint-*`` directory when
    the Trainer rotates (``save_total_limit``), else only the best one, whose existence is all it asks."""
    limit = trainer.args.save_total_limit
    if limit is not None and limit > 0:
        return lambda name: fnmatch.fnmatchcase(name, "checkpoint-*")
    best_step = getattr(trainer.state, "best_global_step", None)  # transformers 5 (4.x: by path)
    best_path = trainer.state.best_model_checkpoint
    best = {PREFIX.format(step=best_step) if best_step else None, os.path.basename(best_path or "")}
    return lambda name: name in best


def _point_best_at(trainer: Any, run_dir: str, view: str, stage: str) -> None:
    """The Trainer found the best checkpoint in the view: point it, and the trainer state saved in the
    stage, at the run directory."""
    current = trainer.state.best_model_checkpoint
    moved = _moved(current, view, run_dir)
    if moved != current:
        trainer.state.best_model_checkpoint = moved
        if trainer.args.should_save and os.path.exists(os.path.join(stage, TRAINER_STATE)):
            trainer.state.save_to_json(os.path.join(stage, TRAINER_STATE))


class CheckpointsTrainerMixin:
    """Put before ``Trainer`` (or any subclass) in the bases. ``safeio_timeout`` bounds every wait of a
    checkpoint (default: safeio's timeout, ``SAFEIO_TIMEOUT``)."""

    args: Any

    def __init__(self, *args: Any, safeio_timeout: float | None = None, **kwargs: Any) -> None:
        _check_trainer(type(self))
        if safeio_timeout is not None:  # refused now, not at the first checkpoint hours into the run
            check_timeout(safeio_timeout, "safeio_timeout")
        self.safeio_timeout = safeio_timeout
        super().__init__(*args, **kwargs)

    def safeio_checkpoints(self, run_dir: str | None = None) -> Checkpoints:
        """The ``Checkpoints`` of a run directory (default: ``args.output_dir``), the one this trainer
        commits its checkpoints into (its retention is the Trainer's own rotation)."""
        return _checkpoints_of(self, run_dir)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            resume_from_checkpoint = _resume_path(self)  # collective: every rank gets the same answer
        result = super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        _finish_deletions(self)
        return result

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        _save_committed(self, model, trial, super()._save_checkpoint)  # type: ignore[misc]


class _RunView:
    """A private directory the Trainer's ``_save_checkpoint`` takes for its run directory: ``folder`` is a
    link to the shared stage (saves nested in the Trainer's, such as a tokenizer's ``save_pretrained``
    under the patch, see it as the stage), and each of the run directory's other checkpoints that
    ``mirrored`` names is an empty directory with the real one's modification time — what the Trainer's
    ``best_model_checkpoint`` check and its rotation (``sort_checkpoints``: by modification time, or by
    step when those are within a second) look at. What the rotation deletes there is ``rotated()``."""

    def __init__(self, path: str, mirrors: list[str]) -> None:
        self.path = path
        self._mirrors = mirrors

    @classmethod
    @contextlib.contextmanager
    def of(cls, run_dir: str, folder: str, stage: str, mirrored: Callable[[str], bool]) -> Iterator[_RunView]:
        path = tempfile.mkdtemp(prefix="safeio-trainer-")
        try:
            link = os.path.join(path, folder)
            os.symlink(stage, link)
            view = cls(path, _mirror(run_dir, path, folder, mirrored))
            with stage_view(link, stage):
                yield view
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def rotated(self) -> list[str]:
        """The checkpoints the Trainer's rotation deleted in the view."""
        return [name for name in self._mirrors if not os.path.lexists(os.path.join(self.path, name))]


def _mirror(run_dir: str, view: str, folder: str, mirrored: Callable[[str], bool]) -> list[str]:
    try:
        names = os.listdir(run_dir)
    except OSError:
        return []
    mirrors = []
    for name in names:
        real = os.path.join(run_dir, name)
        if name == folder or not mirrored(name) or not os.path.isdir(real):  # as transformers' glob sees it
            continue
        with contextlib.suppress(OSError):
            mtime = os.stat(real).st_mtime
            os.mkdir(os.path.join(view, name))
            os.utime(os.path.join(view, name), (mtime, mtime))
            mirrors.append(name)
    return mirrors


# -- patch_trainer: the same, for every Trainer of the process (SAFEIO_PATCH) --------------------------


class TrainerPatch(Patch):
    """Every ``transformers.Trainer`` (and subclass) of the process saves its ``checkpoint-N`` through
    ``safeio.Checkpoints`` and resumes (``train(resume_from_checkpoint=True)``) from the newest committed
    one, like ``CheckpointsTrainerMixin``; ``get_last_checkpoint`` of ``transformers.trainer_utils`` (and
    wherever it was imported by name) is safeio's. ``install()``/``uninstall()`` or a context manager;
    installs are counted, the last uninstall restores exactly what was there (``safeio.frameworks.Patch``)."""

    def install(self, *, load: bool = True) -> TrainerPatch:
        """``load=False``: patch only the transformers modules imported so far (the start-up hook calls
        ``refresh()`` as the others are imported, without importing the Trainer for a program that
        never uses it)."""
        if load:
            import transformers.trainer  # noqa: F401 - the module to patch
        return super().install()

    @classmethod
    def refresh(cls) -> None:
        """Patch the transformers modules imported since the install (a no-op when none is installed)."""
        cls.sync()

    def apply(self) -> None:
        trainer_module = sys.modules.get("transformers.trainer")
        trainer = vars(trainer_module).get("Trainer") if trainer_module is not None else None
        if isinstance(trainer, type) and not self.is_replaced(trainer, "_save_checkpoint"):
            _check_trainer(trainer)
            self.replace(
                trainer, "_save_checkpoint", _patched_save_checkpoint(vars(trainer)["_save_checkpoint"])
            )
            self.replace(trainer, "train", _patched_train(vars(trainer)["train"]))
        utils = sys.modules.get("transformers.trainer_utils")
        theirs = vars(utils).get("get_last_checkpoint") if utils is not None else None
        if theirs is not None and theirs is not get_last_checkpoint:
            # Every module that imported it by name (transformers.trainer, a script's namespace).
            for module in list(sys.modules.values()):
                namespace = getattr(module, "__dict__", None)
                if isinstance(namespace, dict) and namespace.get("get_last_checkpoint") is theirs:
                    self.replace(module, "get_last_checkpoint", get_last_checkpoint)


def patch_trainer() -> TrainerPatch:
    """The patch ``SAFEIO_PATCH`` installs for the HF Trainer (see ``TrainerPatch``)."""
    return TrainerPatch()


def _patched_save_checkpoint(original: Any) -> Any:
    @functools.wraps(original)
    def _save_checkpoint(self: Any, model: Any, trial: Any) -> None:
        if TrainerPatch.current() is None or isinstance(self, CheckpointsTrainerMixin):
            original(self, model, trial)  # the mixin already stages this save: once only
        else:
            _save_committed(self, model, trial, functools.partial(original, self))

    return _save_checkpoint


def _patched_train(original: Any) -> Any:
    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        if TrainerPatch.current() is None or isinstance(self, CheckpointsTrainerMixin):
            return original(self, *args, **kwargs)
        if args and args[0] is True:
            args = (_resume_path(self), *args[1:])
        elif kwargs.get("resume_from_checkpoint") is True:
            kwargs["resume_from_checkpoint"] = _resume_path(self)
        result = original(self, *args, **kwargs)
        _finish_deletions(self)
        return result

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
