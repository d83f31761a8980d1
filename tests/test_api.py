"""The public surface: exports, errors, group detection, locks, atomic_open, object stores."""

from __future__ import annotations

import errno
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

import safeio
from safeio import _errors as errors
from safeio._coordination.group import from_environment
from safeio._storage.mounts import MountInfo, read_mounts
from tests._bounds import PATIENT


def test_exports_exactly_all() -> None:
    public = {n for n in dir(safeio) if not n.startswith("_")} - {
        "annotations",
        # submodules are attributes once imported; they are not part of the API
        *(n for n in dir(safeio) if isinstance(getattr(safeio, n), type(os))),
    }
    assert public == set(safeio.__all__) - {"__version__"}
    assert safeio.__all__ == sorted(safeio.__all__)


def test_import_needs_neither_torch_nor_transformers() -> None:
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('torch', 'transformers'):
                    raise ImportError('blocked ' + name)
        sys.meta_path.insert(0, Block())
        import safeio, tempfile, os
        d = tempfile.mkdtemp()
        with safeio.replicated(os.path.join(d, 't')) as s:
            open(os.path.join(s.path, 'f'), 'w').write('x')
        print('ok', safeio.is_complete(os.path.join(d, 't')))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok True", out.stderr


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (errors.InvalidTargetError("bad /p", "/p"), ValueError),
        (errors.InvalidTypeError("target /p must be a path", "/p"), TypeError),
        (errors.InvalidTypeError("target /p must be a path", "/p"), ValueError),
        (errors.TargetExistsError("exists /p", "/p"), FileExistsError),
        (errors.PromotionError("failed /p", "/p", errno=28), OSError),
        (errors.LockTimeout("lock /p", "/p", holder="pid 1 on h"), TimeoutError),
        (errors.PeerTimeout("waited /p", "/p", waited_for=0, phase="promote"), TimeoutError),
        (
            errors.RemoteWriterError("remote /p", "/p", writer_rank=0, error_type="E", error_message="m"),
            Exception,
        ),
        (errors.CollectiveInWriterSection("collective /p", "/p"), RuntimeError),
        (errors.UnsafeWriteError("unsafe /p", "/p"), Exception),
    ],
)
def test_errors_are_rooted_mixed_in_and_picklable(error: errors.SafeIOError, builtin: type) -> None:
    assert isinstance(error, safeio.SafeIOError) and isinstance(error, builtin)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error) and copy.__dict__ == error.__dict__
    assert copy.path == "/p"
    if isinstance(error, OSError):
        assert isinstance(copy, OSError)
        assert (copy.errno, copy.strerror, copy.filename) == (error.errno, error.strerror, error.filename)


def test_target_exists_error_carries_eexist_like_the_os_error(tmp_path: Path) -> None:
    """Code written for ``open(path, "x")`` tests ``errno == EEXIST``; the drop-in must pass it."""
    path = tmp_path / "f"
    path.write_text("old")
    with pytest.raises(FileExistsError) as info, safeio.atomic_open(path, "x") as f:
        f.write("new")
    assert info.value.errno == errno.EEXIST and info.value.filename == str(path)
    assert path.read_text() == "old"


