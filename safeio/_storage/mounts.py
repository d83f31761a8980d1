"""Which filesystem a path lives on, from ``/proc/self/mountinfo``, and whether it is a network one.

Network filesystems are where flock/fcntl locks may not exclude across clients, attribute caches go
stale, and a truncating open can block readers in the kernel (the failure safeio exists for).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

NETWORK_FS_TYPES = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "glusterfs",
        "beegfs", "9p", "afs", "ncpfs", "orangefs", "pvfs2", "panfs", "wekafs", "virtiofs",
    }
)  # fmt: skip


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
_network_devices: dict[int, bool] = {}


def is_network_device(device: int, path: str) -> bool:
    """Whether ``device`` (that of ``path``) is a network or FUSE filesystem: mountinfo is read once per
    device. A device number a later mount reuses may get a stale answer: use it only where either
    answer is safe (whether to ask for a rename flag), else ``is_network_path``."""
    known = _network_devices.get(device)
    if known is None:
        mount = mount_of(path)
        known = _network_devices[device] = mount is not None and mount.is_network
    return known


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
