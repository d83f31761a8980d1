"""Lightning: ``Trainer(plugins=[SafeCheckpointIO()])`` and ``SafeModelCheckpoint(save_last="link")``.

Lightning's own ``TorchCheckpointIO`` serialises the checkpoint into memory, then writes it through an
fsspec transaction whose temporary file lives in the system ``/tmp``: on NFS the final move is a copy
into place, and a crash during it leaves a torn ``.ckpt`` under its final name. ``SafeCheckpointIO``
writes a temporary file in the checkpoint's own directory, fsyncs it, renames it over the name and
fsyncs the directory (``safeio.atomic_open``); object-store URLs are uploaded whole (one PUT). It streams
``torch.save`` into the file (no second copy of the checkpoint in memory), removes checkpoints by
renaming them aside first, and composes with ``AsyncCheckpointIO(SafeCheckpointIO())``.

``ModelCheckpoint(save_last="link")`` replaces ``last.ckpt`` by removing it and then creating the link:
in between, and after a crash there, there is no ``last.ckpt`` at all. ``SafeModelCheckpoint`` makes
the new link beside it and renames it over the old one (where links are refused, an atomic copy, as
ModelCheckpoint falls back to copying). It keeps ``ModelCheckpoint``'s ``state_key``, so
a run resumes the best model path and top-k list from a checkpoint either callback wrote. Where
Lightning removes a directory found at the link path (``shutil.rmtree``), it refuses with
``InvalidTargetError`` naming it: a directory tree in a shared directory is not removed on a guess.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from safeio import InvalidOptionError, InvalidTargetError, UnsupportedSaveError, atomic_open
from safeio.frameworks import (
    make_parent_directory,
    open_shared_directory,
    remove_file,
    replace_link,
    target_url,
)

__all__ = ["SafeCheckpointIO", "SafeModelCheckpoint"]


class SafeCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves are atomic and durable in place, and whose removals are safe.

    Lightning calls ``save_checkpoint`` on global rank 0 only; nothing here waits for other ranks.
    """

    def __init__(self, *, durable: bool = True) -> None:
        super().__init__()
        if not isinstance(durable, bool):  # refused here, not at the first checkpoint
            raise InvalidOptionError(f"durable must be True or False, got {durable!r}", None)
        self.durable = durable

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        url = target_url(path)  # a path that is none (None, a number) is refused here, named
        if storage_options is not None:  # a TypeError, as TorchCheckpointIO's own refusal
            raise UnsupportedSaveError(
                f"SafeCheckpointIO.save_checkpoint takes no storage_options, got {storage_options!r} for "
                f"{url}",
                url,
            )
        import torch

        make_parent_directory(path)
        with atomic_open(path, "wb", durable=self.durable) as f:
            torch.save(checkpoint, f)

    def remove_checkpoint(self, path: Any) -> None:
        remove_file(path, durable=self.durable)


class SafeModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``last.ckpt`` link (``save_last="link"``) is replaced atomically."""

    @property
    def state_key(self) -> str:
        # Lightning keys a callback's saved state by its class name: under its own name this callback
        # would not find what ModelCheckpoint saved (the best path, the top-k list), nor the reverse.
        key: str = super().state_key
        ours = type(self).__qualname__
        if type(self) is SafeModelCheckpoint and key.startswith(ours):
            key = ModelCheckpoint.__qualname__ + key[len(ours) :]
        return key

    @staticmethod
    def _link_checkpoint(trainer: Any, filepath: str, linkpath: str) -> None:
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            try:
                _replace_with_link(filepath, linkpath)
            except IsADirectoryError:
                raise InvalidTargetError(
                    f"{linkpath} is a directory, so the last-checkpoint link cannot replace it; "
                    "move or remove it (ModelCheckpoint would delete it with its contents)",
                    linkpath,
                ) from None
        trainer.strategy.barrier()


def _replace_with_link(filepath: str, linkpath: str) -> None:
    """``linkpath`` becomes a relative link to ``filepath`` by one rename (readers see the old link or the
    new one, never none); where the filesystem refuses links, an atomic copy of it (ModelCheckpoint's
    fallback, which copies over the removed link)."""
    if not replace_link(linkpath, filepath):
        # No symbolic links on this filesystem (SMB/CIFS, FAT): ModelCheckpoint then copies the file, on
        # any OSError of its os.symlink.
        _copy_into_place(filepath, linkpath)


def _copy_into_place(filepath: str, linkpath: str) -> None:
    # A directory at linkpath is refused here too: atomic_open raises InvalidTargetError naming it.
    # The source is read through its directory's handle, never through a link planted under its name in
    # the shared directory: that would copy whatever file the link names (anyone's) into the share.
    with open_shared_directory(os.path.dirname(os.path.abspath(filepath)), follow=True) as source_dir:
        try:
            fd, _ = source_dir.open_regular_file(os.path.basename(filepath))
        except OSError as exc:
            raise InvalidTargetError(
                f"{filepath} is not a regular file of this directory ({exc.strerror or exc}); "
                f"{linkpath} is not copied from it",
                filepath,
            ) from None
    with os.fdopen(fd, "rb") as source, atomic_open(linkpath, "wb") as copy:
        shutil.copyfileobj(source, copy, 1 << 20)
