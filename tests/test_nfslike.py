"""The NFS-like FUSE filesystem: real mounts, real processes, each emulated behaviour."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import queue
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from safeio.testing import nfslike
from safeio.testing.nfslike import Mount, mount
from safeio.testing.pytest_plugin import require_fuse, skip_or_fail
from tests._bounds import PATIENT

pytestmark = pytest.mark.timeout(600)  # a net for a hung FUSE request; generous under load (issue 37)

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


class Child:
    """A Python child process that reports JSON lines on stdout and reads commands from stdin."""

    def __init__(self, code: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        self.pid = self.proc.pid
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def expect(self, timeout: float = PATIENT) -> Any:
        """The child's next JSON line (bounded wait)."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"child {self.pid} said nothing for {timeout} s") from None
        if line is None:
            assert self.proc.stderr is not None
            raise AssertionError(f"child {self.pid} exited: {self.proc.wait()} {self.proc.stderr.read()}")
        return json.loads(line)

    def send(self, line: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = PATIENT) -> int:
        assert self.proc.stdin is not None
        if not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


# A child that opens a file, says so, and holds it until stdin closes.
HOLD_OPEN = """
    import json, sys
    f = open(sys.argv[1], sys.argv[2])
    print(json.dumps("open"), flush=True)
    sys.stdin.read()
"""


@contextlib.contextmanager
def raises_errno(code: int) -> Iterator[None]:
    """Expect an OSError with errno `code`."""
    with pytest.raises(OSError, match=re.escape(os.strerror(code))) as raised:
        yield
    assert raised.value.errno == code


def wait_until(predicate: Callable[[], bool], timeout: float = PATIENT, what: str = "condition") -> float:
    """Poll `predicate` until true; returns the seconds it took (bounded generously: the outcome is the
    subject, and load only delays it, issue 37)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.01)
    return time.monotonic() - start


def renameat2(old: Path, new: Path, flags: int) -> int:
    """renameat2(2) through libc; returns 0 or the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(-100, os.fsencode(old), -100, os.fsencode(new), flags) == 0:  # AT_FDCWD
        return 0
    return ctypes.get_errno()


# ---- passthrough ------------------------------------------------------------------------------


def test_passthrough_mirrors_the_backing_directory(nfslike_mount: Mount) -> None:
    mnt, back = nfslike_mount.path, nfslike_mount.backing
    (mnt / "d").mkdir()
    (mnt / "d" / "f").write_bytes(b"hello")
    assert (back / "d" / "f").read_bytes() == b"hello"
    (back / "from-backing").write_text("x")
    assert (mnt / "from-backing").read_text() == "x"
    with open(mnt / "d" / "f", "ab") as appending:
        appending.write(b" world")
    with open(mnt / "d" / "f", "r+b") as updating:
        updating.seek(6)
        assert updating.read() == b"world"
        updating.truncate(5)
    assert (back / "d" / "f").read_bytes() == b"hello"
    assert sorted(os.listdir(mnt)) == ["d", "from-backing"]
    # Modes arrive exactly as the caller's umask left them (the daemon's umask is 0).
    old_umask = os.umask(0o027)
    try:
        os.close(os.open(mnt / "m", os.O_CREAT | os.O_WRONLY, 0o666))
        (mnt / "md").mkdir(0o777)
    finally:
        os.umask(old_umask)
    assert (back / "m").stat().st_mode & 0o777 == 0o640
    assert (back / "md").stat().st_mode & 0o777 == 0o750
    os.chmod(mnt / "m", 0o600)
    assert (back / "m").stat().st_mode & 0o777 == 0o600
    os.utime(mnt / "m", ns=(1_000_000_000, 2_000_000_000))
    assert (back / "m").stat().st_mtime_ns == 2_000_000_000
    os.symlink("d/f", mnt / "link")
    assert os.readlink(back / "link") == "d/f"
    assert (mnt / "link").read_bytes() == b"hello"
    os.link(mnt / "d" / "f", mnt / "hard")
    assert (mnt / "hard").stat().st_ino == (back / "d" / "f").stat().st_ino
    os.replace(mnt / "hard", mnt / "m")
    assert (back / "m").read_bytes() == b"hello"
    assert os.statvfs(mnt).f_bsize > 0
    assert not os.path.exists(mnt / "missing")
    for name in ("m", "link", "from-backing", "d/f"):
        (mnt / name).unlink()
    (mnt / "md").rmdir()
    (mnt / "d").rmdir()
    assert os.listdir(back) == []


