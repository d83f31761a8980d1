"""``safeio.atomic_open``: one file, written beside its target and renamed into place. No rank logic."""

from __future__ import annotations

import codecs
import contextlib
import os
from collections.abc import Iterator
from typing import IO, Any

from safeio._boundary import attach_cleanup_error
from safeio._errors import InvalidOptionError
from safeio._promotion.backends import backend_for
from safeio._storage.location import as_path

_MODES = ("w", "wb", "x", "xb", "wt", "xt")
_NEWLINES = (None, "", "\n", "\r", "\r\n")


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
    shown = os.fsdecode(as_path(path, "path"))  # every bad argument is named with the path it concerns
    if mode not in _MODES:
        raise InvalidOptionError(
            f"{shown}: atomic_open supports modes {', '.join(_MODES)}; got {mode!r}", shown
        )
    if not isinstance(durable, bool):
        raise InvalidOptionError(f"{shown}: durable must be True or False, got {durable!r}", shown)
    _check_text_options(mode, encoding, newline, shown)
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


def _check_text_options(mode: str, encoding: object, newline: object, shown: str) -> None:
    """What ``open()`` would refuse once the stage exists, refused before it (InvalidOptionError, a
    ValueError as ``open()``'s; an unknown encoding was open()'s LookupError, naming no path)."""
    if "b" in mode and (encoding is not None or newline is not None):
        raise InvalidOptionError(f"{shown}: binary mode {mode!r} takes no encoding or newline", shown)
    if encoding is not None:
        try:
            codecs.lookup(encoding)  # type: ignore[arg-type]
        except (LookupError, TypeError):
            unknown = f"{shown}: encoding {encoding!r} is not an encoding Python knows"
            raise InvalidOptionError(unknown, shown) from None
    if newline not in _NEWLINES:
        choices = ", ".join(map(repr, _NEWLINES))
        raise InvalidOptionError(f"{shown}: newline must be one of {choices}, got {newline!r}", shown)
