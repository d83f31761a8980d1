"""When is a ``checkpoint_<N>`` that accelerate's own ``save_state`` wrote (without safeio) complete?

accelerate writes no completion marker. What it writes, in order, on each rank (accelerate 1.16's
``Accelerator.save_state`` and ``checkpointing.save_accelerator_state``), straight under the final name:

1. the main process: the models' weights (``model[_i].safetensors`` or ``pytorch_model[_i].bin``; an
   FSDP/DeepSpeed/Megatron engine's own files instead), ``optimizer[_i].bin``, ``scheduler[_i].bin``,
   ``sampler[_i].bin``;
2. every rank: ``dl_state_dict[_i].bin`` (stateful dataloaders) and ``scaler.pt`` (mixed precision);
3. every rank, after all of its own files: ``random_states_<rank>.pkl``;
4. the main process, last: ``custom_checkpoint_<i>.pkl`` (``register_for_checkpointing``).

No rank waits for another at the end. So the rule: a directory is complete when every file this job's
``accelerator.load_state`` reads is there — judged by the accelerator's own models, optimizers,
schedulers, dataloaders, scaler and registered objects — including ``random_states_<r>.pkl`` of *every*
rank of this job and every ``custom_checkpoint_<i>.pkl``, and every ``torch.save`` archive among them is
whole (its zip directory, written at the very end of the file, reads: a rank killed mid-write leaves a
file under its final name without one). Each rank's random states are its last write before the custom
objects, so they stand for everything that rank wrote before them — also an engine's files, which are not
judged by name. A checkpoint of a job with fewer ranks lacks this job's higher ranks' random states and is
judged incomplete (accelerate would load it and quietly keep those ranks' fresh random states).

Without an accelerator (``safeio ls``), ``ranks_written`` judges by the files alone: a model's weights and
``random_states_0.pkl`` … ``random_states_<k-1>.pkl`` (numbered from 0 without a gap), every archive
whole; how many ranks the job had is not known there, so ``ls`` calls incomplete a checkpoint with fewer
ranks' random states than another accelerate checkpoint of the same root.
"""

from __future__ import annotations

import contextlib
import os
import re
import zipfile
from typing import Any

from safeio._storage.dirfd import held_directory, open_regular_file

RANDOM_STATES = "random_states_{rank}.pkl"
_RANDOM_STATES = re.compile(r"random_states_(\d+)\.pkl")
_WEIGHTS = re.compile(r"(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin)")
_ARCHIVES = (".bin", ".pkl", ".pt")  # what accelerate writes with torch.save: zip archives
# The engines save the models (and their optimizers) their own way, under names of their own.
_ENGINES = ("FSDP", "DEEPSPEED", "MEGATRON_LM")


def needed_files(accelerator: Any) -> list[tuple[str, ...]]:
    """What ``accelerator.load_state`` reads from a checkpoint of this job, each entry the names of which
    one must be there (a model's weights: safetensors or pickle)."""
    engine = str(getattr(accelerator.distributed_type, "name", accelerator.distributed_type)) in _ENGINES
    needed: list[tuple[str, ...]] = []
    if not engine:
        for i in range(len(accelerator._models)):
            ending = f"_{i}" if i else ""
            needed.append((f"model{ending}.safetensors", f"pytorch_model{ending}.bin"))
        needed.extend((f"optimizer{_ending(i)}.bin",) for i in range(len(accelerator._optimizers)))
        needed.extend((f"scheduler{_ending(i)}.bin",) for i in range(len(accelerator._schedulers)))
    for i, loader in enumerate(accelerator._dataloaders):
        if _saves_its_sampler(loader):
            needed.append((f"sampler{_ending(i)}.bin",))
        if getattr(loader, "use_stateful_dataloader", False):
            needed.append((f"dl_state_dict{_ending(i)}.bin",))
    if accelerator.scaler is not None:
        needed.append(("scaler.pt",))
    needed.extend((RANDOM_STATES.format(rank=r),) for r in range(accelerator.num_processes))
    needed.extend((f"custom_checkpoint_{i}.pkl",) for i in range(len(accelerator._custom_objects)))
    return needed


def is_complete_for(accelerator: Any, path: str) -> bool:
    """Whether ``path`` holds every file ``needed_files(accelerator)`` names, each archive whole."""
    try:
        with held_directory(path) as fd:
            names = set(os.listdir(fd))
            for choices in needed_files(accelerator):
                present = [n for n in choices if n in names]
                if not present or not _whole(fd, present[0]):
                    return False
    except OSError:
        return False
    return True


def ranks_written(path: str) -> int | None:
    """Judged by the files alone (``safeio ls``, no accelerator): how many ranks' random states an
    accelerate checkpoint holds, when it looks complete (a model's weights, ``random_states_0.pkl`` …
    ``random_states_<k-1>.pkl`` without a gap, every archive whole); None otherwise."""
    try:
        with held_directory(path) as fd:
            names = os.listdir(fd)
            ranks = sorted(int(m.group(1)) for n in names if (m := _RANDOM_STATES.fullmatch(n)))
            if not ranks or ranks != list(range(len(ranks))) or not any(_WEIGHTS.fullmatch(n) for n in names):
                return None
            if not all(_whole(fd, n) for n in names if n.endswith(_ARCHIVES)):
                return None
    except OSError:
        return None
    return len(ranks)


def _ending(i: int) -> str:
    return f"_{i}" if i else ""


def _saves_its_sampler(loader: Any) -> bool:
    """accelerate saves (and then needs) a dataloader's sampler only for this one case."""
    from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

    if not isinstance(getattr(loader, "dataset", None), IterableDatasetShard):
        return False
    return isinstance(loader.get_sampler(), SeedableRandomSampler)


def _whole(dir_fd: int, name: str) -> bool:
    """A regular file; a ``torch.save`` archive whose zip directory reads (only the file's end is read)."""
    try:
        fd, _st = open_regular_file(dir_fd, name)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        if not name.endswith(_ARCHIVES):
            return True
        with contextlib.suppress(zipfile.BadZipFile, OSError, EOFError), zipfile.ZipFile(f):
            return True
    return False
