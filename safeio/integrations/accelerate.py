"""accelerate: ``save_state`` / ``load_state`` through ``safeio.Checkpoints``.

``accelerator.save_state(dir)`` runs on every rank and writes into the final directory in place: the
model, optimizer and scheduler once (main process), every rank's ``random_states_<rank>.pkl``, and —
with a bare ``torch.save`` on *every* rank — ``scaler.pt`` and ``dl_state_dict*.bin``, so that on a
shared filesystem the ranks truncate and rewrite the same files under each other. With
``automatic_checkpoint_naming`` it deletes the oldest checkpoints (``total_limit``) *before* saving the
new one. Here:

- the whole ``checkpoint_<N>`` is staged and committed once (``safeio.Checkpoints``): every rank's files,
  one manifest, one rename; resume finds only committed checkpoints;
- ``scaler.pt`` and ``dl_state_dict*.bin`` are written once (the writer's; the others' go to scratch);
- retention is accelerate's: ``total_limit`` (None: keep all), applied after the commit, by one rank —
  also with a ``Checkpoints`` of the user's that was not given ``keep`` (its default, 3, would silently
  change the script's retention); an explicit ``keep`` wins;
- ``load_state`` never ignores a ``checkpoint_<N>`` accelerate wrote without safeio: a complete one
  (``_accelerate_files``: accelerate writes no marker; judged by what this job's ``load_state`` reads)
  newer than the latest commit is loaded with a WARNING; an incomplete one is skipped with a WARNING
  naming it.

``save_state`` swaps ``accelerate.checkpointing``'s ``torch`` for the duration of the call (accelerate
has no hook for those two files); the names are looked up at call time, so nothing else is affected.
"""

from __future__ import annotations

import contextlib
import os
import re
import types
from collections.abc import Iterator
from typing import Any

from safeio import Checkpoint, Checkpoints, UnsupportedSaveError, torch_save
from safeio.integrations._accelerate_files import is_complete_for

__all__ = ["checkpoints_for", "load_state", "save_state"]

# Written by accelerate with torch.save on every rank, the same content on each: written once here.
_REPLICATED = re.compile(r"scaler\.pt|dl_state_dict(_\d+)?\.bin")


def checkpoints_for(
    accelerator: Any, *, root: str | None = None, timeout: float | None = None, durable: bool = True
) -> Checkpoints:
    """The ``Checkpoints`` of an accelerator: ``<project_dir>/checkpoints/checkpoint_<N>`` (accelerate's
    own layout), ``keep`` = the project configuration's ``total_limit``. No pointer file there
    (``pointer=False``): accelerate's own ``load_state()`` and ``total_limit`` rotation list that
    directory and take a number from every name in it (an ``IndexError`` on ``latest``), so a run
    without safeio afterwards reads it as accelerate left it."""
    config = _configuration(accelerator)
    where = root if root is not None else os.path.join(accelerator.project_dir or ".", "checkpoints")
    return Checkpoints(
        where,
        keep=config.total_limit,
        name="checkpoint_{step}",
        timeout=timeout,
        durable=durable,
        pointer=False,
    )


def _configuration(accelerator: Any) -> Any:
    """The accelerator's project configuration; an UnsupportedSaveError (a TypeError) naming what was
    passed when it is no ``accelerate.Accelerator`` (an AttributeError from deep inside, before)."""
    config = getattr(accelerator, "project_configuration", None)
    if config is None or not callable(getattr(accelerator, "save_state", None)):
        raise UnsupportedSaveError(
            f"expected an accelerate.Accelerator, got {type(accelerator).__name__} {accelerator!r}", None
        )
    return config


class _TorchSavingReplicatedOnce(types.ModuleType):
    """``torch`` as accelerate.checkpointing sees it, except that ``save`` of a replicated file goes
    through ``safeio.torch_save`` (inside a checkpoint's stage: the writer's copy into the stage,
    atomically; the other ranks' into scratch)."""

    def __init__(self, torch: types.ModuleType) -> None:
        super().__init__("torch")
        self._torch = torch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def save(self, obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(f, (str, os.PathLike)) and _REPLICATED.fullmatch(os.path.basename(os.fspath(f))):
            torch_save(obj, f)
            return
        self._torch.save(obj, f, *args, **kwargs)


@contextlib.contextmanager
def _replicated_files_once() -> Iterator[None]:
    from accelerate import checkpointing

    original = checkpointing.torch
    checkpointing.torch = _TorchSavingReplicatedOnce(original)
    try:
        yield
    finally:
        checkpointing.torch = original


def save_state(
    accelerator: Any, ckpts: Checkpoints | None = None, step: int | None = None, **save_state_kwargs: Any
) -> Checkpoint:
    """``accelerator.save_state`` as one committed checkpoint; every rank calls it. Returns the committed
    ``Checkpoint``; raises ``CheckpointError`` on every rank if any rank failed (nothing committed).

    ``step`` numbers the checkpoint (default: accelerate's ``save_iteration``). Retention follows the
    project configuration's ``total_limit`` (None: keep all) unless ``ckpts`` was given ``keep``."""
    return committed_save_state(accelerator, ckpts, step, adopt=False, **save_state_kwargs)


def committed_save_state(
    accelerator: Any, ckpts: Checkpoints | None, step: int | None, *, adopt: bool, **save_state_kwargs: Any
) -> Checkpoint:
    """``save_state``; ``adopt``: the step's directory is the script's own (``SAFEIO_PATCH``'s
    ``save_state(dir)``), and what it holds already — nothing, or files the script wrote there, a
    tokenizer say — stays in the committed step, under what accelerate writes (see
    ``Checkpoints.save``), as accelerate writes into it."""
    config = _configuration(accelerator)
    ckpts = ckpts if ckpts is not None else checkpoints_for(accelerator)
    step = accelerator.save_iteration if step is None else step
    naming = config.automatic_checkpoint_naming
    config.automatic_checkpoint_naming = False  # Checkpoints names, stages and retires the directories
    try:
        saving = ckpts.save(step, adopt=adopt)
        with _retention_of(accelerator, ckpts), saving as ckpt, _replicated_files_once():
            accelerator.save_state(ckpt.path, **save_state_kwargs)
    finally:
        config.automatic_checkpoint_naming = naming
    return Checkpoint(step, os.path.join(ckpts.root, ckpts.names.format(step)))


@contextlib.contextmanager
def _retention_of(accelerator: Any, ckpts: Checkpoints) -> Iterator[None]:
    """The script's own retention for this save, unless the user chose ``keep``.

    Chosen over refusing a ``Checkpoints`` whose default differs from ``total_limit``: the user who
    passes ``Checkpoints(root, name=...)`` asked for a root and a naming, not for a retention, and the
    script already says how many checkpoints it keeps. The user's object is left as it was given."""
    if ckpts.keep_given:
        yield
        return
    ckpts.wait()  # an async commit still pending retires by the keep it was saved with
    default, ckpts.keep = ckpts.keep, accelerator.project_configuration.total_limit
    try:
        yield
    finally:
        ckpts.keep = default


def load_state(
    accelerator: Any, ckpts: Checkpoints | None = None, **load_state_kwargs: Any
) -> Checkpoint | None:
    """Load the newest committed checkpoint (the same on every rank), or return None when there is none.
    The next ``save_state`` numbers its checkpoint after it.

    A ``checkpoint_<N>`` accelerate wrote without safeio (no safeio marker) with a higher step than the
    latest commit is not ignored: loaded, with a WARNING, when complete (every file this job's
    ``accelerator.load_state`` reads is there, every rank's ``random_states_<r>.pkl`` and each
    ``torch.save`` archive whole); skipped, with a WARNING naming it, when not. The returned
    ``Checkpoint`` then has ``committed=False``."""
    _configuration(accelerator)
    ckpts = ckpts if ckpts is not None else checkpoints_for(accelerator)
    found = ckpts.latest(unmarked=lambda path: is_complete_for(accelerator, path))
    if found is not None:
        accelerator.load_state(found.path, **load_state_kwargs)
        accelerator.project_configuration.iteration = found.step + 1
    return found
