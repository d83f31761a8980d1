"""Judging a soft-lock marker found beside a target: whose is it, is its holder alive, is it damaged.

filelock's soft locks (``SoftFileLease``, ``StrictSoftFileLock``) are exclusive-create marker files that
record their holder (``pid=``/``host=`` lines, or the older ``pid\\nhost\\n`` form). A holder's process
is judged on its own host only; the host field carries the PID namespace when the writer ran in a
non-initial one (containers), so a live holder in another namespace is never mistaken for a dead one.
Markers are input like everything else in a share: read without following a link or blocking on a FIFO,
at most ``MARKER_MAX`` bytes; anything else is *damaged*, and reported as such.
"""

from __future__ import annotations

import os
import socket
import stat
from dataclasses import dataclass

from safeio._storage.dirfd import lstat_at, open_regular_file
from safeio._storage.names import pid_alive

# filelock's soft-lock markers are at most this long; anything bigger is not one of them.
MARKER_MAX = 1024
# filelock's host field carries this suffix when the writer ran in a non-initial PID namespace.
_NAMESPACE_MARK = "?pidns-"
_INITIAL_PID_NAMESPACE = 0xEFFFFFFC


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str

    def alive(self) -> bool | None:
        """True/False for a holder on this host (and PID namespace); None for one elsewhere."""
        return pid_alive(self.pid) if self.host == this_host() else None


@dataclass(frozen=True)
class Marker:
    """What is under a lock marker's name: a holder, an empty flock lock file, or damage."""

    st: os.stat_result
    raw: bytes = b""
    holder: Holder | None = None
    damaged: str | None = None


def this_host() -> str:
    """As filelock writes it: the host name, plus the PID namespace when not the initial one."""
    name = socket.gethostname()
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return name
    return name if namespace == _INITIAL_PID_NAMESPACE else f"{name}{_NAMESPACE_MARK}{namespace:x}"


def read_marker(dir_fd: int, name: str) -> Marker | None:
    """The marker ``name`` in ``dir_fd``; None when there is none."""
    st = lstat_at(dir_fd, name)
    if st is None:
        return None
    if not stat.S_ISREG(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        return Marker(st, damaged=f"the lock marker is {kind}")
    if st.st_size > MARKER_MAX:
        return Marker(st, damaged=f"the lock marker is {st.st_size} bytes, larger than any lock marker")
    try:
        fd, st = open_regular_file(dir_fd, name)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return Marker(st, damaged=f"the lock marker cannot be opened ({exc.strerror or exc})")
    try:
        raw = os.read(fd, MARKER_MAX + 1)
    finally:
        os.close(fd)
    return Marker(st, raw, *_parse(raw))


def _parse(raw: bytes) -> tuple[Holder | None, str | None]:
    if not raw:
        return None, None  # flock's lock file: empty, and never to be removed while someone may hold it
    text = raw.decode("utf-8", "replace")
    lines = text.splitlines()
    if text.endswith("\n") and lines:
        fields = dict(line.partition("=")[::2] for line in lines[1:] if "=" in line)
        if lines[0].startswith("filelock/") and fields.get("pid", "").isdigit() and fields.get("host"):
            return Holder(int(fields["pid"]), fields["host"]), None
        if len(lines) in (2, 3) and lines[0].isdigit() and lines[1]:
            return Holder(int(lines[0]), lines[1]), None
    return None, "the lock marker's content is not a holder record (half-written or damaged)"


def remove_if_unchanged(dir_fd: int, name: str, seen: Marker) -> bool:
    """Remove the very marker judged (same inode, same content): a contender may have taken it since."""
    now = read_marker(dir_fd, name)
    if (
        now is None
        or (now.st.st_dev, now.st.st_ino) != (seen.st.st_dev, seen.st.st_ino)
        or now.raw != seen.raw
    ):
        return False
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True
