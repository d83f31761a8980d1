"""Pointer files (``latest``, Megatron's ``latest_checkpointed_iteration.txt``), replaced atomically.

DeepSpeed and Megatron rewrite theirs in place with ``open(path, "w")``: a crash or a reader at the
wrong moment sees an empty or half-written pointer. Here the new text goes to a temporary file beside
it, is fsynced, renamed over the old one, and the directory is fsynced: a reader sees the old pointer or
the new one. One process writes it (a checkpoint's writer rank).
"""

from __future__ import annotations

import os

from safeio._errors import InvalidTypeError
from safeio._saves.atomic import atomic_open
from safeio._storage.location import as_path
from safeio._storage.readers import read_pointer

__all__ = ["read_pointer", "write_pointer"]


def write_pointer(path: str | os.PathLike[str], text: str, *, durable: bool = True) -> None:
    """Replace the file ``path`` with ``text`` atomically (durable: fsynced, with its directory)."""
    if not isinstance(text, str):  # before the stage is made: write() would refuse it inside
        shown = os.fsdecode(as_path(path, "path"))
        raise InvalidTypeError(f"{shown}: text must be a str, got {type(text).__name__} {text!r}", shown)
    with atomic_open(path, "w", durable=durable) as f:
        f.write(text)
