"""Where foreign errors become safeio errors: one table, used by every entry point.

Like httpx's ``map_httpcore_exceptions``: the type is chosen by what failed (an errno, the step that
failed), never by words in a message, and the foreign error stays attached as the cause
(``raise Mapped(msg) from exc``). Rust writers (``tokenizers`` writing ``tokenizer.json``, safetensors
writing weights) raise their own types carrying ``std::io::Error``'s text; they are recognised here too,
so that a full disk reaches the caller as a ``PromotionError`` with its errno whatever wrote the file.
"""

from __future__ import annotations

import contextlib
import errno
import re
import sys
from collections.abc import Iterator

from safeio._errors import InvalidTargetError, LockTimeout, PromotionError, SafeIOError

# Errnos that mean "the path you gave cannot hold a directory": a component is a file, or the name is
# taken by something that is not a directory. They are the caller's input, not an I/O failure.
NOT_A_DIRECTORY = frozenset({errno.ENOTDIR, errno.EEXIST})

# Rust's io::Error text, e.g. "No space left on device (os error 28)".
_RUST_IO_ERROR = re.compile(r"\(os error (\d+)\)")


def os_failure(
    message: str, path: str, exc: OSError, *, invalid: frozenset[int] = frozenset()
) -> SafeIOError:
    """The safeio error for ``exc``: InvalidTargetError for an errno in ``invalid``, else PromotionError."""
    if isinstance(exc, SafeIOError):
        return exc
    if exc.errno in invalid:
        return InvalidTargetError(f"{message}: a component of the path is not a directory ({exc})", path)
    return PromotionError(f"{message}: {exc.strerror or exc}", path, errno=exc.errno)


@contextlib.contextmanager
def mapped(message: str, path: str, *, invalid: frozenset[int] = frozenset()) -> Iterator[None]:
    """Run the block; an OSError (or an fsspec ValueError) leaving it becomes a safeio error."""
    try:
        yield
    except SafeIOError:
        raise
    except OSError as exc:
        raise os_failure(message, path, exc, invalid=invalid) from exc
    except ValueError as exc:  # fsspec back-ends raise ValueError for malformed keys and buckets
        raise PromotionError(f"{message}: {exc}", path) from exc


def io_errno(error: BaseException) -> int | None:
    """The errno of an I/O failure raised by a save body (Python OSError or a Rust io::Error), else None."""
    if isinstance(error, SafeIOError):
        return None
    if isinstance(error, OSError):
        return error.errno if error.errno is not None else 0
    # safetensors raises its own SafetensorError with the io::Error text: without this, a full disk
    # while saving a model reached the caller as a bare SafetensorError, no errno.
    rust = type(error) is Exception or type(error).__module__.startswith("safetensors")
    match = _RUST_IO_ERROR.search(str(error)) if rust else None
    return int(match.group(1)) if match else None


def body_failure(error: BaseException, target: str, rank: int) -> PromotionError | None:
    """A PromotionError naming the target for an I/O failure inside a save body; None for other errors."""
    number = io_errno(error)
    if number is None:
        return None
    mapped_error = PromotionError(
        f"rank {rank}: writing the stage of {target} failed: {error}", target, errno=number
    )
    mapped_error.__cause__ = error
    return mapped_error


def lock_not_acquired(
    lock_file: str, target: str, rank: int, timeout: float, holder: str | None
) -> LockTimeout:
    """filelock's Timeout, as the LockTimeout that names the lock file, the target and the holder."""
    held_by = f", held by {holder}" if holder else ""
    return LockTimeout(
        f"rank {rank}: could not acquire the promotion lock {lock_file} for {target} "
        f"within {timeout:g} s{held_by}",
        lock_file,
        holder=holder,
    )


def attach_cleanup_error(primary: BaseException, cleanup: BaseException) -> None:
    """Keep the first error the one raised, with the cleanup's failure attached to it."""
    if primary.__context__ is None:
        primary.__context__ = cleanup
    if hasattr(primary, "add_note"):
        primary.add_note(f"safeio: cleanup after this error also failed: {cleanup!r}")


def store_timed_out(error: BaseException) -> bool:
    """Whether a failed ``store.wait`` only ran out of time (the key is not set yet), rather than the
    store being unreachable (c10d's DistNetworkError: rank 0, its host, has exited or is cut off).
    torch is looked up, never imported: a group with a store means torch.distributed is loaded."""
    if isinstance(error, TimeoutError):
        return True
    dist = sys.modules.get("torch.distributed")
    network_error = getattr(dist, "DistNetworkError", None)
    if network_error is not None and isinstance(error, network_error):
        return False
    store_error = getattr(dist, "DistStoreError", None)
    return store_error is not None and isinstance(error, store_error)