def test_an_unlinked_open_file_stays_usable(nfslike_mount: Mount) -> None:
    # Local semantics without silly rename: the name is gone at once, the open file still works
    # (no ESTALE from fstat, as libfuse's hard_remove would give), its directory can be removed.
    mnt, back = nfslike_mount.path, nfslike_mount.backing
    (mnt / "d").mkdir()
    (mnt / "d" / "f").write_bytes(b"hello")
    with open(mnt / "d" / "f", "r+b") as f:
        os.unlink(mnt / "d" / "f")
        assert os.listdir(back / "d") == []
        assert os.fstat(f.fileno()).st_size == 5
        assert f.read() == b"hello"
        f.write(b"!")
        f.flush()
        assert os.fstat(f.fileno()).st_size == 6
        os.rmdir(mnt / "d")
    assert os.listdir(back) == []
    assert nfslike_mount.ops().of(os.getpid())["unlink"] == 1


@pytest.mark.parametrize("silly", [False, True], ids=["held", "silly"])
def test_a_hidden_file_stays_where_it_was_located_until_the_block_ends(tmp_path: Path, silly: bool) -> None:
    # A reader that looked the name up before a rename opens the old file through libfuse's
    # hidden name while the last other handle may be closing. Its location (a held descriptor or
    # a .nfs name) must outlive that open: releasing it meanwhile gave the reader ENOENT.
    from safeio.testing.nfslike._handles import Handle, HandleTable
    from safeio.testing.nfslike._hidden import HiddenFiles

    real = tmp_path / "tokenizer.json"
    real.write_text("old")
    handles = HandleTable()
    fd = os.open(real, os.O_RDONLY)
    st = os.fstat(fd)
    handles.add(Handle(fd, (st.st_dev, st.st_ino), os.getpid(), "/tokenizer.json"))
    hidden = HiddenFiles(handles, silly=silly)
    hidden.hide(str(real), "/.fuse_hidden0001", keep_name=False)
    with hidden.pinned("/.fuse_hidden0001", str(tmp_path)) as located:
        assert located is not None
        handles.remove(fd)
        os.close(fd)
        releasing = threading.Thread(target=hidden.release, args=((st.st_dev, st.st_ino),))
        releasing.start()
        releasing.join(0.5)
        assert releasing.is_alive(), "the release did not wait for the pinned location"
        with open(located, encoding="utf-8") as old:
            assert old.read() == "old"
    releasing.join(PATIENT)
    assert not releasing.is_alive()
    with hidden.pinned("/.fuse_hidden0001", str(tmp_path)) as located:
        assert located is None
    assert os.listdir(tmp_path) == []


def test_mountinfo_shows_fuse_nfslike(nfslike_mount: Mount) -> None:
    with open("/proc/self/mountinfo", encoding="utf-8") as info:
        lines = [line.split() for line in info]
    [fields] = [f for f in lines if f[4] == str(nfslike_mount.path)]
    assert fields[fields.index("-") + 1] == "fuse.nfslike"


# ---- inode interlock --------------------------------------------------------------------------


@pytest.mark.fuse_opts(hazard_timeout=0.5)
@pytest.mark.parametrize("how", ["open(O_TRUNC)", "truncate", "ftruncate"])
def test_truncating_a_file_open_elsewhere_deadlocks(nfslike_mount: Mount, how: str) -> None:
    target = nfslike_mount.path / "tokenizer.json"
    target.write_text("old content")
    reader = Child(HOLD_OPEN, str(target), "r")
    try:
        assert reader.expect() == "open"
        start = time.monotonic()
        with pytest.raises(OSError, match="deadlock") as raised:
            if how == "open(O_TRUNC)":
                open(target, "w").close()
            elif how == "truncate":
                os.truncate(target, 0)
            else:
                with open(target, "r+") as f:
                    f.truncate(0)
        waited = time.monotonic() - start
    finally:
        reader.finish()
    assert raised.value.errno == errno.EDEADLK
    assert waited >= 0.5
    assert (nfslike_mount.backing / "tokenizer.json").read_text() == "old content"
    [hazard] = nfslike_mount.hazards()
    assert hazard["kind"] == nfslike.TRUNCATE_BLOCKED
    assert hazard["op"] == how
    assert hazard["path"] == "/tokenizer.json"
    assert hazard["truncater"] == os.getpid()
    assert hazard["others"] == [reader.pid]
    assert hazard["waited"] >= 0.5
    assert hazard["time"] == pytest.approx(time.time(), abs=30)


