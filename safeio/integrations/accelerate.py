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
- ``total_limit`` is applied after the commit, by one rank.

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

from safeio._checkpoints.checkpoints import Checkpoint, Checkpoints
from safeio._saves.torch import torch_save

__all__ = ["checkpoints_for", "load_state", "save_state"]

# Written by accelerate with torch.save on every rank, the same content on each: written once here.
_REPLICATED = re.compile(r"scaler\.pt|dl_state_dict(_\d+)?\.bin")


def checkpoints_for(
    accelerator: Any, *, root: str | None = None, timeout: float | None = None, durable: bool = True
) -> Checkpoints:
    """The ``Checkpoints`` of an accelerator: ``<project_dir>/checkpoints/checkpoint_<N>`` (accelerate's
    own layout), ``keep`` = the project configuration's ``total_limit``."""
    config = accelerator.project_configuration
    where = root if root is not None else os.path.join(accelerator.project_dir or ".", "checkpoints")
    return Checkpoints(
        where, keep=config.total_limit, name="checkpoint_{step}", timeout=timeout, durable=durable
    )


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
    ``Checkpoint``; raises ``CheckpointError`` on every rank if any rank failed (nothing committed)."""
    ckpts = ckpts if ckpts is not None else checkpoints_for(accelerator)
    config = accelerator.project_configuration
    step = accelerator.save_iteration if step is None else step
    naming = config.automatic_checkpoint_naming
    config.automatic_checkpoint_naming = False  # Checkpoints names, stages and retires the directories
    try:
        with ckpts.save(step) as ckpt, _replicated_files_once():
            accelerator.save_state(ckpt.path, **save_state_kwargs)
    finally:
        config.automatic_checkpoint_naming = naming
    return Checkpoint(step, os.path.join(ckpts.root, ckpts.names.format(step)))


def load_state(
    accelerator: Any, ckpts: Checkpoints | None = None, **load_state_kwargs: Any
) -> Checkpoint | None:
    """Load the newest committed checkpoint (the same on every rank), or return None when there is none.
    The next ``save_state`` numbers its checkpoint after it."""
    ckpts = ckpts if ckpts is not None else checkpoints_for(accelerator)
    found = ckpts.latest()
    if found is not None:
        accelerator.load_state(found.path, **load_state_kwargs)
        accelerator.project_configuration.iteration = found.step + 1
    return found
