"""``safeio.torch_save``: a replicated torch object, written once and atomically."""

from __future__ import annotations

import os
from typing import Any

from safeio._settings import resolve_timeout
from safeio.atomic import atomic_open
from safeio.channel import Channel, Outcome
from safeio.group import resolve_group
from safeio.storage import resolve


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised only without torch
        raise ImportError("safeio.torch_save needs torch: pip install 'safeio[torch]'") from exc
    return torch


def torch_save(
    obj: Any,
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    timeout: float | None = None,
    durable: bool = True,
    writer: int | None = None,
    **save_kwargs: Any,
) -> None:
    """``torch.save(obj, path)`` on the writer only, atomically; every rank returns once it is done.

    For replicated state (the same object on every rank). Sharded state belongs to
    ``torch.distributed.checkpoint``, which safeio never wraps.
    """
    torch = _torch()
    location = resolve(path)
    wait_for = resolve_timeout(timeout)
    grp = resolve_group(group)
    if writer is not None:
        grp = grp.with_writer(writer)
    channel = Channel.open(grp, location.url())
    if not grp.is_writer:
        # Without a store, "landed" can only mean the file is there (a file carries no manifest).
        landed = (lambda: os.path.exists(location.path)) if location.is_local else None
        outcome = channel.wait(wait_for, landed)
        outcome.raise_if_failed(grp.rank)
        return
    channel.enter_phase("write")
    try:
        with atomic_open(location.given, "wb", durable=durable) as f:
            torch.save(obj, f, **save_kwargs)
    except BaseException as exc:
        channel.publish(Outcome.failure(location.url(), grp.rank, exc))
        raise
    channel.publish(Outcome(True, location.url(), grp.rank))
