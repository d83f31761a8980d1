"""The second process of ``safeio doctor``'s probes: holds locks, creates files, watches for changes.

Run as a script (``python -I -S _peer.py ROOT``), so it imports the standard library only: it starts in
a few milliseconds and keeps doctor fast. It reads one JSON command per line on stdin and answers one
JSON line on stdout; names are relative to ROOT (the probe directory as this process sees it, possibly
through another mount of the same directory).
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

_held: dict[str, int] = {}


def _path(root: str, name: str) -> str:
    return os.path.join(root, name)


def _lock(root: str, cmd: dict[str, Any]) -> dict[str, Any]:
    fd = os.open(_path(root, cmd["name"]), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if cmd["kind"] == "flock":
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        return {"ok": False, "errno": exc.errno}
    _held[cmd["name"]] = fd
    return {"ok": True}


def _unlock(cmd: dict[str, Any]) -> dict[str, Any]:
    fd = _held.pop(cmd["name"], None)
    if fd is not None:
        os.close(fd)  # closing releases both flock and POSIX locks
    return {"ok": True}


def _create_excl(root: str, cmd: dict[str, Any]) -> dict[str, Any]:
    try:
        fd = os.open(_path(root, cmd["name"]), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        return {"ok": False, "errno": exc.errno}
    os.close(fd)
    return {"ok": True}


def _size(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def _stat(root: str, cmd: dict[str, Any]) -> dict[str, Any]:
    # Looking names up is the point: it fills this client's dentry, negative and attribute caches.
    return {"ok": True, "sizes": [_size(_path(root, name)) for name in cmd["names"]]}


def _satisfied(size: int | None, check: dict[str, Any]) -> bool:
    until = check["until"]
    if until == "exists":
        return size is not None
    if until == "missing":
        return size is None
    return bool(size == check["size"])


def _watch(root: str, cmd: dict[str, Any]) -> dict[str, Any]:
    """Poll each check until it holds or the deadline passes; report seconds to each (None: never)."""
    checks = cmd["checks"]
    start = time.monotonic()
    deadline = start + float(cmd["deadline"])
    elapsed: list[float | None] = [None] * len(checks)
    while True:
        now = time.monotonic()
        for index, check in enumerate(checks):
            if elapsed[index] is None and _satisfied(_size(_path(root, check["name"])), check):
                elapsed[index] = now - start
        if all(e is not None for e in elapsed) or now >= deadline:
            return {"ok": True, "elapsed": elapsed}
        time.sleep(0.002)  # a polling interval, not synchronisation: the deadline bounds the loop


def main() -> int:
    root = sys.argv[1]
    handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
        "lock": lambda cmd: _lock(root, cmd),
        "unlock": _unlock,
        "create_excl": lambda cmd: _create_excl(root, cmd),
        "stat": lambda cmd: _stat(root, cmd),
        "watch": lambda cmd: _watch(root, cmd),
    }
    print(json.dumps({"ok": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            reply = handlers[cmd["op"]](cmd)
        except OSError as exc:
            reply = {"ok": False, "errno": exc.errno, "error": str(exc)}
        print(json.dumps(reply), flush=True)
    for fd in _held.values():
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