@pytest.mark.fuse_opts(hazard_timeout=1.0)
def test_reads_block_behind_a_pending_truncate_then_fail(nfslike_mount: Mount) -> None:
    target = nfslike_mount.path / "config.json"
    target.write_text("{}")
    reader = Child(
        """
        import json, os, sys
        fd = os.open(sys.argv[1], os.O_RDONLY)
        print(json.dumps("open"), flush=True)
        sys.stdin.readline()
        try:
            os.pread(fd, 100, 0)
            print(json.dumps("read ok"), flush=True)
        except OSError as exc:
            print(json.dumps(exc.errno), flush=True)
        """,
        str(target),
    )
    outcome: list[BaseException | None] = []

    def truncate() -> None:
        try:
            open(target, "w").close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(exc)

    assert reader.expect() == "open"
    truncater = threading.Thread(target=truncate)
    truncater.start()
    # The open(O_TRUNC) is counted as it enters the filesystem, just before it starts waiting.
    wait_until(lambda: nfslike_mount.ops().of(os.getpid()).get("open_trunc", 0) == 1, what="truncate pending")
    reader.send()
    assert reader.expect() == errno.EIO
    truncater.join(PATIENT)
    reader.finish()
    [exc] = outcome
    assert isinstance(exc, OSError)
    assert exc.errno == errno.EDEADLK
    kinds = {h["kind"]: h for h in nfslike_mount.hazards()}
    assert set(kinds) == {nfslike.TRUNCATE_BLOCKED, nfslike.IO_BLOCKED}
    assert kinds[nfslike.IO_BLOCKED]["op"] == "read"
    assert kinds[nfslike.IO_BLOCKED]["others"] == [reader.pid]
    assert kinds[nfslike.IO_BLOCKED]["truncater"] == os.getpid()


@pytest.mark.fuse_opts(hazard_timeout=0.5)
def test_write_temp_fsync_rename_has_no_hazards(nfslike_mount: Mount) -> None:
    target = nfslike_mount.path / "tokenizer.json"
    target.write_text('{"v": -1}')
    writer_code = """
        import json, os, sys
        target, me = sys.argv[1], sys.argv[2]
        for i in range(15):
            tmp = f"{target}.{me}.tmp"
            with open(tmp, "w") as f:
                json.dump({"v": i}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        print(json.dumps("done"), flush=True)
    """
    # Readers load the target until told to stop, then report their loads and failures.
    reader_code = """
        import errno, json, select, sys
        loads, failures = 0, {}
        while not select.select([sys.stdin], [], [], 0)[0]:
            try:
                with open(sys.argv[1]) as f:
                    json.load(f)
                loads += 1
            except OSError as exc:
                failures[errno.errorcode[exc.errno]] = failures.get(errno.errorcode[exc.errno], 0) + 1
        print(json.dumps({"loads": loads, "failures": failures}), flush=True)
    """
    readers = [Child(reader_code, str(target)) for _ in range(2)]
    writers = [Child(writer_code, str(target), str(n)) for n in range(3)]
    for writer in writers:
        assert writer.expect() == "done"
        assert writer.finish() == 0
    for reader in readers:
        reader.send("stop")
        report = reader.expect()
        assert reader.finish() == 0
        assert report["loads"] > 0
        # Each rename replaces the name atomically: never ENOENT. A reader whose open raced two
        # renames can get ESTALE, as on NFS (the kernel retries a stale lookup only once).
        assert set(report["failures"]) <= {"ESTALE"}, report
    assert nfslike_mount.hazards() == []
    assert json.loads(target.read_text())["v"] == 14


# ---- two clients ------------------------------------------------------------------------------


