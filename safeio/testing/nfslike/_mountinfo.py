"""Reading /proc/self/mountinfo and unmounting with fusermount3."""

from __future__ import annotations

import logging
import re
import subprocess
from typing import NamedTuple

logger = logging.getLogger("safeio.testing.nfslike")

FSTYPE = "fuse.nfslike"


class MountEntry(NamedTuple):
    mount_point: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    # The kernel escapes space, tab, newline and backslash in mountinfo as \ooo octal.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts() -> list[MountEntry]:
    entries = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as info:
        for line in info:
            # "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue":
            # optional fields end at "-", then fstype and source.
            fields = line.split()
            sep = fields.index("-")
            entries.append(MountEntry(_unescape(fields[4]), fields[sep + 1], _unescape(fields[sep + 2])))
    return entries


def find(mount_point: str) -> MountEntry | None:
    """The topmost mount at `mount_point` (a real path), or None."""
    found = None
    for entry in mounts():
        if entry.mount_point == mount_point:
            found = entry  # later lines are mounted on top of earlier ones
    return found


def unmount(mount_point: str, *, timeout: float = 10.0) -> str | None:
    """Unmount a FUSE mount; when it is busy, detach it lazily (`-uz`).

    Returns "clean", "lazy" (detached, still serving the processes that use it) or None (failed).
    """
    for args, outcome in ((["-u"], "clean"), (["-uz"], "lazy")):
        try:
            done = subprocess.run(
                ["fusermount3", *args, mount_point],
                check=False,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            logger.warning("fusermount3 %s %s timed out after %s s", " ".join(args), mount_point, timeout)
            continue
        if done.returncode == 0:
            logger.debug("unmounted %s (fusermount3 %s)", mount_point, " ".join(args))
            return outcome
        logger.debug("fusermount3 %s %s: %s", " ".join(args), mount_point, done.stderr.strip())
    return None
