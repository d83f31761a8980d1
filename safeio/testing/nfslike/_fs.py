"""The filesystem: a passthrough of a backing directory with the NFS-like behaviours switched in.

Runs only inside the daemon process (`python -m safeio.testing.nfslike`): it imports mfusepy, and
libfuse takes over the process (chdir("/"), signal handlers).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import struct
from collections.abc import Callable, Iterator
from typing import Any

import mfusepy

from safeio.testing.nfslike._control import Handler
from safeio.testing.nfslike._counters import Counters
from safeio.testing.nfslike._faults import Faults
from safeio.testing.nfslike._handles import Handle, HandleTable, InodeKey
from safeio.testing.nfslike._hidden import HiddenFiles, caller_is_renaming, is_held, is_hidden
from safeio.testing.nfslike._interlock import Interlock
from safeio.testing.nfslike._options import Options
from safeio.testing.nfslike._revalidation import ToldInodes
from safeio.testing.nfslike._state import StateDir

logger = logging.getLogger("safeio.testing.nfslike")

_STAT_KEYS = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino", "st_blocks", "st_rdev")
_STATVFS_KEYS = (
    "f_bavail",
    "f_bfree",
    "f_blocks",
    "f_bsize",
    "f_favail",
    "f_ffree",
    "f_files",
    "f_flag",
    "f_frsize",
    "f_namemax",
)
# struct flock on Linux x86_64/aarch64: short l_type, short l_whence, off_t l_start, off_t l_len,
# pid_t l_pid (with padding).
_FLOCK = struct.Struct("hh4xqqi4x")
_OFD_CMD = {
    fcntl.F_GETLK: fcntl.F_OFD_GETLK,
    fcntl.F_SETLK: fcntl.F_OFD_SETLK,
    fcntl.F_SETLKW: fcntl.F_OFD_SETLKW,
}


def _entry_type(entry: os.DirEntry[str]) -> int:
    if entry.is_symlink():
        return stat.S_IFLNK
    if entry.is_dir(follow_symlinks=False):
        return stat.S_IFDIR
    if entry.is_file(follow_symlinks=False):
        return stat.S_IFREG
    return stat.S_IFMT(entry.stat(follow_symlinks=False).st_mode)


class NfsLikeFS(mfusepy.Operations):  # type: ignore[misc]  # mfusepy is untyped
    use_ns = True

    def __init__(self, backing: str, options: Options, state: StateDir) -> None:
        self.root = os.path.realpath(backing)
        self.options = options
        self.state = state
        self.handles = HandleTable()
        self.counters = Counters()
        self.faults = Faults(
            enospc_after=options.enospc_after,
            eio_on_fsync=options.eio_on_fsync,
            latency=options.latency,
            hang=options.hang,
            hang_timeout=options.hang_timeout,
            hang_after_bytes=options.hang_after_bytes,
        )
        self.interlock = (
            Interlock(self.handles, options.hazard_timeout, state.append_hazard)
            if options.hazard_timeout is not None
            else None
        )
        self.hidden = HiddenFiles(self.handles, silly=options.silly_rename)
        self.told = ToldInodes()
        # A root daemon creates every file as root; hand new files to the calling user as a local
        # filesystem (or an NFS server with the caller's credentials) would.
        self._chown_new = os.geteuid() == 0

    # ---- helpers -------------------------------------------------------------------------------

    def _real(self, path: str) -> str:
        """The backing location of a name. A hidden file has none that lasts: use `_at`."""
        if is_hidden(path):
            raise self._stale(path)
        return os.path.join(self.root, path.lstrip("/"))

    @contextlib.contextmanager
    def _at(self, path: str) -> Iterator[str]:
        """The backing location of `path`, valid for the block; keep one system call in it.

        Names are stable; a file libfuse hid (see _hidden.py) is held only until its last close,
        so its location is pinned for the block.
        """
        if not is_hidden(path):
            yield self._real(path)
            return
        with self.hidden.pinned(path, self._real(os.path.dirname(path))) as located:
            if located is None:
                raise self._stale(path)
            yield located

    @staticmethod
    def _stale(path: str) -> OSError:
        # A hidden file already released: its node is stale, as a deleted file's NFS handle is.
        # ESTALE (unlike ENOENT) makes the kernel redo the lookup and retry.
        return OSError(errno.ESTALE, "nfslike: stale hidden file", path)

    def _is_free_hidden_name(self, path: str | None) -> bool:
        if not is_hidden(path):
            return False
        assert path is not None
        with self.hidden.pinned(path, self._real(os.path.dirname(path))) as located:
            return located is None

    def _enter(self, *paths: str | None) -> None:
        """Start of every user-visible operation: faults (latency, hang) apply here."""
        self.faults.enter(*paths, caller=self._pid)

    def _pid(self) -> int:
        return self.counters.process_of(mfusepy.fuse_get_context()[2])

    def _count(self, pid: int, *ops: str) -> None:
        for op in ops:
            self.counters.add(pid, op)

    def _give_to_caller(self, real: str) -> None:
        if self._chown_new:
            uid, gid, _ = mfusepy.fuse_get_context()
            if os.stat(os.path.dirname(real)).st_mode & stat.S_ISGID:
                gid = -1  # a setgid directory gives new entries its own group, as on a local disk
            if uid or gid > 0:
                os.chown(real, uid, gid, follow_symlinks=False)

    def _handle(self, fh: int | None) -> Handle | None:
        return self.handles.get(fh)

    def _paths(self, path: str | None, fh: int | None) -> tuple[str | None, ...]:
        handle = self._handle(fh)
        return (path,) if handle is None else (path, handle.path)

    def _register(self, fd: int, path: str, pid: int) -> int:
        st = os.fstat(fd)
        self.handles.add(Handle(fd, (st.st_dev, st.st_ino), pid, path))
        return fd

    def _truncation(self, key: InodeKey | None, pid: int, op: str, path: str) -> Any:
        if self.interlock is None or key is None:
            return contextlib.nullcontext()
        return self.interlock.truncating(key, pid, op, path)

    def _existing_key(self, real: str) -> InodeKey | None:
        try:
            st = os.stat(real)
        except FileNotFoundError:
            return None
        return (st.st_dev, st.st_ino)

    def _before_io(self, fh: int, pid: int, op: str, path: str | None) -> None:
        handle = self._handle(fh)
        if self.interlock is not None and handle is not None:
            self.interlock.before_io(handle.key, pid, op, path or handle.path)

    # ---- attributes and names ------------------------------------------------------------------

    def getattr(self, path: str | None, fh: int | None = None) -> dict[str, Any]:
        if fh is not None:
            self._enter(*self._paths(path, fh))
            st = os.fstat(fh)
        else:
            if self._is_free_hidden_name(path):
                # libfuse probing for a free hidden name (internal): it needs ENOENT.
                raise OSError(errno.ENOENT, "nfslike: no such hidden file", path)
            self._enter(path)
            with self._at(path or "/") as real:
                st = os.stat(real, follow_symlinks=is_held(real))
            if path is not None and not is_hidden(path):
                self.told.told(path, st.st_ino)
        attrs: dict[str, Any] = {key: getattr(st, key) for key in _STAT_KEYS}
        attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return attrs

    def readlink(self, path: str) -> str:
        self._enter(path)
        return os.readlink(self._real(path))

    def readdir(self, path: str, fh: int) -> list[tuple[str, dict[str, int], int]]:
        self._enter(path)
        real = self._real(path)
        # With use_ino the kernel gets our d_ino, and readdir(3) skips entries whose d_ino is 0:
        # every entry needs its inode (and file type) filled in.
        here = os.lstat(real)
        up = os.lstat(os.path.dirname(real)) if path.strip("/") else here
        entries = [
            (".", {"st_ino": here.st_ino, "st_mode": here.st_mode}, 0),
            ("..", {"st_ino": up.st_ino, "st_mode": up.st_mode}, 0),
        ]
        with os.scandir(real) as scan:
            for entry in scan:
                try:
                    mode = _entry_type(entry)
                except FileNotFoundError:
                    continue  # removed while listing
                entries.append((entry.name, {"st_ino": entry.inode(), "st_mode": mode}, 0))
        return entries

    def statfs(self, path: str) -> dict[str, int]:
        self._enter(path)
        sv = os.statvfs(self._real(path))
        return {key: getattr(sv, key) for key in _STATVFS_KEYS}

    def chmod(self, path: str | None, mode: int, fh: int | None = None) -> None:
        self._enter(*self._paths(path, fh))
        if fh is not None:
            os.chmod(fh, stat.S_IMODE(mode))
            return
        with self._at(path or "/") as real:
            os.chmod(real, stat.S_IMODE(mode))

    def chown(self, path: str | None, uid: int, gid: int, fh: int | None = None) -> None:
        self._enter(*self._paths(path, fh))
        if fh is not None:
            os.chown(fh, uid, gid)
        else:
            with self._at(path or "/") as real:
                os.chown(real, uid, gid, follow_symlinks=is_held(real))

    def utimens(self, path: str | None, times: tuple[int | None, int | None], fh: int | None = None) -> None:
        self._enter(*self._paths(path, fh))
        if fh is not None:
            os.utime(fh, ns=self._times(times, lambda: os.fstat(fh)))
            return
        with self._at(path or "/") as real:
            follow = is_held(real)
            os.utime(
                real,
                ns=self._times(times, lambda: os.stat(real, follow_symlinks=follow)),
                follow_symlinks=follow,
            )

    @staticmethod
    def _times(
        times: tuple[int | None, int | None], current: Callable[[], os.stat_result]
    ) -> tuple[int, int]:
        atime, mtime = times
        if atime is None or mtime is None:  # UTIME_OMIT: keep the current value
            st = current()
            atime = st.st_atime_ns if atime is None else atime
            mtime = st.st_mtime_ns if mtime is None else mtime
        return atime, mtime

    def mknod(self, path: str, mode: int, dev: int) -> None:
        self._enter(path)
        os.mknod(self._real(path), mode, dev)
        self._give_to_caller(self._real(path))

    def mkdir(self, path: str, mode: int) -> None:
        self._enter(path)
        self._count(self._pid(), "mkdir")
        os.mkdir(self._real(path), mode)
        self._give_to_caller(self._real(path))

    def rmdir(self, path: str) -> None:
        self._enter(path)
        self._count(self._pid(), "rmdir")
        os.rmdir(self._real(path))

    def symlink(self, target: str, source: str) -> None:
        # mfusepy's argument names: `target` is the new link, `source` its content.
        self._enter(target)
        if self.options.no_symlinks:
            raise OSError(errno.EPERM, "nfslike: no symbolic links on this share (no_symlinks)", target)
        os.symlink(source, self._real(target))
        self._give_to_caller(self._real(target))

    def link(self, target: str, source: str) -> None:
        self._enter(target, source)
        with self._at(source) as real_source:
            os.link(real_source, self._real(target), follow_symlinks=is_held(real_source))

    def unlink(self, path: str) -> None:
        if is_hidden(path):
            # libfuse removing a hidden file after its last close (the NFS client's silly delete).
            self.hidden.drop(path)
            return
        self._enter(path)
        self._count(self._pid(), "unlink")
        real = self._real(path)
        if self.hidden.is_silly_name(real):
            # nfs_sillyrename: a file already silly-renamed and still open cannot be removed.
            raise OSError(errno.EBUSY, "nfslike: silly-renamed file is still open", path)
        os.unlink(real)
        self.told.forgot(path)

    def rename(self, old: str, new: str, flags: int = 0) -> None:
        if is_hidden(new) and not flags:
            self._hide(old, new)
            return
        self._enter(old, new)
        self._count(self._pid(), "rename")
        if flags:
            # The Linux NFS client (nfs_rename) has no RENAME_EXCHANGE/RENAME_NOREPLACE/WHITEOUT and
            # refuses them with EINVAL; honouring or dropping them would hide what NFS does.
            raise OSError(errno.EINVAL, f"nfslike: renameat2 flags {flags:#x} unsupported, as on NFS")
        os.rename(self._real(old), self._real(new))
        self.told.renamed(old, new)

    def _hide(self, path: str, hidden_path: str) -> None:
        """libfuse hides `path`, open on this mount, instead of unlinking it or before renaming
        over it (see _hidden.py)."""
        tid = mfusepy.fuse_get_context()[2]
        renaming = caller_is_renaming(tid)
        pid = self.counters.process_of(tid)
        if not renaming:  # the rename over it enters and counts itself
            self._enter(path)
            self._count(pid, "unlink")
        if self.hidden.hide(self._real(path), hidden_path, keep_name=renaming) is not None:
            self._count(pid, "silly_rename")

    # ---- files ---------------------------------------------------------------------------------

    def _open_ops(self, pid: int, flags: int, *, truncates: bool, creates: bool) -> None:
        accmode = flags & os.O_ACCMODE
        self._count(pid, "open_read" if accmode == os.O_RDONLY else "open_write")
        if truncates:
            self._count(pid, "open_trunc")
        if creates:
            self._count(pid, "open_create")

    def open(self, path: str, flags: int) -> int:
        self._enter(path)
        pid = self._pid()
        truncates = bool(flags & os.O_TRUNC)
        self._open_ops(pid, flags, truncates=truncates, creates=False)
        key = None
        if truncates:
            with self._at(path) as real:
                key = self._existing_key(real)
        with self._truncation(key, pid, "open(O_TRUNC)", path), self._at(path) as real:
            fd = os.open(real, flags)
        if not is_hidden(path):
            try:
                self.told.check_open(path, os.fstat(fd).st_ino)
            except OSError:
                os.close(fd)
                raise
        return self._register(fd, path, pid)

    def create(self, path: str, mode: int, flags: int) -> int:
        self._enter(path)
        pid = self._pid()
        real = self._real(path)
        # The kernel sends CREATE after a negative lookup, but another client may have created
        # the file since: then O_TRUNC truncates an existing, possibly open, file.
        key = self._existing_key(real)
        truncates = key is not None and bool(flags & os.O_TRUNC)
        self._open_ops(pid, flags, truncates=truncates, creates=key is None)
        with self._truncation(key if truncates else None, pid, "create(O_TRUNC)", path):
            fd = os.open(real, flags | os.O_CREAT, mode)
        if key is None:
            self._give_to_caller(real)
        return self._register(fd, path, pid)

    def truncate(self, path: str | None, length: int, fh: int | None = None) -> None:
        self._enter(*self._paths(path, fh))
        pid = self._pid()
        self._count(pid, "truncate")
        handle = self._handle(fh)
        if handle is not None:
            with self._truncation(handle.key, pid, "ftruncate", path or handle.path):
                os.truncate(handle.fh, length)
            return
        with self._at(path or "/") as real:
            key = self._existing_key(real)
        with self._truncation(key, pid, "truncate", path or "/"), self._at(path or "/") as real:
            os.truncate(real, length)

    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        self._enter(*self._paths(path, fh))
        pid = self._pid()
        self._count(pid, "read")
        self._before_io(fh, pid, "read", path)
        data = os.pread(fh, size, offset)
        self.counters.add(pid, "read_bytes", len(data))
        return data

    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        self.faults.enter(*self._paths(path, fh), write_offset=offset, caller=self._pid)
        pid = self._pid()
        self._count(pid, "write")
        self._before_io(fh, pid, "write", path)
        # A short write at the budget's edge, then ENOSPC, as a full disk behaves.
        allowed = self.faults.charge_write(len(data))
        written = os.pwrite(fh, data[:allowed], offset)
        if written < allowed:
            self.faults.refund_write(allowed - written)
        self.counters.add(pid, "write_bytes", written)
        return written

    def flush(self, path: str | None, fh: int) -> None:
        self._enter(*self._paths(path, fh))

    def fsync(self, path: str | None, datasync: int, fh: int) -> None:
        paths = self._paths(path, fh)
        self._enter(*paths)
        self._count(self._pid(), "fsync")
        self.faults.check_fsync(*paths)
        if datasync:
            os.fdatasync(fh)
        else:
            os.fsync(fh)

    def release(self, path: str | None, fh: int) -> None:
        # No faults here: the kernel sends RELEASE after close(2) has returned; nobody waits on it.
        handle, last = self.handles.remove(fh)
        os.close(fh)
        if last and handle is not None:
            self.hidden.release(handle.key)

    def fsyncdir(self, path: str, datasync: int, fh: int) -> None:
        self._enter(path)
        self._count(self._pid(), "fsyncdir")
        self.faults.check_fsync(path)
        fd = os.open(self._real(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # ---- locks: forwarded to the backing file, so they exclude across processes and mounts -----

    def flock(self, path: str, fh: int, op: int) -> None:
        self._enter(*self._paths(path, fh))
        if not op & fcntl.LOCK_UN:  # (the kernel also unlocks on every close)
            self._count(self._pid(), "flock")
        fcntl.flock(fh, op)

    def lock(self, path: str | None, fh: int, cmd: int, lock: Any) -> None:
        self._enter(*self._paths(path, fh))
        fl = lock.contents
        if cmd != fcntl.F_GETLK and fl.l_type != fcntl.F_UNLCK:
            # Not unlocks: libfuse sends one on every close of a file (flush) to drop POSIX locks.
            self._count(self._pid(), "lock")
        # POSIX locks belong to a process, but the daemon is one process for all callers: open
        # file description (OFD) locks on each handle's own backing descriptor keep callers apart.
        request = _FLOCK.pack(fl.l_type, fl.l_whence, fl.l_start, fl.l_len, 0)
        reply = fcntl.fcntl(fh, _OFD_CMD[cmd], request)
        if cmd == fcntl.F_GETLK:
            fl.l_type, fl.l_whence, fl.l_start, fl.l_len, fl.l_pid = _FLOCK.unpack(reply)

    # ---- control channel -----------------------------------------------------------------------

    def control_handlers(self) -> dict[str, Handler]:
        def ops(_: dict[str, Any]) -> dict[str, dict[str, int]]:
            snapshot = self.counters.snapshot()
            self.state.write_ops(snapshot)
            return {str(pid): counts for pid, counts in snapshot.items()}

        def reset_ops(_: dict[str, Any]) -> None:
            self.counters.reset()

        def release(_: dict[str, Any]) -> None:
            self.faults.release()

        def faults(settings: dict[str, Any]) -> None:
            self.faults.update(settings)

        def hung(_: dict[str, Any]) -> list[dict[str, Any]]:
            return self.faults.hung()

        def ping(_: dict[str, Any]) -> dict[str, Any]:
            return {"pid": os.getpid(), "root": self.root}

        return {
            "ops": ops,
            "reset_ops": reset_ops,
            "release": release,
            "faults": faults,
            "hung": hung,
            "ping": ping,
        }
