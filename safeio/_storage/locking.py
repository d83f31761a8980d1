"""The promotion lock beside a target: one writer job at a time promotes it.

filelock's default lock is ``flock``, which does not exclude across NFS clients (and is purely local on
``nolock``/``local_lock=all`` mounts). On a network filesystem ``lock="auto"`` therefore uses filelock's
``SoftFileLease``: an exclusive-create marker refreshed by a heartbeat, which a peer may take over once
the holder has stopped refreshing it for ``lease_duration`` — so a crashed holder never blocks the
target forever. ``"strict"`` is filelock's fail-closed ``StrictSoftFileLock`` (a crashed holder's claim
needs a manual break).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from typing import Protocol

import filelock

from safeio._boundary import lock_not_acquired, os_failure
from safeio._errors import InvalidOptionError
from safeio._options import LockSetting, lease_seconds
from safeio._storage.dirfd import held_directory
from safeio._storage.lock_markers import read_marker
from safeio._storage.mounts import is_network_path
from safeio._storage.names import lock_name
from safeio._who import who

logger = logging.getLogger("safeio")


def lock_path_for(parent: str, target_name: str) -> str:
    return os.path.join(parent, lock_name(target_name))


class _SoftFileLease(filelock.SoftFileLease):
    """filelock's SoftFileLease, able to take over a dead holder's lease where exchange is refused.

    filelock takes a stale lease over with renameat2(RENAME_EXCHANGE) and, where the filesystem refuses
    it (NFS, FUSE: EINVAL), silently gives up: a holder that crashed would block the target until every
    later writer timed out (observed on the NFS-like mount: LockTimeout with the holder long dead).
    Then break the stale marker by renaming it aside and checking it is the one judged stale. A peer
    that recreated the marker in between has its marker put back; that window (microseconds, only
    ever after a holder died) is the race filelock accepts where it has no exchange at all.
    """

    def _take_over(self, marker: os.stat_result, breaker_pid: int | None) -> None:
        super()._take_over(marker, breaker_pid)
        lock_file = self.lock_file
        with contextlib.suppress(OSError):
            current = os.lstat(lock_file)
            if (current.st_ino, current.st_mtime) != (marker.st_ino, marker.st_mtime):
                return  # taken over (or replaced by a peer): nothing left to break
            aside = f"{lock_file}.break-{os.getpid()}"
            os.rename(lock_file, aside)
            if os.lstat(aside).st_ino == marker.st_ino:
                os.unlink(aside)
                logger.warning("%s: broke the expired lease %s of a dead holder", who(), lock_file)
            else:
                os.rename(aside, lock_file)


class PromotionLock(Protocol):
    """What ``held`` needs of a lock: filelock's locks and ``DirectoryFlock``."""

    @property
    def lock_file(self) -> str: ...
    @property
    def timeout(self) -> float: ...
    def acquire(self) -> object: ...
    def release(self) -> None: ...


# flock(2) unsupported here: filelock's FileLock knows the fallbacks (a soft marker).
_NO_FLOCK = frozenset({errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL})
_FIRST_POLL, _MAX_POLL = 0.001, 0.05


class DirectoryFlock:
    """An exclusive ``flock(2)`` on the lock file beside a target, opened relative to the held parent.

        On a local disk the lock is one open and one flock. filelock's ``FileLock`` takes the same lock (the
        two exclude each other: one inode, one flock) but reopens the lock by path, and the parent a save
        holds may have been renamed and replaced since it was opened — the lock must be the one in the
        directory the save promotes into — and its per-acquisition bookkeeping (fork tracking, fallback
        probes) cost 0.2 ms, a third of a small save's whole overhead. The file is opened without following a
        link and without blocking on a FIFO (a FIFO planted there locks like a file; a directory is an error
    naming the lock); nothing is ever read from or written to it. A
        filesystem without flock is handed to filelock's ``FileLock``, which falls back to a soft marker.
    """

    def __init__(
        self, parent_fd: int, name: str, shown: str, timeout: float, *, on_directory: bool = False
    ) -> None:
        self._parent_fd, self._name = parent_fd, name
        self.lock_file, self.timeout = shown, timeout
        # The parent directory itself is locked (a new open of it: a flock belongs to an open file
        # description), and no lock file is made: a checkpoint root is a framework's own directory.
        self._on_directory = on_directory
        self._fd = -1
        self._fallback: filelock.BaseFileLock | None = None

    def acquire(self) -> None:
        fd = self._open()
        deadline, pause = time.monotonic() + self.timeout, _FIRST_POLL
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise filelock.Timeout(self.lock_file) from None
                    time.sleep(min(pause, remaining))  # bounded poll: flock offers no timed wait
                    pause = min(pause * 2, _MAX_POLL)
                except OSError as exc:
                    if exc.errno not in _NO_FLOCK:
                        raise
                    os.close(fd)
                    fd = -1
                    self._fallback = filelock.FileLock(self.lock_file, timeout=self.timeout)
                    self._fallback.acquire()
                    return
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        self._fd = fd

    def _open(self) -> int:
        if self._on_directory:
            return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._parent_fd)
        flags = os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            return os.open(self._name, flags | os.O_RDWR, 0o666, dir_fd=self._parent_fd)
        except PermissionError:  # another account's lock file: a read-only descriptor locks as well
            return os.open(self._name, flags | os.O_RDONLY, 0o666, dir_fd=self._parent_fd)

    def release(self) -> None:
        if self._fallback is not None:
            self._fallback.release()
            self._fallback = None
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)  # closing the only descriptor releases the flock