def test_group_from_environment() -> None:
    assert from_environment({}) is None
    g = from_environment({"RANK": "3", "WORLD_SIZE": "8"})
    assert g is not None and (g.rank, g.world_size, g.is_writer, g.store) == (3, 8, False, None)
    g = from_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"})
    assert g is not None and (g.rank, g.world_size, g.is_writer) == (0, 4, True)
    with pytest.raises(safeio.SafeIOError, match="RANK"):
        from_environment({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="outside"):
        safeio.Group(4, 4)


def test_current_group_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    g = safeio.current_group()
    assert (g.rank, g.world_size, g.is_writer) == (0, 1, True)


def test_timeout_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from safeio._options import timeout_or_default as resolve_timeout

    assert resolve_timeout(None) == 1800
    monkeypatch.setenv("SAFEIO_TIMEOUT", "12.5")
    assert resolve_timeout(None) == 12.5
    monkeypatch.setenv("SAFEIO_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SAFEIO_TIMEOUT"):
        resolve_timeout(None)


def test_mountinfo_parsing_and_network_detection(tmp_path: Path) -> None:
    sample = tmp_path / "mountinfo"
    sample.write_text(
        "22 1 0:21 / / rw,relatime - ext4 /dev/vda rw\n"
        "40 22 0:40 / /mnt/shared\\040dir rw - nfs4 srv:/export rw,vers=4.2,hard,actimeo=3\n"
        "41 22 0:41 / /mnt/fuse rw - fuse.nfslike nfslike rw\n"
    )
    mounts = read_mounts(str(sample))
    assert [m.mount_point for m in mounts] == ["/", "/mnt/shared dir", "/mnt/fuse"]
    assert [m.is_network for m in mounts] == [False, True, True]
    assert "actimeo=3" in mounts[1].options
    assert not MountInfo("/", "tmpfs", "tmpfs", ()).is_network


def _hold_lock(path: str, ready: str) -> None:
    import filelock

    with filelock.FileLock(path):
        Path(ready).write_text("held")
        time.sleep(3600)  # hold the lock for the test's lifetime, however slow; the test kills this process


def test_lock_timeout_names_the_lock(tmp_path: Path) -> None:
    target = tmp_path / "tok"
    lock_file = tmp_path / ".tok.safeio.lock"
    ready = tmp_path / "ready"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from tests.test_api import _hold_lock; _hold_lock({str(lock_file)!r}, {str(ready)!r})",
        ],
        cwd=Path(__file__).parent.parent,
    )
    try:
        deadline = time.monotonic() + PATIENT
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        # A first save of a target needs no lock (its rename never replaces anything).
        with safeio.replicated(target, timeout=0.5, lock=True) as stage:
            Path(stage.path, "a").write_text("1")
        assert (target / "a").read_text() == "1"
        # Replacing it does: the holder's lock is waited for, named, and nothing is lost.
        with (
            pytest.raises(safeio.LockTimeout) as info,
            safeio.replicated(target, timeout=0.5, lock=True) as stage,
        ):
            Path(stage.path, "a").write_text("2")
        assert str(lock_file) in str(info.value) and info.value.path == str(lock_file)
        assert (target / "a").read_text() == "1"
        assert sorted(os.listdir(tmp_path)) == [".tok.safeio.lock", "ready", "tok"]
    finally:
        holder.kill()
        holder.wait()


def test_lease_lock_holder_is_named(tmp_path: Path) -> None:
    import filelock

    target = tmp_path / "tok"
    code = (
        # The lease is renewed by the holder's heartbeat for as long as it lives (the test kills it):
        # however slow the test, it meets a live lease. Its duration is safeio's (contenders must agree).
        "import filelock,sys,time;l=filelock.SoftFileLease(sys.argv[1],lease_duration=30);l.acquire();"
        "open(sys.argv[2],'w').write('1');time.sleep(3600)"
    )
    ready = tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / ".tok.safeio.lock"), str(ready)])
    try:
        deadline = time.monotonic() + PATIENT
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        with safeio.replicated(target, timeout=PATIENT, lock="lease") as stage:  # a first save: no lock
            Path(stage.path, "a").write_text("1")
        with pytest.raises(safeio.LockTimeout) as info, safeio.replicated(target, timeout=0.5, lock="lease"):
            pass
        assert f"pid {holder.pid}" in str(info.value)
    finally:
        holder.kill()
        holder.wait()
    assert filelock.SoftFileLease  # the lease type safeio uses on network filesystems


def test_atomic_open_replaces_whole(tmp_path: Path) -> None:
    path = tmp_path / "trainer_state.json"
    path.write_text("old")
    path.chmod(0o640)
    with safeio.atomic_open(path) as f:
        f.write("new")
        assert path.read_text() == "old"  # nothing visible until the rename
    assert path.read_text() == "new" and path.stat().st_mode & 0o777 == 0o640
    assert sorted(os.listdir(tmp_path)) == ["trainer_state.json"]


def test_atomic_open_error_leaves_target_and_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="mid-write"), safeio.atomic_open(path, "wb") as f:
        f.write(b"partial")
        raise RuntimeError("mid-write")
    assert path.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["s.json"]


