"""Pointer files (``latest``, Megatron's ``latest_checkpointed_iteration.txt``), replaced atomically.

DeepSpeed and Megatron rewrite theirs in place with ``open(path, "w")``: a crash or a reader at the
wrong moment sees an empty or half-written pointer. Here the new text goes to a temporary file beside
it, is fsynced, renamed over the old one, and the directory is fsynced: a reader sees the old pointer or
the new one. One process writes it (a checkpoint's writer rank).
"""

from __future__ import annotations

import os
import stat

from safeio._saves.atomic import atomic_open


def write_pointer(path: str | os.PathLike[str], text: str, *, durable: bool = True) -> None:
    """Replace the file ``path`` with ``text`` atomically (durable: fsynced, with its directory)."""
    with atomic_open(path, "w", durable=durable) as f:
        f.write(text)


def read_pointer(path: str | os.PathLike[str]) -> str | None:
    """The text of a small pointer file, or None when it is absent or not a small regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, 4097)
    finally:
        os.close(fd)
    if len(data) > 4096:
        return None
    return data.decode("utf-8", "replace").strip()
