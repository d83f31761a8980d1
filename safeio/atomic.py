"""``safeio.atomic_open``: one file, written beside its target and renamed into place.

flush, fsync the file, rename, fsync the directory: durability is part of atomicity. The previous
content stays readable under the name until the rename, and on any error the temporary file is removed
and the target is untouched. No rank logic: any caller may use it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from typing import IO, Any

from safeio.errors import InvalidTargetError, PromotionError, TargetExistsError
from safeio.names import sibling_name
from safeio.replicated import attach_cleanup_error
from safeio.storage import Location, fsync_path, resolve

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
        raise ValueError(f"atomic_open supports modes {', '.join(_MODES)}; got {mode!r}")
    location = resolve(path)
    if encoding is None and "b" not in mode:
        encoding = "utf-8"
    if location.is_local:
        with _atomic_local(location, mode, durable, encoding, newline) as f:
            yield f
    else:
        with _atomic_remote(location, mode, encoding, newline) as f:
            yield f


def _file_mode(mode: str) -> str:
    return "wb" if "b" in mode else "w"


@contextlib.contextmanager
def _atomic_local(
    location: Location, mode: str, durable: bool, encoding: str | None, newline: str | None
) -> Iterator[IO[Any]]:
    target, parent = location.path, location.parent
    if os.path.isdir(target) and not os.path.islink(target):
        raise InvalidTargetError(f"cannot write the file {target}: it is a directory", target)
    if not os.path.isdir(parent):
        raise InvalidTargetError(f"cannot write {target}: its directory {parent} does not exist", target)
    exclusive = mode.startswith("x")
    if exclusive and os.path.lexists(target):
        raise TargetExistsError(f"{target} already exists and mode={mode!r}", target)
    temp = os.path.join(parent, sibling_name(location.name, "tmp"))
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        raise PromotionError(
            f"cannot create a temporary file for {target}: {exc.strerror}", target, exc.errno
        ) from exc
    try:
        with os.fdopen(fd, _file_mode(mode), encoding=encoding, newline=newline) as f:
            yield f
            f.flush()
            with contextlib.suppress(FileNotFoundError):
                os.chmod(f.fileno(), stat.S_IMODE(os.stat(target).st_mode))  # keep the replaced file's mode
            if durable:
                os.fsync(f.fileno())
        if exclusive:
            os.link(temp, target)  # fails with EEXIST if a rival created it meanwhile; never overwrites
            os.unlink(temp)
        else:
            os.replace(temp, target)
        if durable:
            fsync_path(parent, directory=True)
    except BaseException as exc:
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
        except OSError as cleanup_error:
            attach_cleanup_error(exc, cleanup_error)
        if isinstance(exc, FileExistsError) and exclusive:
            raise TargetExistsError(f"{target} was created by someone else meanwhile", target) from exc
        raise


@contextlib.contextmanager
def _atomic_remote(
    location: Location, mode: str, encoding: str | None, newline: str | None
) -> Iterator[IO[Any]]:
    fs, url = location.fs, location.url()
    assert fs is not None
    if mode.startswith("x") and fs.exists(location.path):
        raise TargetExistsError(f"{url} already exists and mode={mode!r}", url)
    scratch = tempfile.mkdtemp(prefix="safeio-upload-")
    try:
        local = os.path.join(scratch, "data")
        with open(local, _file_mode(mode), encoding=encoding, newline=newline) as f:
            yield f
        try:
            fs.put_file(local, location.path)
        except OSError as exc:
            raise PromotionError(f"could not upload {url}: {exc}", url) from exc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