@pytest.mark.fuse_opts(entry_timeout=1.0, negative_timeout=1.0, attr_timeout=1.0)
def test_two_clients_see_each_other_late(nfslike_clients: tuple[Mount, Mount]) -> None:
    a, b = nfslike_clients
    assert not (b.path / "new").exists()  # client B caches the negative lookup
    (a.path / "new").write_text("abc")
    assert (a.path / "new").exists()  # the writing client sees it at once
    assert not (b.path / "new").exists()  # client B does not, yet
    wait_until((b.path / "new").exists, what="client B sees the new file")
    assert (b.path / "new").read_text() == "abc"

    assert (b.path / "new").stat().st_size == 3  # client B caches the attributes
    with open(a.path / "new", "a") as f:
        f.write("defg")
    assert (a.path / "new").stat().st_size == 7
    assert (b.path / "new").stat().st_size == 3  # stale
    wait_until(lambda: (b.path / "new").stat().st_size == 7, what="client B sees the new size")

    (a.path / "new").unlink()
    assert (b.path / "new").exists()  # a removed file lingers on the other client
    wait_until(lambda: not (b.path / "new").exists(), what="client B sees the removal")


@pytest.mark.fuse_opts(entry_timeout=2.0, negative_timeout=2.0, attr_timeout=2.0)
@pytest.mark.parametrize("looked", ["stat", "open"])
def test_a_file_replaced_on_one_client_is_read_whole_on_the_other(
    nfslike_clients: tuple[Mount, Mount], looked: str
) -> None:
    """Client B looked the file up (its size cached), client A replaced it (a new file renamed over it),
    then B opened it at once. Before, B read the new file cut to the old size (tests/test_identity.py: the
    first 1,772 bytes of a 1,829-byte tokenizer.json); an NFS client revalidates on open (ESTALE for the
    old handle, a new lookup), so B reads the new file whole. A ``stat`` alone still shows the old size."""
    a, b = nfslike_clients
    (a.path / "f").write_text("x" * 10)
    if looked == "stat":
        assert (b.path / "f").stat().st_size == 10
    else:
        with open(b.path / "f") as f:
            assert os.fstat(f.fileno()).st_size == 10
    (a.path / "new").write_text("y" * 30)
    os.rename(a.path / "new", a.path / "f")
    assert (b.path / "f").read_text() == "y" * 30
    assert (b.path / "f").stat().st_size == 30  # the open's new lookup refreshed the name


# ---- silly rename -----------------------------------------------------------------------------


@pytest.mark.fuse_opts(silly_rename=True)
def test_unlinking_an_open_file_silly_renames_it(nfslike_mount: Mount) -> None:
    d = nfslike_mount.path / "d"
    d.mkdir()
    (d / "f").write_text("content")
    holder = Child(HOLD_OPEN, str(d / "f"), "r")
    assert holder.expect() == "open"
    (d / "f").unlink()
    [silly] = os.listdir(d)
    assert silly.startswith(".nfs")
    assert len(silly) == len(".nfs") + 24
    int(silly[4:], 16)
    assert os.listdir(nfslike_mount.backing / "d") == [silly]
    with raises_errno(errno.ENOTEMPTY):
        d.rmdir()
    with raises_errno(errno.EBUSY):
        (d / silly).unlink()
    assert holder.finish() == 0
    wait_until(lambda: os.listdir(d) == [], what="silly file removed after the last close")
    d.rmdir()
    assert nfslike_mount.ops().of(os.getpid())["silly_rename"] == 1


@pytest.mark.fuse_opts(silly_rename=True)
def test_renaming_over_an_open_file_silly_renames_it(nfslike_mount: Mount) -> None:
    mnt = nfslike_mount.path
    (mnt / "target").write_text("old")
    (mnt / "new").write_text("new")
    with open(mnt / "target") as held:
        os.replace(mnt / "new", mnt / "target")
        names = sorted(os.listdir(mnt))
        assert names[1:] == ["target"]
        assert names[0].startswith(".nfs")
        assert (mnt / "target").read_text() == "new"
        assert held.read() == "old"
        assert os.fstat(held.fileno()).st_size == 3
    wait_until(lambda: os.listdir(mnt) == ["target"], what="silly file removed after close")
    ops = nfslike_mount.ops().of(os.getpid())
    assert ops["rename"] == 1
    assert ops["silly_rename"] == 1
    assert "unlink" not in ops


# ---- renameat2 --------------------------------------------------------------------------------