def test_atomic_open_takes_no_mode_through_a_planted_link(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.write_text("x")
    theirs.chmod(0o666)
    path = tmp_path / "state.json"
    path.symlink_to(theirs)
    with safeio.atomic_open(path) as f:
        f.write("new")
    assert not path.is_symlink() and path.read_text() == "new" and theirs.read_text() == "x"
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def test_atomic_open_leaves_no_descriptor_open(tmp_path: Path) -> None:
    # The file object borrows the temporary file's descriptor (no dup); each one is closed exactly once.
    before = sorted(os.listdir("/proc/self/fd"))
    for mode, data in (("w", "text"), ("wb", b"bytes"), ("x", "once")):
        with safeio.atomic_open(tmp_path / f"f-{mode}", mode) as f:
            f.write(data)
    with pytest.raises(RuntimeError, match="mid-write"), safeio.atomic_open(tmp_path / "g", "wb") as f:
        f.write(b"partial")
        raise RuntimeError("mid-write")
    assert sorted(os.listdir("/proc/self/fd")) == before
    assert (tmp_path / "f-w").read_text() == "text" and (tmp_path / "f-wb").read_bytes() == b"bytes"


def test_a_rival_creating_the_target_under_x_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "once"
    with pytest.raises(safeio.TargetExistsError, match="meanwhile"), safeio.atomic_open(path, "x") as f:
        f.write("mine")
        path.write_text("rival")  # after the up-front check, before the link
    assert path.read_text() == "rival" and sorted(os.listdir(tmp_path)) == ["once"]


def test_a_file_its_caller_left_open_is_flushed_before_the_fsync(tmp_path: Path) -> None:
    from safeio._promotion.atomic_file import AtomicFile
    from safeio._storage.location import resolve

    promotion = AtomicFile(resolve(tmp_path / "w.bin"), exclusive=False, durable=True)
    stage = promotion.open_stage()
    f = promotion.open_file("wb")
    f.write(b"still in the buffer")
    promotion.finish(stage)
    assert f.closed and (tmp_path / "w.bin").read_bytes() == b"still in the buffer"


def test_atomic_open_exclusive_and_bad_input(tmp_path: Path) -> None:
    path = tmp_path / "once"
    with safeio.atomic_open(path, "x") as f:
        f.write("1")
    with pytest.raises(safeio.TargetExistsError), safeio.atomic_open(path, "x") as f:
        f.write("2")
    assert path.read_text() == "1"
    with (
        pytest.raises(safeio.InvalidTargetError, match="does not exist"),
        safeio.atomic_open(tmp_path / "no" / "f"),
    ):
        pass
    with pytest.raises(safeio.InvalidTargetError, match="is a directory"), safeio.atomic_open(tmp_path):
        pass
    with pytest.raises(ValueError, match="modes"), safeio.atomic_open(path, "a"):
        pass


class RecordingMemoryFS(MemoryFileSystem):
    """The memory filesystem, recording each upload and whether the prefix looked complete then."""

    protocol = "recmem"
    root_marker = "/"
    events: list[tuple[str, bool]] = []

    def put_file(self, lpath: str, rpath: str, *args: object, **kwargs: object) -> None:
        RecordingMemoryFS.events.append((rpath, safeio.is_complete("recmem://bucket/tok")))
        super().put_file(lpath, rpath, *args, **kwargs)

    def pipe_file(self, path: str, value: bytes, *args: object, **kwargs: object) -> None:
        RecordingMemoryFS.events.append((path, safeio.is_complete("recmem://bucket/tok")))
        super().pipe_file(path, value, *args, **kwargs)


def test_object_store_commit_marker_is_last() -> None:
    fsspec.register_implementation("recmem", RecordingMemoryFS, clobber=True)
    MemoryFileSystem.store.clear()
    target = "recmem://bucket/tok"
    with safeio.replicated(target) as stage:
        Path(stage.path, "tokenizer.json").write_text("{}")
        Path(stage.path, "old_only.txt").write_text("x")
    assert safeio.is_complete(target)
    RecordingMemoryFS.events.clear()
    with safeio.replicated(target) as stage:
        Path(stage.path, "tokenizer.json").write_text('{"v": 2}')
        Path(stage.path, "special_tokens_map.json").write_text("{}")
    names = [path.rsplit("/", 1)[1] for path, _ in RecordingMemoryFS.events]
    assert names[-1] == ".safeio-manifest.json"
    assert sorted(names[:-1]) == ["special_tokens_map.json", "tokenizer.json"]
    assert [complete for _, complete in RecordingMemoryFS.events] == [False] * len(names)
    fs, prefix = fsspec.core.url_to_fs(target)
    assert sorted(p.rsplit("/", 1)[1] for p in fs.find(prefix)) == [
        ".safeio-manifest.json",
        "special_tokens_map.json",
        "tokenizer.json",
    ]
    assert safeio.verify(target) == []


def test_memory_url_incomplete_without_marker() -> None:
    MemoryFileSystem.store.clear()
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/bucket/half/tokenizer.json", b"{}")
    assert not safeio.is_complete("memory://bucket/half")
    assert "no commit marker" in safeio.verify("memory://bucket/half")[0]
    with (
        pytest.raises(safeio.InvalidTargetError, match="versioned"),
        safeio.replicated("memory://bucket/v", mode="versioned"),
    ):
        pass
