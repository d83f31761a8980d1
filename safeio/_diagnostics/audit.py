"""The audit sanitizer: find checkpoint code that writes shared files unsafely, before a cluster does.

``audit(root)`` (or ``SAFEIO_AUDIT=root`` in the environment) records every truncating open, truncate,
rename and remove under ``root`` that does not happen inside a safeio stage, with rank, pid, host and a
short stack, and then warns (a WARNING on the ``safeio`` logger), raises ``UnsafeWriteError`` (the
operation does not happen), or only records. Non-truncating opens under ``root`` are recorded too, as
context: a rank truncating a file that another rank has open is the NFS hang this library exists for.

With a record directory every process appends its records to ``audit-rank{R}-pid{P}.jsonl`` there;
``audit_report`` merges the ranks' files and lists the conflicts: two ranks writing one path, and a rank
truncating a path another rank opened (``safeio audit report DIR`` prints its report).

It sees Python-level I/O only. Python audit hooks fire in the interpreter's own ``open``/``os``
functions; a Rust or C writer (the ``tokenizers`` library writing ``tokenizer.json``, safetensors'
temporary file and rename) is invisible to it. A clean report means "no unsafe Python-level writes",
never "no unsafe writes": the NFS-like test filesystem (``safeio.testing.nfslike``) sees everything.

Not recorded as unsafe: anything inside an active stage of this process, and safeio's own files (any
path with a component named like a safeio stage, temporary, version or lock), so that safeio's own
promotion and ``atomic_open`` never count against the code under audit.

Python audit hooks cannot be removed once installed, so one process-wide hook is installed by the
first auditor and dispatches to whichever auditors are active; with none active it returns at once.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, Literal

from safeio._errors import InvalidOptionError, SafeIOError, UnsafeWriteError
from safeio._promotion import active
from safeio._storage.location import as_str_path
from safeio._storage.names import LOCK_SUFFIX, parse
from safeio._who import current_rank, host, who

logger = logging.getLogger("safeio")

OnCollective = Literal["warn", "raise", "record"]
ACTIONS: tuple[str, ...] = ("warn", "raise", "record")

OPEN = "open"  # a non-truncating open: context for conflicts, not unsafe by itself
TRUNCATING = ("open-truncate", "truncate")
UNSAFE_OPS = ("open-truncate", "truncate", "rename", "remove", "rmdir", "rmtree")
_EVENTS = frozenset({"open", "os.truncate", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree"})
_STACK_DEPTH = 8
_RECORD_GLOB_PREFIX, _RECORD_SUFFIX = "audit-rank", ".jsonl"
LIMIT_NOTE = (
    "The audit sees Python-level I/O only: writes from Rust or C code (tokenizers' tokenizer.json, "
    "safetensors) are invisible to it."
)


@dataclass(frozen=True)
class AuditRecord:
    """One audited operation. ``dest`` is a rename's destination; ``stack`` is innermost last."""

    op: str
    path: str
    rank: int | None
    pid: int
    host: str
    time: float
    stack: tuple[str, ...] = ()
    dest: str | None = None

    @property
    def unsafe(self) -> bool:
        return self.op in UNSAFE_OPS

    @property
    def process(self) -> str:
        """Who did it: ``rank R``, or ``host pid P`` when the rank is unknown."""
        return f"rank {self.rank}" if self.rank is not None else f"{self.host} pid {self.pid}"

    def paths(self) -> tuple[str, ...]:
        return (self.path,) if self.dest is None else (self.path, self.dest)

    def describe(self) -> str:
        rank = "?" if self.rank is None else self.rank
        where = f" -> {self.dest}" if self.dest is not None else ""
        at = f" at {self.stack[-1]}" if self.stack else ""
        return f"rank {rank} ({self.host} pid {self.pid}) {self.op} {self.path}{where}{at}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "path": self.path,
            "dest": self.dest,
            "rank": self.rank,
            "pid": self.pid,
            "host": self.host,
            "time": self.time,
            "stack": list(self.stack),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AuditRecord:
        rank = data.get("rank")
        return cls(
            op=str(data["op"]),
            path=str(data["path"]),
            rank=int(rank) if rank is not None else None,
            pid=int(data.get("pid", 0)),
            host=str(data.get("host", "")),
            time=float(data.get("time", 0.0)),
            stack=tuple(str(s) for s in data.get("stack", ())),
            dest=str(data["dest"]) if data.get("dest") is not None else None,
        )


