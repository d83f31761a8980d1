"""The parent side: start the daemon process, wait for the mount, talk to it, tear it down.

The daemon is always a separate process: libfuse chdir("/")s and installs signal handlers in the
process that mounts, which must never be a test process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from safeio.testing.nfslike import _control, _mountinfo
from safeio.testing.nfslike._faults import FAULT_NAMES
from safeio.testing.nfslike._options import Options
from safeio.testing.nfslike._state import StateDir

logger = logging.getLogger("safeio.testing.nfslike")

_PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # the directory holding safeio/
_POLL = 0.01


class NfsLikeError(RuntimeError):
    """The NFS-like filesystem could not be mounted or unmounted."""

    def __init__(self, message: str, mountpoint: str | os.PathLike[str]) -> None:
        super().__init__(f"{message} [mountpoint {os.fspath(mountpoint)}]")
        self.mountpoint = os.fspath(mountpoint)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.mountpoint))


class OpCounts(dict[int, dict[str, int]]):
    """Operation counts: process id -> operation name -> count (see `_counters.OPS`)."""

    def of(self, pid: int) -> dict[str, int]:
        """The counts of one process (empty if it did nothing on the mount)."""
        return self.get(pid, {})

    def total(self, pids: Iterable[int] | None = None) -> dict[str, int]:
        """Counts summed over `pids` (default: every process)."""
        chosen = self.keys() if pids is None else pids
        summed: dict[str, int] = {}
        for pid in chosen:
            for op, n in self.get(pid, {}).items():
                summed[op] = summed.get(op, 0) + n
        return summed


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        return path.read_bytes()[-limit:].decode(errors="replace").strip()
    except OSError:
        return ""


class Mount:
    """One NFS-like mount (one emulated NFS client) of `backing` at `mountpoint`.

    Use as a context manager, or call `start()` and `stop()`. Keyword `options` are the fields of
    `Options` (hazard_timeout, silly_rename, entry_timeout, ...). The state directory (hazard
    log, counter snapshot, daemon log) is `state_dir`, or a temporary directory removed at
    `stop()`; hazards and counters stay readable from this object after `stop()`.

    The daemon dies with the thread that started it (PR_SET_PDEATHSIG): start mounts from a
    thread that outlives them, such as the main thread.
    """

    def __init__(
        self,
        backing: str | os.PathLike[str],
        mountpoint: str | os.PathLike[str],
        *,
        state_dir: str | os.PathLike[str] | None = None,
        start_timeout: float = 10.0,
        stop_timeout: float = 10.0,
        **options: Any,
    ) -> None:
        self.backing = Path(os.path.realpath(backing))
        self.path = Path(os.path.realpath(mountpoint))
        self.options = Options(**options)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._state_dir = None if state_dir is None else Path(state_dir)
        self._state: StateDir | None = None
        self._own_state = state_dir is None
        self._control = f"safeio-nfslike-{os.getpid()}-{secrets.token_hex(6)}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._final_ops: OpCounts | None = None
        self._final_hazards: list[dict[str, Any]] | None = None

    def __repr__(self) -> str:
        state = "mounted" if self._proc is not None else "not mounted"
        return f"<nfslike.Mount {self.backing} at {self.path} ({state})>"

    # ---- lifecycle -----------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The daemon's process id while mounted."""
        return None if self._proc is None else self._proc.pid

    @property
    def state_dir(self) -> Path:
        if self._state is None:
            raise NfsLikeError("not started", self.path)
        return self._state.path

    def start(self) -> Mount:
        if self._proc is not None:
            raise NfsLikeError("already mounted", self.path)
        if not self.backing.is_dir():
            raise NfsLikeError(f"backing directory {self.backing} does not exist", self.path)
        self._clear_stale()
        self.path.mkdir(parents=True, exist_ok=True)
        if self._state_dir is None:
            self._state_dir = Path(tempfile.mkdtemp(prefix="nfslike-state-"))
        self._state_dir.mkdir(parents=True, exist_ok=True)
        self._state = StateDir(self._state_dir)
        self._state.clear()
        self._final_ops = self._final_hazards = None
        self._log = open(self._state.daemon_log, "ab")  # noqa: SIM115  # closed in stop()
        command = [
            sys.executable,
            "-m",
            "safeio.testing.nfslike",
            str(self.backing),
            str(self.path),
            "--state-dir",
            str(self._state.path),
            "--control",
            self._control,
            "--parent-pid",
            str(os.getpid()),
            *self.options.to_argv(),
        ]
        env = dict(os.environ)
        env.setdefault("FUSE_LIBRARY_NAME", "fuse3")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        logger.debug("starting nfslike daemon: %s", " ".join(command))
        # cwd "/": a daemon whose working directory is inside another mount would keep it busy.
        self._proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd="/"
        )
        try:
            self._wait_mounted()
        except BaseException:
            self._reap(self.stop_timeout)
            if self._own_state:  # the error already carries the daemon log's tail
                shutil.rmtree(self._state.path, ignore_errors=True)
            raise
        logger.debug("mounted %s at %s (daemon pid %d)", self.backing, self.path, self._proc.pid)
        return self

    def _wait_mounted(self) -> None:
        assert self._proc is not None
        assert self._state is not None
        deadline = time.monotonic() + self.start_timeout
        while True:
            entry = _mountinfo.find(str(self.path))
            if entry is not None and entry.fstype == _mountinfo.FSTYPE:
                return
            code = self._proc.poll()
            if code is not None:
                raise NfsLikeError(
                    f"nfslike daemon exited with status {code} before mounting: "
                    f"{_tail(self._state.daemon_log)}",
                    self.path,
                )
            if time.monotonic() > deadline:
                raise NfsLikeError(
                    f"not mounted after {self.start_timeout} s: {_tail(self._state.daemon_log)}", self.path
                )
            time.sleep(_POLL)

    def _clear_stale(self) -> None:
        entry = _mountinfo.find(str(self.path))
        if entry is None:
            return
        if entry.fstype != _mountinfo.FSTYPE:
            raise NfsLikeError(f"something else ({entry.fstype}) is mounted there", self.path)
        # A crashed run without auto_unmount leaves a dead mount ("Transport endpoint is not
        # connected") that would make every later start fail.
        logger.warning("removing a stale nfslike mount at %s", self.path)
        if _mountinfo.unmount(str(self.path), timeout=self.stop_timeout) is None:
            raise NfsLikeError("could not remove a stale nfslike mount", self.path)

    def stop(self) -> None:
        """Unmount (lazily when busy) and reap the daemon; bounded by `stop_timeout` and a kill."""
        if self._proc is None:
            return
        try:
            with contextlib.suppress(_control.ControlError):
                self._final_ops = self._read_ops(timeout=2.0)
                # Hung operations would keep the mount busy and the daemon's threads blocked.
                _control.request(self._control, "release", timeout=2.0)
            wait = self.stop_timeout
            entry = _mountinfo.find(str(self.path))
            if entry is not None and entry.fstype == _mountinfo.FSTYPE:
                outcome = _mountinfo.unmount(str(self.path), timeout=self.stop_timeout)
                if outcome is None:
                    logger.warning("could not unmount %s; killing its daemon", self.path)
                if outcome != "clean":
                    # Detached while still in use: the daemon would serve the remaining users
                    # indefinitely; they get ENOTCONN once it is gone, as teardown intends.
                    wait = min(wait, 1.0)
            self._reap(wait)
        finally:
            self._final_hazards = self._state.read_hazards() if self._state is not None else []
            if self._final_ops is None and self._state is not None:
                self._final_ops = OpCounts(self._state.read_ops())
            if self._own_state and self._state is not None:
                shutil.rmtree(self._state.path, ignore_errors=True)

    def _reap(self, wait: float) -> None:
        proc, self._proc = self._proc, None
        try:
            if proc is None:
                return
            for stop in (None, proc.terminate, proc.kill):
                if stop is not None:
                    logger.warning("nfslike daemon %d did not exit; %s", proc.pid, stop.__name__)
                    stop()
                try:
                    proc.wait(wait)
                    return
                except subprocess.TimeoutExpired:
                    wait = 2.0
            logger.warning("nfslike daemon %d survived SIGKILL for %s s", proc.pid, wait)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None

    def __enter__(self) -> Mount:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ---- observing and steering the daemon -----------------------------------------------------

    def _request(self, cmd: str, **args: Any) -> Any:
        if self._proc is None:
            raise NfsLikeError(f"cannot {cmd}: not mounted", self.path)
        return _control.request(self._control, cmd, **args)

    def _read_ops(self, timeout: float = 10.0) -> OpCounts:
        raw = _control.request(self._control, "ops", timeout=timeout)
        return OpCounts({int(pid): counts for pid, counts in raw.items()})

    def hazards(self) -> list[dict[str, Any]]:
        """Hazard records so far: dicts with kind, op, path, truncater, others, waited, time."""
        if self._proc is None and self._final_hazards is not None:
            return list(self._final_hazards)
        return [] if self._state is None else self._state.read_hazards()

    def ops(self) -> OpCounts:
        """Operation counts per client process, exact for every syscall that has returned."""
        if self._proc is None:
            return OpCounts(self._final_ops or {})
        return self._read_ops()

    def reset_ops(self) -> None:
        self._request("reset_ops")

    def release(self) -> None:
        """Let operations hung by the `hang` fault proceed, and stop hanging new ones."""
        self._request("release")

    def hung(self) -> list[dict[str, Any]]:
        """The operations the `hang` fault holds now: dicts with the calling process's pid and the
        mount-relative path (a test waits for this, then kills that process mid-operation)."""
        return list(self._request("hung"))

    def set_faults(self, **faults: Any) -> None:
        """Change faults while mounted: enospc_after (restarts the budget), eio_on_fsync, latency,
        hang (re-armed until the next `release()`), hang_timeout, hang_after_bytes (with hang: only
        writes that start that far or further into a matching file hang)."""
        unknown = set(faults) - set(FAULT_NAMES)
        if unknown:
            raise TypeError(f"unknown nfslike faults {sorted(unknown)}; known: {list(FAULT_NAMES)}")
        self._request("faults", **faults)


def mount(
    backing: str | os.PathLike[str],
    mountpoint: str | os.PathLike[str],
    *,
    state_dir: str | os.PathLike[str] | None = None,
    start_timeout: float = 10.0,
    stop_timeout: float = 10.0,
    **options: Any,
) -> Mount:
    """Mount `backing` at `mountpoint` for the duration of a `with` block::

    with mount(backing, mnt, hazard_timeout=1.0, silly_rename=True) as m:
        ...
        assert m.hazards() == []
    """
    return Mount(
        backing,
        mountpoint,
        state_dir=state_dir,
        start_timeout=start_timeout,
        stop_timeout=stop_timeout,
        **options,
    )
