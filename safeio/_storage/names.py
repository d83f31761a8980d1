"""Names of everything safeio creates beside a target, and how to recognise them later.

Every sibling is hidden and carries ``.safeio-`` plus its kind, the owner's host tag and pid, so that
``safeio gc`` and the next save can tell a stale stage from a live one and never touch a file that
safeio did not create. Names stay within NAME_MAX (255 bytes) however long the target's name is.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import socket
from dataclasses import dataclass
from typing import Literal

NAME_MAX = 255
Kind = Literal["stage", "old", "tmp", "link", "v"]
KINDS: tuple[str, ...] = ("stage", "old", "tmp", "link", "v")

# ".<base>.safeio-<kind>-<host8>-<pid>-<rand8>": the suffix is at most 44 bytes (pid up to 2**32).
_SUFFIX_BUDGET = 48
_BASE_BUDGET = NAME_MAX - 1 - _SUFFIX_BUDGET
_PATTERN = re.compile(
    r"\.(?P<base>.*)\.safeio-(?P<kind>stage|old|tmp|link|v)-(?P<host>[0-9a-f]{8})-(?P<pid>[0-9]+)-(?P<rand>[0-9a-f]{8})",
    re.DOTALL,
)
LOCK_SUFFIX = ".safeio.lock"


def host_tag(hostname: str | None = None) -> str:
    """Eight hex digits naming a host: long host names would not fit beside long target names."""
    name = hostname if hostname is not None else socket.gethostname()
    return hashlib.sha256(name.encode()).hexdigest()[:8]


def truncated_base(target_name: str) -> str:
    """The target's name cut (at a character boundary) so that every sibling name fits NAME_MAX."""
    raw = target_name.encode("utf-8", "surrogateescape")
    if len(raw) <= _BASE_BUDGET:
        return target_name
    return raw[:_BASE_BUDGET].decode("utf-8", "ignore")


def sibling_name(target_name: str, kind: Kind) -> str:
    return f".{truncated_base(target_name)}.safeio-{kind}-{host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"


def lock_name(target_name: str) -> str:
    return f".{truncated_base(target_name)}{LOCK_SUFFIX}"


@dataclass(frozen=True)
class Sibling:
    """A parsed safeio sibling name."""

    name: str
    base: str
    kind: str
    host: str
    pid: int

    def belongs_to(self, target_name: str) -> bool:
        return self.base == truncated_base(target_name)

    def owner_is_alive(self) -> bool | None:
        """True/False on the owner's host; None elsewhere (liveness cannot be probed across hosts)."""
        if self.host != host_tag():
            return None
        return pid_alive(self.pid)


def parse(name: str) -> Sibling | None:
    match = _PATTERN.fullmatch(name)
    if match is None:
        return None
    return Sibling(name, match["base"], match["kind"], match["host"], int(match["pid"]))


def is_version_pointee(pointee: str, target_name: str | None = None) -> bool:
    """Whether a version link's content names a version directory beside it (of ``target_name``)."""
    sibling = parse(pointee) if "/" not in pointee and "\0" not in pointee else None
    if sibling is None or sibling.kind != "v":
        return False
    return target_name is None or sibling.belongs_to(target_name)


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    # A killed but unreaped child is a zombie: it answers kill(0) yet will never finish its save.
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")