class Auditor:
    """Records operations under ``root`` while started; see the module docstring."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        action: OnCollective = "warn",
        record_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if action not in ACTIONS:
            raise InvalidOptionError(f"action must be one of {', '.join(ACTIONS)}; got {action!r}", None)
        self.root = os.path.abspath(as_str_path(root, "root"))
        # Callers name files through symlinks or not; either spelling of the root must match.
        self._roots = tuple({self.root, os.path.realpath(self.root)})
        self.action: OnCollective = action
        self.record_dir = (
            os.path.abspath(as_str_path(record_dir, "record_dir")) if record_dir is not None else None
        )
        self.records: list[AuditRecord] = []  # unsafe operations
        self.opens: list[AuditRecord] = []  # non-truncating opens (context for conflicts)
        self._lock = threading.Lock()

    def start(self) -> Auditor:
        if self.record_dir is not None:
            os.makedirs(self.record_dir, exist_ok=True)
        _install_hook()
        _register(self)
        return self

    def stop(self) -> None:
        _unregister(self)

    def __enter__(self) -> Auditor:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def covers(self, path: str) -> bool:
        return any(path == root or path.startswith(root.rstrip("/") + "/") for root in self._roots)

    def record_file(self, rank: int | None, pid: int) -> str | None:
        if self.record_dir is None:
            return None
        name = f"{_RECORD_GLOB_PREFIX}{'none' if rank is None else rank}-pid{pid}{_RECORD_SUFFIX}"
        return os.path.join(self.record_dir, name)

    def _take(self, record: AuditRecord) -> None:
        with self._lock:
            (self.records if record.unsafe else self.opens).append(record)
            path = self.record_file(record.rank, record.pid)
            if path is not None:
                try:
                    _append_record(path, (json.dumps(record.to_dict()) + "\n").encode())
                except OSError as exc:  # the audit must never break the code it watches
                    logger.warning("%s: could not write the audit record file %s: %s", who(), path, exc)
        if not record.unsafe or self.action == "record":
            return
        message = (
            f"{who(record.rank)}: unsafe {record.op} of {record.path}"
            + (f" -> {record.dest}" if record.dest else "")
            + " outside a safeio stage (other ranks may be reading or writing it: write into a stage with "
            "safeio.replicated / safeio.save_pretrained, or a single file with safeio.atomic_open)\n  "
            + "\n  ".join(record.stack)
        )
        if self.action == "raise":
            raise UnsafeWriteError(message, record.path)
        logger.warning("%s", message)


def audit(
    root: str | os.PathLike[str],
    action: OnCollective = "warn",
    record_dir: str | os.PathLike[str] | None = None,
) -> Auditor:
    """Audit Python-level writes under ``root`` for the duration of a ``with`` block.

    ``action``: ``"warn"`` logs a WARNING per unsafe operation, ``"raise"`` raises ``UnsafeWriteError``
    from the operation (which then does not happen), ``"record"`` only records. The auditor's
    ``records`` lists the unsafe operations; with ``record_dir`` each process also appends them to its
    own ``audit-rank{R}-pid{P}.jsonl`` there, for ``merge_reports``.
    """
    return Auditor(root, action, record_dir)


_RECORD_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _append_record(path: str, line: bytes) -> None:
    """Append ``line`` to this process's record file: a regular file of this user's, never through a link
    or into a FIFO. The record directory may be on a share every rank writes (``SAFEIO_AUDIT_DIR``), and
    the file's name is known to anyone (rank, pid): a link planted there had the records appended to the
    file it named (anyone's, outside the share), and a FIFO made the audited write hang for ever."""
    fd = os.open(path, _RECORD_FLAGS, 0o666)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, "not a regular file of this user's", path)
        while line:
            line = line[os.write(fd, line) :]
    finally:
        os.close(fd)


# -- the process-wide hook -------------------------------------------------------------------------