def test_renameat2_flags_are_refused_as_on_nfs(nfslike_mount: Mount) -> None:
    mnt = nfslike_mount.path
    (mnt / "a").write_text("A")
    (mnt / "b").write_text("B")
    assert renameat2(mnt / "a", mnt / "b", RENAME_EXCHANGE) == errno.EINVAL
    assert (mnt / "a").read_text() == "A"
    assert (mnt / "b").read_text() == "B"
    (mnt / "d1").mkdir()
    (mnt / "d2").mkdir()
    (mnt / "d1" / "one").touch()
    assert renameat2(mnt / "d1", mnt / "d2", RENAME_EXCHANGE) == errno.EINVAL
    assert os.listdir(mnt / "d1") == ["one"]
    assert os.listdir(mnt / "d2") == []
    assert renameat2(mnt / "a", mnt / "c", RENAME_NOREPLACE) == errno.EINVAL
    assert sorted(os.listdir(mnt)) == ["a", "b", "d1", "d2"]
    assert renameat2(mnt / "a", mnt / "c", 0) == 0


# ---- faults -----------------------------------------------------------------------------------


@pytest.mark.fuse_opts(enospc_after=1000, direct_io=True)
def test_enospc_after_a_byte_budget(nfslike_mount: Mount) -> None:
    fd = os.open(nfslike_mount.path / "big", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert os.write(fd, b"x" * 600) == 600
        assert os.write(fd, b"x" * 600) == 400  # a short write at the edge
        with raises_errno(errno.ENOSPC):
            os.write(fd, b"x")
    finally:
        os.close(fd)
    assert (nfslike_mount.backing / "big").stat().st_size == 1000
    with raises_errno(errno.ENOSPC), open(nfslike_mount.path / "more", "wb") as f:
        f.write(b"y")
    nfslike_mount.set_faults(enospc_after=None)
    (nfslike_mount.path / "more").write_bytes(b"y" * 2000)


@pytest.mark.fuse_opts(eio_on_fsync="*.bin")
def test_eio_on_fsync_of_matching_paths(nfslike_mount: Mount) -> None:
    (nfslike_mount.path / "sub").mkdir()
    for name, fails in (("sub/weights.bin", True), ("sub/config.json", False)):
        with open(nfslike_mount.path / name, "wb") as f:
            f.write(b"data")
            f.flush()
            if fails:
                with raises_errno(errno.EIO):
                    os.fsync(f.fileno())
            else:
                os.fsync(f.fileno())
    assert nfslike_mount.ops().of(os.getpid())["fsync"] == 2


@pytest.mark.fuse_opts(hang="stuck/*")
def test_hang_until_released(nfslike_mount: Mount) -> None:
    (nfslike_mount.backing / "stuck").mkdir()
    (nfslike_mount.backing / "stuck" / "f").write_text("finally")
    (nfslike_mount.backing / "free").write_text("free")
    child = Child(
        """
        import json, sys
        print(json.dumps(open(sys.argv[1]).read()), flush=True)
        """,
        str(nfslike_mount.path / "stuck" / "f"),
    )
    with pytest.raises(subprocess.TimeoutExpired):
        child.proc.wait(0.5)  # hung (a bound, not synchronisation)
    assert (nfslike_mount.path / "free").read_text() == "free"  # other paths are unaffected
    nfslike_mount.release()
    assert child.expect() == "finally"
    assert child.finish() == 0


@pytest.mark.fuse_opts(hang="*.ckpt", hang_after_bytes=4096)
def test_hang_after_bytes_leaves_the_file_torn_and_names_the_writer(nfslike_mount: Mount) -> None:
    """Only a write that starts 4 KiB or more into a matching file hangs: the process is held in the
    middle of its bytes, and ``hung()`` names it (a test kills it there). Moving the hang to another
    pattern lets it go."""
    (nfslike_mount.path / "other.txt").write_bytes(b"z" * 10000)  # not matching: never held
    child = Child(
        """
        import os, sys
        fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, b"x" * 4096)
        print("4096", flush=True)
        os.write(fd, b"y" * 4096)
        print("8192", flush=True)
        """,
        str(nfslike_mount.path / "model.ckpt"),
    )
    assert child.expect() == 4096
    deadline = time.monotonic() + PATIENT
    while not (held := nfslike_mount.hung()):
        assert time.monotonic() < deadline, "the second write never reached the mount"
        time.sleep(0.02)  # a bounded poll: the daemon has nothing to block on for us
    assert held == [{"pid": child.pid, "path": "/model.ckpt"}]
    assert (nfslike_mount.backing / "model.ckpt").stat().st_size == 4096  # torn under its name
    nfslike_mount.set_faults(hang="*.other")  # a new pattern lets what the old one held go
    assert child.expect() == 8192
    assert child.finish() == 0
    assert nfslike_mount.hung() == []


@pytest.mark.fuse_opts(hang="*.slow", hang_timeout=0.5)
def test_hang_times_out_with_eio(nfslike_mount: Mount) -> None:
    (nfslike_mount.backing / "x.slow").write_text("x")
    start = time.monotonic()
    with raises_errno(errno.EIO):
        (nfslike_mount.path / "x.slow").read_text()
    assert time.monotonic() - start >= 0.5


@pytest.mark.fuse_opts(latency=0.2)
def test_latency_per_operation(nfslike_mount: Mount) -> None:
    start = time.monotonic()
    os.statvfs(nfslike_mount.path)
    assert time.monotonic() - start >= 0.2
    with open(nfslike_mount.path / "f", "wb") as f:
        start = time.monotonic()
        os.fsync(f.fileno())
        assert time.monotonic() - start >= 0.2


# ---- counters ---------------------------------------------------------------------------------


@pytest.mark.fuse_opts(direct_io=True)
def test_ops_are_counted_per_client_process(nfslike_mount: Mount) -> None:
    mnt = nfslike_mount.path
    (mnt / "mine").write_text("test process")
    child = Child(
        """
        import json, os, sys, threading
        os.chdir(sys.argv[1])
        fd = os.open("f", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for _ in range(3):
            os.write(fd, b"a" * 100)
        os.fsync(fd)
        os.close(fd)
        os.close(os.open("f", os.O_WRONLY | os.O_TRUNC))
        fd = os.open("f", os.O_RDONLY)
        os.read(fd, 10)
        os.close(fd)
        os.truncate("f", 10)
        os.mkdir("d")
        os.rename("f", "d/g")
        os.unlink("d/g")
        # A thread's operations belong to its process.
        t = threading.Thread(target=os.rmdir, args=("d",))
        t.start()
        t.join()
        print(json.dumps("done"), flush=True)
        """,
        str(mnt),
    )
    assert child.expect() == "done"
    assert child.finish() == 0
    ops = nfslike_mount.ops()
    counts = ops.of(child.pid)
    assert {op: counts.get(op, 0) for op in ("open_write", "open_create", "open_trunc", "open_read")} == {
        "open_write": 2,
        "open_create": 1,
        "open_trunc": 1,
        "open_read": 1,
    }
    assert counts["write"] == 3
    assert counts["write_bytes"] == 300
    assert counts["fsync"] == 1
    assert counts["truncate"] == 1
    assert counts["read"] >= 1
    for op in ("mkdir", "rename", "unlink", "rmdir"):
        assert counts[op] == 1, op
    mine = ops.of(os.getpid())
    assert mine["open_create"] == 1
    assert "rename" not in mine
    assert ops.total([child.pid, os.getpid()])["open_create"] == 2
    nfslike_mount.reset_ops()
    assert nfslike_mount.ops() == {}


# ---- locks ------------------------------------------------------------------------------------

LOCKER = """
    import fcntl, json, os, sys
    path, how = sys.argv[1], sys.argv[2]
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    def lock(blocking):
        if how == "flock":
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        else:
            fcntl.lockf(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    try:
        lock(blocking=False)
        print(json.dumps("locked"), flush=True)
    except OSError:
        print(json.dumps("busy"), flush=True)
        sys.stdin.readline()
        lock(blocking=True)
        print(json.dumps("locked"), flush=True)
    sys.stdin.read()
"""


@pytest.mark.parametrize("how", ["flock", "lockf"])
def test_locks_exclude_across_clients(nfslike_clients: tuple[Mount, Mount], how: str) -> None:
    a, b = nfslike_clients
    first = Child(LOCKER, str(a.path / "lock"), how)
    assert first.expect() == "locked"
    second = Child(LOCKER, str(b.path / "lock"), how)
    try:
        assert second.expect() == "busy"
        second.send()
        assert first.finish() == 0  # its lock goes with it
        assert second.expect() == "locked"
    finally:
        first.finish()
        second.finish()


# ---- non-root users -----------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as another uid")
def test_other_users_get_their_own_files_and_permissions(nfslike_mount: Mount) -> None:
    nobody = 65534
    nfslike_mount.path.chmod(0o777)
    (nfslike_mount.path / "roots").write_text("root's")
    child = Child(
        """
        import json, os, sys
        # setuid after the imports: the interpreter's own files may not be readable by nobody.
        os.setgroups([])
        os.setgid(int(sys.argv[2]))
        os.setuid(int(sys.argv[2]))
        os.chdir(sys.argv[1])
        with open("mine", "w") as f:
            f.write("nobody's")
        try:
            open("roots", "w")
            print(json.dumps("wrote root's file"), flush=True)
        except PermissionError:
            print(json.dumps("EACCES"), flush=True)
        """,
        str(nfslike_mount.path),
        str(nobody),
    )
    assert child.expect() == "EACCES"
    assert child.finish() == 0
    st = (nfslike_mount.backing / "mine").stat()
    assert (st.st_uid, st.st_gid) == (nobody, nobody)


# ---- lifecycle ----------------------------------------------------------------------------------


def _mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo", encoding="utf-8") as info:
        return any(line.split()[4] == str(path) for line in info)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_killed_test_process_leaves_no_mount(tmp_path: Path) -> None:
    require_fuse()
    (tmp_path / "backing").mkdir()
    mnt = tmp_path / "mnt"
    parent = Child(
        """
        import json, sys
        from safeio.testing.nfslike import mount
        with mount(sys.argv[1], sys.argv[2], state_dir=sys.argv[3]) as m:
            print(json.dumps(m.pid), flush=True)
            sys.stdin.read()
        """,
        str(tmp_path / "backing"),
        str(mnt),
        str(tmp_path / "state"),
    )
    daemon = parent.expect()
    assert _mounted(mnt)
    parent.proc.kill()
    parent.proc.wait(PATIENT)
    wait_until(lambda: not _mounted(mnt), what="the mount is gone")
    wait_until(lambda: not _alive(daemon), what="the daemon is gone")


def test_a_stale_mount_is_cleaned_at_the_next_start(tmp_path: Path) -> None:
    require_fuse()
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    command = [sys.executable, "-m", "safeio.testing.nfslike", str(backing), str(mnt)]
    daemon = subprocess.Popen(
        [*command, "--no-auto-unmount", "--state-dir", str(tmp_path / "state")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: _mounted(mnt), what="the hand-started daemon mounted")
    finally:
        daemon.kill()
        daemon.wait(PATIENT)
    with raises_errno(errno.ENOTCONN):  # a dead mount, as a crashed run leaves it
        os.listdir(mnt)
    with mount(backing, mnt) as m:
        (m.path / "f").write_text("works")
    assert (backing / "f").read_text() == "works"
    assert not _mounted(mnt)


def test_command_line_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "safeio.testing.nfslike", "--help"],
        check=True,
        capture_output=True,
        text=True,
        timeout=PATIENT,
    )
    for option in ("--hazard-timeout", "--silly-rename", "--entry-timeout", "--hang", "--state-dir"):
        assert option in done.stdout


def test_options_round_trip_through_the_command_line() -> None:
    from safeio.testing.nfslike.__main__ import build_parser

    options = nfslike.Options(hazard_timeout=0.5, silly_rename=True, direct_io=False, hang="x/*", latency=0.1)
    parsed = nfslike.Options.from_namespace(build_parser().parse_args(["b", "m", *options.to_argv()]))
    assert parsed == options
    assert options.use_direct_io is False
    assert nfslike.Options(hazard_timeout=1).use_direct_io is True
    with pytest.raises(TypeError):
        Mount("b", "m", no_such_option=True)


def test_missing_fuse_skips_or_fails_as_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SAFEIO_REQUIRE_FUSE", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no /dev/fuse here"):
        skip_or_fail("no /dev/fuse here")
    monkeypatch.setenv("SAFEIO_REQUIRE_FUSE", "1")
    with pytest.raises(pytest.fail.Exception, match="no /dev/fuse here"):
        skip_or_fail("no /dev/fuse here")


def test_fuse_is_available_here_when_required() -> None:
    reason = nfslike.fuse_unavailable_reason()
    if os.environ.get("SAFEIO_REQUIRE_FUSE") == "1":
        assert reason is None
    elif reason is not None:
        pytest.skip(reason)
