"""``safeio doctor``'s live probes, run in a private scratch directory that is removed afterwards.

Each probe answers one question safeio's design depends on, by doing it: does ``rename`` replace a
file atomically, does ``renameat2(RENAME_EXCHANGE)`` work, does ``O_EXCL`` and do ``flock``/POSIX locks
exclude a second process, what does ``fsync`` cost, and how long does a change take to reach a second
process — on this client, or through ``--peer-path`` (the same directory through another mount,
i.e. another client), where stale dentry, negative and attribute caches show.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import select
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from safeio.cli._common import human_seconds
from safeio.shares import EXCHANGE_UNSUPPORTED
from safeio.shares import exchange as exchange_entries

FSYNC_SAMPLES = 5
_PEER_SCRIPT = str(Path(__file__).with_name("_peer.py"))


@dataclass
class Probe:
    """One probe's outcome. ``status``: ok, fail (a guarantee is broken), unsupported, error, info."""

    name: str
    title: str
    status: str
    detail: str
    seconds: float | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PeerError(RuntimeError):
    pass


class Peer:
    """The second process (``_peer.py``), talked to over pipes, one JSON line each way."""

    def __init__(self, root: str, timeout: float) -> None:
        self.timeout = timeout
        self._buffer = b""
        # -I -S: stdlib only, no site packages, no user environment: starts in milliseconds.
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", _PEER_SCRIPT, root],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )
        self.pid = int(self._read(timeout + 5.0)["pid"])

    def ask(self, op: str, *, wait: float | None = None, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        return self._read(self.timeout if wait is None else wait)

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PeerError(f"the probe's second process did not answer within {timeout:g} s")
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise PeerError(f"the probe's second process exited (status {self.proc.poll()})")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(b'{"op": "quit"}\n')
            self.proc.stdin.close()
            self.proc.wait(2.0)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()


def _errno_name(code: int | None) -> str:
    return errno.errorcode.get(code or 0, str(code))


def _write(path: str, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)


def rename_over(scratch: str) -> Probe:
    title = "atomic rename over an existing file"
    target, tmp = os.path.join(scratch, "rename-target"), os.path.join(scratch, "rename-tmp")
    try:
        _write(target, b"old")
        _write(tmp, b"new")
        with open(target, "rb") as reader:  # a reader holding the old version open
            os.rename(tmp, target)
            with open(target, "rb") as f:
                now = f.read()
            try:
                held = reader.read()
            except OSError as exc:
                held = f"error {_errno_name(exc.errno)}".encode()
    except OSError as exc:
        return Probe("rename_over", title, "fail", f"rename failed: {exc.strerror or exc}")
    if now != b"new" or os.path.exists(tmp):
        return Probe("rename_over", title, "fail", f"after rename the name holds {now!r}, not the new file")
    if held != b"old":
        return Probe(
            "rename_over",
            title,
            "ok",
            f"replaced; a reader that had the old file open got {held!r} (ESTALE-like)",
        )
    return Probe("rename_over", title, "ok", "replaced in one step; an open reader kept the old content")


def exchange(scratch: str) -> Probe:
    title = "renameat2(RENAME_EXCHANGE)"
    a, b = os.path.join(scratch, "exchange-a"), os.path.join(scratch, "exchange-b")
    try:
        os.mkdir(a)
        os.mkdir(b)
        _write(os.path.join(a, "which"), b"a")
        exchange_entries(a, b)
    except OSError as exc:
        if exc.errno in EXCHANGE_UNSUPPORTED:
            return Probe(
                "exchange",
                title,
                "unsupported",
                f"refused ({_errno_name(exc.errno)}): no atomic directory swap",
            )
        return Probe("exchange", title, "error", f"failed: {exc.strerror or exc}")
    swapped = os.path.exists(os.path.join(b, "which")) and not os.path.exists(os.path.join(a, "which"))
    if not swapped:
        return Probe("exchange", title, "fail", "returned success but did not swap the directories")
    return Probe("exchange", title, "ok", "supported: directories swap atomically")


def exclusive_create(scratch: str, peer: Peer) -> Probe:
    title = "exclusive create (O_EXCL) between 2 processes"
    reply = peer.ask("create_excl", name="excl")
    if not reply["ok"]:
        return Probe(
            "exclusive_create",
            title,
            "error",
            f"the second process could not create: {_errno_name(reply.get('errno'))}",
        )
    try:
        fd = os.open(os.path.join(scratch, "excl"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return Probe(
            "exclusive_create", title, "ok", "excludes: a create of a name another process made fails"
        )
    except OSError as exc:
        return Probe("exclusive_create", title, "error", f"failed: {exc.strerror or exc}")
    os.close(fd)
    return Probe(
        "exclusive_create", title, "fail", "both processes created the same name: soft locks cannot work here"
    )


def lock_between(scratch: str, peer: Peer, kind: str) -> Probe:
    name = f"lock-{kind}"
    title = f"{'flock' if kind == 'flock' else 'POSIX (fcntl) lock'} between 2 processes"
    reply = peer.ask("lock", kind=kind, name=name)
    if not reply["ok"]:
        return Probe(kind, title, "unsupported", f"the lock failed: {_errno_name(reply.get('errno'))}")
    try:
        fd = os.open(os.path.join(scratch, name), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if kind == "flock":
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            else:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return Probe(kind, title, "ok", "excludes: a second process could not take it")
        except OSError as exc:
            return Probe(kind, title, "unsupported", f"the lock failed: {_errno_name(exc.errno)}")
        finally:
            os.close(fd)
    finally:
        peer.ask("unlock", name=name)
    return Probe(kind, title, "fail", "does NOT exclude: two processes held it at once")


def fsync_latency(scratch: str) -> Probe:
    title = "fsync latency"
    samples = []
    try:
        for index in range(FSYNC_SAMPLES):
            fd = os.open(os.path.join(scratch, f"fsync-{index}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, b"x" * 4096)
                start = time.perf_counter()
                os.fsync(fd)
                samples.append(time.perf_counter() - start)
            finally:
                os.close(fd)
    except OSError as exc:
        return Probe("fsync", title, "error", f"fsync failed: {exc.strerror or exc}")
    median = statistics.median(samples)
    return Probe(
        "fsync", title, "info", f"median {median * 1e3:.2f} ms of {FSYNC_SAMPLES} (4 KiB files)", median,
        {"samples": samples},
    )  # fmt: skip


def visibility(scratch: str, peer: Peer, deadline: float, *, cross_client: bool) -> Probe:
    """How long changes made here take to show in the second process (through its caches).

    Before the changes the peer looks every name up, filling its negative, dentry and attribute caches
    as a rank that checked the target moments earlier would; then all changes are made at once and the
    peer polls until each shows or the deadline passes.
    """
    who = "another client (--peer-path)" if cross_client else "a second process on this client"
    title = f"visibility to {who}"
    paths = {name: os.path.join(scratch, f"vis-{name}") for name in ("new", "negative", "removed", "grown")}
    _write(paths["removed"], b"x")
    _write(paths["grown"], b"x")
    peer.ask("stat", names=["vis-negative", "vis-removed", "vis-grown"])
    _write(paths["negative"], b"x")
    _write(paths["new"], b"x")
    os.unlink(paths["removed"])
    with open(paths["grown"], "ab") as f:  # append, never truncate
        f.write(b"y" * 4095)
    checks = [
        {"name": "vis-new", "until": "exists"},
        {"name": "vis-negative", "until": "exists"},
        {"name": "vis-removed", "until": "missing"},
        {"name": "vis-grown", "until": "size", "size": 4096},
    ]
    reply = peer.ask("watch", checks=checks, deadline=deadline, wait=deadline + 5.0)
    elapsed: list[float | None] = reply["elapsed"]
    labels = ["new file", "file created after a failed lookup", "removal", "new size"]
    data = {key: value for key, value in zip(("new", "negative", "removed", "grown"), elapsed, strict=True)}
    parts = [
        f"{label} {'after ' + human_seconds(value) if value is not None else f'NOT within {deadline:g} s'}"
        for label, value in zip(labels, elapsed, strict=True)
    ]
    worst = max((deadline if v is None else v) for v in elapsed)
    stale = any(v is None for v in elapsed)
    return Probe(
        "visibility",
        title,
        "info",
        "; ".join(parts),
        worst,
        {"elapsed": data, "deadline": deadline, "cross_client": cross_client, "stale_past_deadline": stale},
    )