class _Registry:
    """The process's one hook and the auditors it dispatches to."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.installed = False
        self.auditors: tuple[Auditor, ...] = ()  # replaced, never mutated: the hook reads it unlocked
        self.from_environment: Auditor | None = None


_registry = _Registry()
_local = threading.local()


def _install_hook() -> None:
    with _registry.lock:
        if not _registry.installed:
            sys.addaudithook(_hook)
            _registry.installed = True


def _register(auditor: Auditor) -> None:
    with _registry.lock:
        _registry.auditors = (*_registry.auditors, auditor)


def _unregister(auditor: Auditor) -> None:
    with _registry.lock:
        _registry.auditors = tuple(a for a in _registry.auditors if a is not auditor)


def _hook(event: str, args: tuple[Any, ...]) -> None:
    # Runs inside every audited operation of the process (imports, exec, sockets...): return at once
    # unless an auditor is active and the event is one it cares about.
    if not _registry.auditors or event not in _EVENTS or getattr(_local, "busy", False):
        return
    _local.busy = True  # our own opens (record files, logging) must not be audited
    try:
        _dispatch(event, args, sys._getframe(1))
    except UnsafeWriteError:
        raise
    except Exception:  # a sanitizer bug must never break the I/O it watches
        pass
    finally:
        _local.busy = False


def _fspath(value: Any) -> str | None:
    if isinstance(value, (str, bytes, os.PathLike)):
        path = os.fspath(value)
        return os.fsdecode(path)
    return None


def _resolve(value: Any, dir_fd: Any = None) -> str | None:
    """An absolute path for an audited path argument (or an fd, or a path relative to ``dir_fd``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return _fd_path(value)
    path = _fspath(value)
    if path is None:
        return None
    if not os.path.isabs(path) and isinstance(dir_fd, int) and dir_fd >= 0:
        base = _fd_path(dir_fd)
        if base is None:
            return None
        path = os.path.join(base, path)
    return os.path.abspath(path)


def _fd_path(fd: int) -> str | None:
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return path if path.startswith("/") else None


def _classify(event: str, args: tuple[Any, ...]) -> tuple[str, str, str | None] | None:
    """(op, path, dest) for an audited event, or None when it does not concern a file path."""
    if event == "open":
        if isinstance(args[0], int):
            return None  # wrapping an existing descriptor opens nothing
        path, flags = _resolve(args[0]), args[2]
        if path is None:
            return None
        truncating = isinstance(flags, int) and flags & os.O_TRUNC
        return ("open-truncate" if truncating else OPEN, path, None)
    if event == "os.truncate":
        path = _resolve(args[0])
        return ("truncate", path, None) if path is not None else None
    if event == "os.rename":
        src, dst = _resolve(args[0], args[2]), _resolve(args[1], args[3])
        return ("rename", src, dst) if src is not None and dst is not None else None
    dir_fd = args[1] if len(args) > 1 else None
    path = _resolve(args[0], dir_fd)
    if path is None:
        return None
    op = {"os.remove": "remove", "os.rmdir": "rmdir", "shutil.rmtree": "rmtree"}[event]
    return (op, path, None)


def _safeio_owned(path: str) -> bool:
    """A stage, temporary, version, link or lock of safeio, or anything inside one."""
    return any(
        part.endswith(LOCK_SUFFIX) or (".safeio-" in part and parse(part) is not None)
        for part in path.split("/")
    )


def _exempt(op: str, path: str, dest: str | None) -> bool:
    if op == "rename":
        assert dest is not None
        # safeio installs from its own stages and temporaries, and moves old versions aside.
        return (
            _safeio_owned(path)
            or _safeio_owned(dest)
            or (active.inside_stage(path) and active.inside_stage(dest))
        )
    return _safeio_owned(path) or active.inside_stage(path)


def _in_rmtree(op: str, path: str) -> bool:
    """shutil.rmtree reports itself once, then every directory it opens and entry it removes: keep the
    one rmtree record and drop the rest."""
    tree: str | None = getattr(_local, "rmtree", None)
    if op == "rmtree":
        _local.rmtree = path
        return False
    if tree is not None and op in (OPEN, "remove", "rmdir") and (path == tree or path.startswith(tree + "/")):
        return True
    _local.rmtree = None
    return False


def _dispatch(event: str, args: tuple[Any, ...], frame: FrameType | None) -> None:
    classified = _classify(event, args)
    if classified is None:
        return
    op, path, dest = classified
    auditors = [a for a in _registry.auditors if a.covers(path) or (dest is not None and a.covers(dest))]
    if not auditors or _in_rmtree(op, path) or _exempt(op, path, dest):
        return
    record = AuditRecord(
        op=op,
        path=path,
        dest=dest,
        rank=current_rank(),
        pid=os.getpid(),
        host=host(),
        time=time.time(),
        stack=_short_stack(frame),
    )
    error: UnsafeWriteError | None = None
    for auditor in auditors:
        try:
            auditor._take(record)
        except UnsafeWriteError as exc:
            error = error or exc  # every auditor records before the operation is refused
    if error is not None:
        raise error


def _short_stack(frame: FrameType | None) -> tuple[str, ...]:
    """The caller's innermost frames, outermost first, without the sanitizer's own."""
    lines: list[str] = []
    while frame is not None and len(lines) < _STACK_DEPTH:
        code = frame.f_code
        if code.co_filename != __file__:
            lines.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
        frame = frame.f_back
    return tuple(reversed(lines))


# -- SAFEIO_AUDIT ----------------------------------------------------------------------------------


def install_from_environment(environ: Mapping[str, str] | None = None) -> Auditor | None:
    """Start the process-wide auditor that ``SAFEIO_AUDIT=<root>`` asks for (once; None if unset).

    ``SAFEIO_AUDIT_DIR`` names the record directory (default: none, records stay in memory) and
    ``SAFEIO_AUDIT_ACTION`` the action (default ``warn``). Called when safeio is imported.
    """
    env = os.environ if environ is None else environ
    root = env.get("SAFEIO_AUDIT", "").strip()
    if not root or _registry.from_environment is not None:
        return _registry.from_environment
    action = env.get("SAFEIO_AUDIT_ACTION", "warn").strip() or "warn"
    if action not in ACTIONS:
        raise InvalidOptionError(
            f"SAFEIO_AUDIT_ACTION must be one of {', '.join(ACTIONS)}; got {action!r}", None
        )
    record_dir = env.get("SAFEIO_AUDIT_DIR", "").strip() or None
    auditor = _registry.from_environment = Auditor(root, action, record_dir).start()  # type: ignore[arg-type]
    logger.debug("%s: auditing Python-level writes under %s (SAFEIO_AUDIT)", who(), auditor.root)
    return auditor


def install_at_import() -> None:
    """``install_from_environment`` for ``import safeio``: a bad SAFEIO_AUDIT* value must not break the
    import of every program that uses safeio; it is logged instead (and raised by an explicit call)."""
    try:
        install_from_environment()
    except (SafeIOError, OSError) as exc:
        logger.error("%s: the audit sanitizer was not started: %s", who(), exc)
