"""safeio's exceptions: one root, each carrying the path it concerns, each picklable.

    SafeIOError                      (root; .path)
    ├── InvalidTargetError           (ValueError)       bad input: empty path, a file where a directory goes
    ├── InvalidOptionError           (ValueError)       a bad argument or SAFEIO_* variable
    │   └── InvalidTypeError         (TypeError too)    an argument of the wrong type (a path that is None)
    ├── TargetExistsError            (FileExistsError)  mode="error" and the target exists
    ├── PromotionError               (OSError)          the writer could not stage, sync or promote
    ├── LockTimeout                  (TimeoutError)     the promotion lock was not acquired in time
    ├── PeerTimeout                  (TimeoutError)     a rank waited past its timeout for the writer
    ├── RemoteWriterError                               raised on non-writers when the writer failed
    ├── CheckpointError              (RuntimeError)     a checkpoint was not committed
    ├── CollectiveMismatch           (RuntimeError)     ranks made different collective calls on a root
    ├── CollectiveInWriterSection    (RuntimeError)     a collective inside a writer-only section
    ├── UnsupportedSaveError         (TypeError)        an object or option safeio cannot save safely
    └── UnsafeWriteError                                the audit sanitizer found an unsafe write

Errors cross process boundaries in distributed code (a writer's failure is shipped to its peers, a
spawned rank's failure to its parent), so every class pickles with its attributes intact.
"""

from __future__ import annotations

import errno
import os
from typing import Any


def _restore(cls: type[SafeIOError], args: tuple[Any, ...], state: dict[str, Any]) -> SafeIOError:
    error = cls.__new__(cls)
    BaseException.__init__(error, *args)
    for name, value in state.items():
        setattr(error, name, value)  # setattr: OSError's errno, strerror, filename are not in __dict__
    return error


class SafeIOError(Exception):
    """Root of every error safeio raises. ``path`` is the target (or lock, or file) concerned."""

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(message)
        self.path: str | None = os.fspath(path) if path is not None else None

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        state = dict(self.__dict__)
        if isinstance(self, OSError):
            state.update(errno=self.errno, strerror=self.strerror, filename=self.filename)
        return (_restore, (type(self), self.args, state))


class InvalidTargetError(SafeIOError, ValueError):
    """The target cannot be written as asked (empty, a file where a directory goes, a foreign symlink)."""


class InvalidOptionError(SafeIOError, ValueError):
    """An argument or ``SAFEIO_*`` environment variable has a value safeio cannot use; names which."""


class InvalidTypeError(InvalidOptionError, TypeError):
    """An argument of the wrong type (a path that is None or a number, text that is not a str); names the
    argument. Also a ``TypeError``, which Python raised for these before safeio named them, so code
    catching that still does."""


class TargetExistsError(SafeIOError, FileExistsError):
    """``mode="error"`` (or exclusive creation) and the target already exists. Like the
    ``FileExistsError`` the OS raises, ``errno`` is ``EEXIST`` and ``filename`` the path, so code written
    for ``open(path, "x")`` (python-atomicwrites' callers, for one) handles it unchanged."""

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(message, path)
        self.errno = errno.EEXIST
        self.strerror = os.strerror(errno.EEXIST)
        self.filename = self.path


class PromotionError(SafeIOError, OSError):
    """The writer could not stage, sync or promote; ``errno`` is the underlying OS error's, if any."""

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None, errno: int | None = None):
        super().__init__(message, path)
        self.errno = errno


class LockTimeout(SafeIOError, TimeoutError):
    """The promotion lock was not acquired within the timeout; ``holder`` describes its holder if known."""

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None, holder: str | None = None):
        super().__init__(message, path)
        self.holder = holder


class PeerTimeout(SafeIOError, TimeoutError):
    """A rank waited past its timeout for another rank (``waited_for``), which was last reported in
    ``phase``. In a checkpoint's calls also: ``step`` (None for ``latest()``), ``elapsed`` (seconds this
    rank waited) and, for a rank that gave up inside ``save``, ``outcome``: ``"not committed"`` (the
    writer sees this rank gave up and commits nothing) or ``"unknown"`` (the writer had already begun the
    commit's rename: ``latest()`` tells whether the step is committed)."""

    def __init__(
        self,
        message: str,
        path: str | os.PathLike[str] | None = None,
        *,
        waited_for: int | None = None,
        phase: str | None = None,
        step: int | None = None,
        elapsed: float | None = None,
        outcome: str | None = None,
    ) -> None:
        super().__init__(message, path)
        self.waited_for = waited_for
        self.phase = phase
        self.step = step
        self.elapsed = elapsed
        self.outcome = outcome


class RemoteWriterError(SafeIOError):
    """The writer rank failed; raised on every other rank with the writer's error type and message."""

    def __init__(
        self,
        message: str,
        path: str | os.PathLike[str] | None = None,
        *,
        writer_rank: int | None = None,
        error_type: str | None = None,
        error_message: str | None = None,
    ) -> None:
        super().__init__(message, path)
        self.writer_rank = writer_rank
        self.error_type = error_type
        self.error_message = error_message


class CheckpointError(SafeIOError, RuntimeError):
    """A checkpoint was not committed: ranks failed (``failed``: rank -> error) or never reported
    (``missing``). Raised on every rank; nothing is committed and ``latest`` is unchanged."""

    def __init__(
        self,
        message: str,
        path: str | os.PathLike[str] | None = None,
        *,
        failed: dict[int, str] | None = None,
        missing: list[int] | None = None,
    ) -> None:
        super().__init__(message, path)
        self.failed = dict(failed or {})
        self.missing = list(missing or [])


class CollectiveMismatch(SafeIOError, RuntimeError):
    """The ranks of a group made different collective calls of one checkpoint root at the same place
    in their sequence of calls: a rank skipped a ``save``/``latest()``/``at()``/``steps()`` the others
    made, or made one more. ``call`` is that place (1, 2, ...; None if unknown), ``calls`` what each rank
    named made there (rank -> "save of step 5", "latest()"). Raised on every rank of that call at once,
    where each would otherwise wait out its timeout for keys the others never set."""

    def __init__(
        self,
        message: str,
        path: str | os.PathLike[str] | None = None,
        *,
        call: int | None = None,
        calls: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message, path)
        self.call = call
        self.calls = dict(calls or {})


class CollectiveInWriterSection(SafeIOError, RuntimeError):
    """A torch.distributed collective was called while only the writer runs (it would deadlock)."""


class UnsupportedSaveError(SafeIOError, TypeError):
    """An object without ``save_pretrained``, or an option that is not a file write (``push_to_hub``)."""


class UnsafeWriteError(SafeIOError):
    """The audit sanitizer saw a truncating or destructive write to a shared path outside a safeio stage."""
