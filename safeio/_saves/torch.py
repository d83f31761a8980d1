"""``safeio.torch_save``: a replicated torch object, written once and atomically, on the replicated flow."""

from __future__ import annotations

import os
from typing import Any

from safeio._options import SaveOptions
from safeio._saves.atomic import atomic_open
from safeio._saves.replicated import ReplicatedSave


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised only without torch
        raise ImportError("safeio.torch_save needs torch: pip install 'safeio-ckpt[torch]'") from exc
    return torch


def torch_save(
    obj: Any,
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    timeout: float | None = None,
    durable: bool = True,
    writer: int | None = None,
    warn_after: float | None = None,
    **save_kwargs: Any,
) -> None:
    """``torch.save(obj, path)`` on the writer only, atomically; every rank returns once it is done.

    For replicated state (the same object on every rank). Sharded state belongs to
    ``torch.distributed.checkpoint``, which safeio never wraps.
    """
    torch = _torch()
    options = SaveOptions.of(timeout=timeout, durable=durable, writer=writer, warn_after=warn_after)
    save = ReplicatedSave(path, options, group=group, kind="file")
    with save as stage:
        if stage.nested:
            # Inside an open stage (a checkpoint's): its writer writes the file there, atomically; the
            # stage's own commit tells every rank the outcome.
            if stage.is_writer:
                with atomic_open(stage.path, "wb", durable=durable) as f:
                    torch.save(obj, f, **save_kwargs)
        elif stage.is_writer:
            with save.open_file() as f:  # through the descriptor that created it, never the name
                torch.save(obj, f, **save_kwargs)