def make_lock(
    path: str,
    setting: LockSetting,
    timeout: float,
    lease_duration: float | None = None,
    *,
    parent_fd: int | None = None,
    on_directory: bool = False,
) -> PromotionLock | None:
    """The lock ``setting`` names for ``path``; a lease lives ``lease_duration`` s (default: from the
    environment). With ``parent_fd`` (``path``'s directory, held), a local flock is taken through it; with
    ``on_directory`` too, on the directory itself, and no file is made at ``path`` (soft locks and leases
    still make theirs, only while held)."""
    if setting is False:
        return None
    kind = setting
    if setting is True:
        kind = "flock"
    elif setting == "auto":
        kind = "lease" if is_network_path(os.path.dirname(path)) else "flock"
    if kind == "flock":
        if parent_fd is not None:
            return DirectoryFlock(parent_fd, os.path.basename(path), path, timeout, on_directory=on_directory)
        return filelock.FileLock(path, timeout=timeout)
    if kind == "lease":
        return _SoftFileLease(
            path,
            timeout=timeout,
            lease_duration=lease_seconds() if lease_duration is None else lease_duration,
        )
    if kind == "strict":
        return filelock.StrictSoftFileLock(path, timeout=timeout)
    raise InvalidOptionError(
        f"lock must be True, False, 'auto', 'flock', 'lease' or 'strict', got {setting!r}", None
    )


@contextlib.contextmanager
def held(lock: PromotionLock | None, target: str, rank: int) -> Iterator[None]:
    """Hold ``lock`` (if any) for the block; a lock not acquired in time raises LockTimeout."""
    if lock is None:
        yield
        return
    started = time.monotonic()
    try:
        lock.acquire()
    except filelock.Timeout as exc:
        holder = getattr(exc, "_holder", None) or _describe_holder(lock)
        raise lock_not_acquired(lock.lock_file, target, rank, lock.timeout, holder) from exc
    except OSError as exc:  # the lock file itself: not writable, a directory, a FIFO...
        raise os_failure(
            f"cannot take the promotion lock {lock.lock_file} for {target}", lock.lock_file, exc
        ) from exc
    acquired = time.monotonic()
    debug = logger.isEnabledFor(logging.DEBUG)  # who() is work: not on every save for lines not shown
    if debug:
        logger.debug("%s: lock %s acquired in %.1f ms", who(rank), lock.lock_file, (acquired - started) * 1e3)
    try:
        yield
    finally:
        lock.release()
        if debug:
            logger.debug(
                "%s: lock %s held for %.1f ms", who(rank), lock.lock_file, (time.monotonic() - acquired) * 1e3
            )


def _describe_holder(lock: PromotionLock) -> str | None:
    # Soft locks record their owner (pid, host) in the marker; flock records nothing. The marker is read
    # as the untrusted input it is: relative to the held parent, never through a link, never a FIFO.
    parent, name = os.path.split(lock.lock_file)
    try:
        with held_directory(parent or ".", follow=True) as parent_fd:
            marker = read_marker(parent_fd, name)
    except OSError:
        return None
    if marker is None or marker.holder is None:
        return None
    described = f"pid {marker.holder.pid} on {marker.holder.host}"
    if marker.st.st_uid != os.geteuid() and marker.holder.alive() is False:
        # A dead holder's marker this user may not break (another user's, in a sticky share): named, so
        # that the one who can remove it knows what to remove.
        described += (
            f", which is gone; the marker belongs to uid {marker.st.st_uid} and only they (or their "
            "`safeio gc`) can remove it"
        )
    return described
