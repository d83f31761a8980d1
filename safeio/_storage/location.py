"""Where a target lives: a local POSIX path (NFS included) or an fsspec URL, parsed once.

Local paths go through ``os`` directly: fsspec's local ``mv`` and transactions copy without fsync, which
is not the atomic, durable rename safeio promises. Anything else (``memory://``, ``s3://``, ...) goes
through fsspec, where a PUT replaces an object whole and a commit marker makes a set of objects atomic.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from safeio._errors import InvalidTargetError, InvalidTypeError

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem


@dataclass(frozen=True)
class Location:
    """A resolved target. ``path`` is absolute for local targets and the fsspec path otherwise; ``fs`` is
    None for a local target. What differs by kind is its back end's (``safeio._promotion.backends``)."""

    given: str
    path: str
    fs: AbstractFileSystem | None = None

    @property
    def parent(self) -> str:
        if self.fs is None:
            return os.path.dirname(self.path)
        return str(self.fs._parent(self.path))

    @property
    def name(self) -> str:
        return os.path.basename(self.path.rstrip("/"))

    def url(self, path: str | None = None) -> str:
        """The user-facing form of ``path`` (default: the target) for messages and return values."""
        path = self.path if path is None else path
        if self.fs is None:
            return path
        return str(self.fs.unstrip_protocol(path))


def as_path(value: Any, what: str = "target") -> str | bytes:
    """``os.fspath(value)``, or an ``InvalidTypeError`` naming ``what`` when ``value`` is no path at all
    (None, a number, a file object): os.fspath's bare TypeError named neither the argument nor safeio."""
    try:
        path: str | bytes = os.fspath(value)
    except TypeError:
        raise InvalidTypeError(
            f"{what} must be a str path, an os.PathLike or a URL, got {type(value).__name__} {value!r}", None
        ) from None
    return path


def as_str_path(value: Any, what: str = "target") -> str:
    """``as_path``, and a str that can name a file: bytes, an empty path and a NUL byte (for which the OS
    raises a bare ValueError) are refused with an ``InvalidTargetError`` naming ``what``."""
    given = as_path(value, what)
    if not isinstance(given, str):
        raise InvalidTargetError(f"{what} must be a str path or URL, got bytes {given!r}", repr(given))
    if given.strip() == "":
        raise InvalidTargetError(f"{what} path is empty", given)
    if "\0" in given:
        raise InvalidTargetError(f"{what} path contains a NUL byte: {given!r}", given)
    return given


def resolve(target: str | os.PathLike[str]) -> Location:
    """Turn a path, ``pathlib.Path`` or fsspec URL into a Location, refusing what cannot be a target."""
    given = as_str_path(target)
    if "://" in given and not given.startswith("file://"):
        return _resolve_url(given)
    if given.startswith("file://"):
        given = given[len("file://") :]
    path = os.path.abspath(os.path.expanduser(given))
    if path == os.path.dirname(path):
        raise InvalidTargetError(f"target cannot be a filesystem root: {given!r}", given)
    return Location(given=os.fspath(target), path=path)


def _resolve_url(url: str) -> Location:
    from fsspec.core import url_to_fs

    try:
        fs, path = url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise InvalidTargetError(f"cannot open a filesystem for {url!r}: {exc}", url) from exc
    path = str(path).rstrip("/")
    if "file" in _protocols(fs):
        return Location(given=url, path=os.path.abspath(path))
    if not path:
        raise InvalidTargetError(f"target URL names no path under its bucket or root: {url!r}", url)
    return Location(given=url, path=path, fs=fs)


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)
