"""Where a target lives: a local POSIX path (NFS included) or an fsspec URL, and what that filesystem can do.

Local paths go through ``os`` directly: fsspec's local ``mv`` and transactions copy without fsync, which
is not the atomic, durable rename safeio promises. Anything else (``memory://``, ``s3://``, ...) goes
through fsspec, where a PUT replaces an object whole and a commit marker makes a set of objects atomic.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from safeio.errors import InvalidTargetError

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

# Filesystems on which flock/fcntl locks may not exclude across clients, attribute caches go stale and
# a truncating open can block readers in the kernel (the failure safeio exists for).
NETWORK_FS_TYPES = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "glusterfs",
        "beegfs", "9p", "afs", "ncpfs", "orangefs", "pvfs2", "panfs", "wekafs", "virtiofs",
    }
)  # fmt: skip


@dataclass(frozen=True)
class Location:
    """A resolved target. ``path`` is absolute for local targets and the fsspec path otherwise."""

    given: str
    path: str
    fs: AbstractFileSystem | None = None

    @property
    def is_local(self) -> bool:
        return self.fs is None

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


def resolve(target: str | os.PathLike[str]) -> Location:
    """Turn a path, ``pathlib.Path`` or fsspec URL into a Location, refusing what cannot be a target."""
    given = os.fspath(target)
    if not isinstance(given, str):
        raise InvalidTargetError(f"target must be a str path or URL, got bytes {given!r}", repr(given))
    if given.strip() == "":
        raise InvalidTargetError("target path is empty", given)
    if "\0" in given:
        raise InvalidTargetError(f"target path contains a NUL byte: {given!r}", given)
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


# ---------------------------------------------------------------------------------------------------
# Filesystem types, from /proc/self/mountinfo


@dataclass(frozen=True)
class MountInfo:
    mount_point: str
    fs_type: str
    source: str
    options: tuple[str, ...]

    @property
    def is_network(self) -> bool:
        # FUSE covers sshfs, gcsfuse, JuiceFS and our own NFS-like test filesystem: locks there are only
        # as good as the daemon, so treat it like a network filesystem.
        return self.fs_type in NETWORK_FS_TYPES or self.fs_type.split(".")[0] in ("fuse", "fuseblk")


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def read_mounts(mountinfo: str = "/proc/self/mountinfo") -> list[MountInfo]:
    mounts: list[MountInfo] = []
    try:
        with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.readlines()
    except OSError:
        return mounts
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 6 or len(tail) < 3:
            continue
        options = tuple(fields[5].split(",")) + tuple(tail[2].split(","))
        mounts.append(MountInfo(_unescape(fields[4]), tail[0], _unescape(tail[1]), options))
    return mounts


def mount_of(path: str) -> MountInfo | None:
    """The mount holding ``path`` (or its nearest existing ancestor)."""
    probe = os.path.realpath(path)
    while not os.path.exists(probe) and probe != os.path.dirname(probe):
        probe = os.path.dirname(probe)
    best: MountInfo | None = None
    for mount in read_mounts():
        mp = mount.mount_point
        inside = probe == mp or probe.startswith(mp.rstrip("/") + "/")
        if inside and (best is None or len(mp) >= len(best.mount_point)):
            best = mount  # later entries over the same point shadow earlier ones
    return best


_network_by_device: dict[int, tuple[str, bool]] = {}


def is_network_path(path: str) -> bool:
    """Whether ``path`` is on a network (or FUSE) filesystem; cached per device, as every save asks.

    A cached answer is trusted only while its mount point still carries the same device number, so a
    device number reused by a later mount elsewhere is looked up again.
    """
    probe = path
    while not os.path.exists(probe) and probe != os.path.dirname(probe):
        probe = os.path.dirname(probe)
    try:
        device = os.stat(probe).st_dev
    except OSError:
        device = -1
    cached = _network_by_device.get(device)
    if cached is not None:
        with contextlib.suppress(OSError):
            if os.stat(cached[0]).st_dev == device:
                return cached[1]
    mount = mount_of(path)
    answer = mount is not None and mount.is_network
    if mount is not None and device != -1:
        _network_by_device[device] = (mount.mount_point, answer)
    return answer


# ---------------------------------------------------------------------------------------------------
# POSIX primitives


def fsync_path(path: str, *, directory: bool = False) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file and directory under ``root``, children before their directory."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                fsync_path(full)
        for name in dirnames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                fsync_path(full, directory=True)
    fsync_path(root, directory=True)


RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100


@lru_cache(maxsize=1)
def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def renameat2(src: str, dst: str, flags: int) -> None:
    """``renameat2(2)``; raises OSError (EINVAL/ENOSYS/EOPNOTSUPP where unsupported, as on NFS)."""
    libc = _libc()
    func = getattr(libc, "renameat2", None)
    if func is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available in this C library", src)
    result = func(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), ctypes.c_uint(flags))
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), src, None, dst)


EXCHANGE_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})

_umask_lock = threading.Lock()


def current_umask() -> int:
    """The process umask, read without changing it where /proc allows (os.umask is a global write)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask
