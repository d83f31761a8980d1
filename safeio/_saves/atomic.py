"""``safeio.atomic_open``: one file, written beside its target and renamed into place. No rank logic."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import IO, Any

from safeio._boundary import attach_cleanup_error
from safeio._errors import InvalidOptionError
from safeio._promotion.backends import backend_for

_MODES = ("w", "wb", "x", "xb", "wt", "xt")


@contextlib.contextmanager
def atomic_open(
    path: str | os.PathLike[str],
    mode: str = "w",
    *,
    durable: bool = True,
    encoding: str | None = None,
    newline: str | None = None,
) -> Iterator[IO[Any]]:
    """Open ``path`` for writing so that readers see the old content or the whole new one, never a part.

    ``mode`` is ``"w"``/``"wb"`` (replace) or ``"x"``/``"xb"`` (fail with TargetExistsError if the file
    exists). A local target keeps the permission bits of the file it replaces. fsspec URLs are written
    from a local temporary file with one upload (a PUT replaces an object whole).
    """
    if mode not in _MODES:
        raise InvalidOptionError(
            f"atomic_open supports modes {', '.join(_MODES)}; got {mode!r}", os.fspath(path)
        )
    if not isinstance(durable, bool):
        raise InvalidOptionError(f"durable must be True or False, got {durable!r}", os.fspath(path))
    if encoding is None and "b" not in mode:
        encoding = "utf-8"
    promotion = backend_for(path).file_promotion(exclusive=mode.startswith("x"), durable=durable)
    stage = promotion.open_stage()
    try:
        with promotion.open_file("wb" if "b" in mode else "w", encoding=encoding, newline=newline) as f:
            yield f
        promotion.finish(stage)
    except BaseException as exc:
        try:
            promotion.discard(stage)
        except OSError as cleanup_error:
            attach_cleanup_error(exc, cleanup_error)
        raise
