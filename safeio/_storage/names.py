"""Names of everything safeio creates beside a target, and how to recognise them later.

Every sibling is hidden and carries ``.safeio-`` plus its kind, its owner's host tag, pid and process
start time, so that ``safeio gc`` and the next save can tell a stale stage from a live one and never touch
a file that safeio did not create. The host tag covers the PID namespace too: containers on one node share
a host name, and a pid means nothing outside its namespace (gc once removed a live save of another
container). The start time catches a pid reused by a later process. Names stay within NAME_MAX (255
bytes) however long the target's name is.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

NAME_MAX = 255
Kind = Literal["stage", "old", "tmp", "link", "v"]
KINDS: tuple[str, ...] = ("stage", "old", "tmp", "link", "v")

# ".<base>.safeio-<kind>-<host8>-<pid>-<start>-<rand8>": at most 58 bytes (pid up to 2**32, the start
# time in base 36). Names written by earlier versions have no start field and still parse.
_SUFFIX_BUDGET = 60
_BASE_BUDGET = NAME_MAX - 1 - _SUFFIX_BUDGET
_PATTERN = re.compile(
    r"\.(?P<base>.*)\.safeio-(?P<kind>stage|old|tmp|link|v)-(?P<host>[0-9a-f]{8})-(?P<pid>[0-9]+)"
    r"(?:-(?P<start>[0-9a-z]{1,13}))?-(?P<rand>[0-9a-f]{8})",
    re.DOTALL,
)
LOCK_SUFFIX = ".safeio.lock"


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


_NAMESPACE = _pid_namespace()


@lru_cache(maxsize=8)
def _tag(name: str, namespace: str) -> str:
    return hashlib.sha256(f"{name}\0{namespace}".encode()).hexdigest()[:8]


def host_tag(hostname: str | None = None) -> str:
    """Eight hex digits naming a host and this process's PID namespace (long host names would not fit
    beside long target names)."""
    return _tag(hostname if hostname is not None else socket.gethostname(), _NAMESPACE)


def _base36(number: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        number, rest = divmod(number, 36)
        out = digits[rest] + out
        if number == 0:
            return out


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, base 36), or None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return _base36(int(fields[19]))  # field 22 of proc(5), counted after the command name
    except (OSError, IndexError, ValueError):
        return None


_OWN_PID = os.getpid()
_OWN_START = process_start(_OWN_PID)


def truncated_base(target_name: str) -> str:
    """The target's name cut (at a character boundary) so that every sibling name fits NAME_MAX."""
    raw = target_name.encode("utf-8", "surrogateescape")
    if len(raw) <= _BASE_BUDGET:
        return target_name
    return raw[:_BASE_BUDGET].decode("utf-8", "ignore")


def sibling_name(target_name: str, kind: Kind) -> str:
    pid = os.getpid()
    start = _OWN_START if pid == _OWN_PID else process_start(pid)  # a forked child starts anew
    owner = f"{pid}-{start}" if start is not None else str(pid)
    return f".{truncated_base(target_name)}.safeio-{kind}-{host_tag()}-{owner}-{secrets.token_hex(4)}"


def lock_name(target_name: str) -> str:
    return f".{truncated_base(target_name)}{LOCK_SUFFIX}"


def may_have_siblings(names: Iterable[str], target_name: str, *, besides: str = "") -> bool:
    """Whether a directory listing may hold safeio siblings of ``target_name`` other than ``besides``.

    A name check only (no parse, no stat): a writer that finds none skips recovery altogether, which is
    the common case; a name that only looks like one is judged by the full recovery.
    """
    prefix = f".{truncated_base(target_name)}.safeio-"
    return any(name != besides for name in [n for n in names if n.startswith(prefix)])


@dataclass(frozen=True)
class Sibling:
    """A parsed safeio sibling name."""

    name: str
    base: str
    kind: str
    host: str
    pid: int
    start: str | None = None

    def belongs_to(self, target_name: str) -> bool:
        return self.base == truncated_base(target_name)

    def owner_is_alive(self) -> bool | None:
        """True/False on the owner's host and PID namespace; None elsewhere (it cannot be probed)."""
        if self.host != host_tag():
            return None
        if self.pid == _OWN_PID == os.getpid():  # this very process (every save's own stage): no /proc
            return self.start is None or self.start == _OWN_START
        if not pid_alive(self.pid):
            return False
        # The pid is alive; is it still the process that made the sibling, or a later one reusing it?
        return self.start is None or process_start(self.pid) in (None, self.start)


def parse(name: str) -> Sibling | None:
    match = _PATTERN.fullmatch(name)
    if match is None:
        return None
    return Sibling(name, match["base"], match["kind"], match["host"], int(match["pid"]), match["start"])


def is_version_pointee(pointee: str, target_name: str | None = None) -> bool:
    """Whether a version link's content names a version directory beside it (of ``target_name``)."""
    sibling = parse(pointee) if "/" not in pointee and "\0" not in pointee else None
    if sibling is None or sibling.kind != "v":
        return False
    return target_name is None or sibling.belongs_to(target_name)


PID_MAX_LIMIT = 1 << 22  # no Linux pid is larger (a crafted name may say anything)


def pid_alive(pid: int) -> bool:
    if pid <= 0 or pid > PID_MAX_LIMIT:
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


# The files a ``safeio.Checkpoints`` root keeps beside its steps. Named here, below the checkpoint layer,
# because the back end that says whether a directory is such a root (``Backend.holds_checkpoints``,
# for ``safeio verify``) recognises them too.
LATEST = "latest"  # DeepSpeed's pointer file: the name of the newest checkpoint directory
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's: the newest iteration number
SEQUENCE = ".checkpoints.safeio.sequence"  # the last sequence number given to a commit in this root
ROOT_LOCK = "checkpoints"  # one promotion lock per root: ``.checkpoints.safeio.lock``
