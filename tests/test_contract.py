"""The contract every back end keeps, one test body run over all of them (like filelock's lock types).

Back ends: local disk, tmpfs (/dev/shm), the NFS-like FUSE mount, fsspec's ``memory://``, S3 on a moto
server on loopback, and ``markerdir://``, a back end defined only in the tests (``tests/_marker_backend.py``:
a local directory that refuses directory renames, committed by a marker) to prove that a new kind of
location plugs in by its own classes alone. Each test states one promise of the public API and checks it
on each.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest

import safeio
from safeio.testing.nfslike import Mount
from tests._marker_backend import PROTOCOL as MARKERDIR

BACKENDS = ["local", "tmpfs", "nfslike", "memory", "s3", MARKERDIR]


@dataclass
class Backend:
    """Where a test's targets live and how to read them back without safeio."""

    name: str
    base: str  # a directory path or a URL prefix
    fs: Any  # the fsspec filesystem that reads it back

    def target(self, name: str) -> str:
        return f"{self.base}/{name}"

    def read(self, target: str, rel: str) -> bytes:
        return bytes(self.fs.cat_file(f"{target}/{rel}"))

    def exists(self, target: str, rel: str = "") -> bool:
        return bool(self.fs.exists(f"{target}/{rel}" if rel else target))

    def listing(self) -> list[str]:
        """Every name directly under the base, hidden ones included (safeio's siblings would show here)."""
        if self.name in ("local", "tmpfs", "nfslike"):
            return sorted(os.listdir(self.base))
        return sorted(os.path.basename(p.rstrip("/")) for p in self.fs.ls(self.base, detail=False))


def _local_dir(root: str | None) -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="safeio-contract-", dir=root)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    kind = request.param
    if kind in ("local", "tmpfs"):
        root = "/dev/shm" if kind == "tmpfs" else "/tmp"
        for path in _local_dir(root):
            yield Backend(kind, path, fsspec.filesystem("file"))
    elif kind == "nfslike":
        mount: Mount = request.getfixturevalue("nfslike_mount")
        yield Backend(kind, str(mount.path), fsspec.filesystem("file"))
    elif kind == MARKERDIR:
        for path in _local_dir("/tmp"):
            yield Backend(kind, f"{MARKERDIR}://{path}", fsspec.filesystem(MARKERDIR))
    elif kind == "memory":
        base = f"memory://contract-{secrets.token_hex(4)}"
        fs = fsspec.filesystem("memory")
        yield Backend(kind, base, fs)
        if fs.exists(base):
            fs.rm(base, recursive=True)
    else:
        s3: dict[str, str] = request.getfixturevalue("s3")
        yield Backend(kind, f"s3://{s3['BUCKET']}", fsspec.filesystem("s3"))


def _save(target: str, files: dict[str, str], **options: Any) -> None:
    with safeio.replicated(target, timeout=60, **options) as stage:
        for rel, text in files.items():
            path = os.path.join(stage.path, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)


def test_a_save_is_complete_and_verifiable(backend: Backend) -> None:
    target = backend.target("tok")
    _save(target, {"tokenizer.json": "{}", "sub/vocab.txt": "a b"})
    assert backend.read(target, "tokenizer.json") == b"{}"
    assert backend.read(target, "sub/vocab.txt") == b"a b"
    assert safeio.verify(target) == []
    assert safeio.is_complete(target)


def test_replace_drops_old_files_and_merge_keeps_them(backend: Backend) -> None:
    replaced, merged = backend.target("replaced"), backend.target("merged")
    for target, mode in ((replaced, "replace"), (merged, "merge")):
        _save(target, {"model.bin": "old", "config.json": "old"}, mode=mode)
        _save(target, {"config.json": "new"}, mode=mode)
        assert backend.read(target, "config.json") == b"new"
        assert safeio.is_complete(target)
    assert not backend.exists(replaced, "model.bin")
    assert backend.read(merged, "model.bin") == b"old"


def test_a_failing_body_leaves_the_previous_version_and_no_leftovers(backend: Backend) -> None:
    target = backend.target("tok")
    _save(target, {"a": "v1"})
    before = backend.listing()
    with pytest.raises(KeyError, match="body"), safeio.replicated(target, timeout=60) as stage:
        with open(os.path.join(stage.path, "a"), "w") as f:
            f.write("v2-partial")
        raise KeyError("body")
    assert backend.read(target, "a") == b"v1"
    assert safeio.verify(target) == []
    assert backend.listing() == before  # no stage, aside or lock left visible beside the target


def test_mode_error_refuses_an_existing_target_before_the_body(backend: Backend) -> None:
    target = backend.target("tok")
    _save(target, {"a": "v1"})
    ran: list[bool] = []
    with pytest.raises(safeio.TargetExistsError) as info, safeio.replicated(target, mode="error"):
        ran.append(True)
    assert not ran and target.rstrip("/").split("/")[-1] in str(info.value)
    assert backend.read(target, "a") == b"v1"


def test_atomic_open_replaces_and_exclusive_refuses(backend: Backend) -> None:
    path = backend.target("state.json")
    with safeio.atomic_open(path, "w") as f:
        f.write("one")
    with safeio.atomic_open(path, "w") as f:
        f.write("two")
    assert bytes(backend.fs.cat_file(path)) == b"two"
    with pytest.raises(safeio.TargetExistsError), safeio.atomic_open(path, "x") as f:
        f.write("three")
    assert bytes(backend.fs.cat_file(path)) == b"two"


def test_atomic_open_error_keeps_the_old_content(backend: Backend) -> None:
    path = backend.target("state.json")
    with safeio.atomic_open(path, "w") as f:
        f.write("one")
    with pytest.raises(RuntimeError, match="mid-write"), safeio.atomic_open(path, "w") as f:
        f.write("tw")
        raise RuntimeError("mid-write")
    assert bytes(backend.fs.cat_file(path)) == b"one"


def test_torch_save_round_trips(backend: Backend) -> None:
    torch = pytest.importorskip("torch")
    path = backend.target("extra_state.pt")
    safeio.torch_save({"step": 7, "w": torch.arange(3)}, path, timeout=60)
    with fsspec.open(path, "rb") as f:
        loaded = torch.load(f)
    assert loaded["step"] == 7 and loaded["w"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e400, 0, -1, "5", True])
def test_bad_timeouts_fail_before_the_body_naming_the_argument(backend: Backend, bad: object) -> None:
    target = backend.target("tok")
    with pytest.raises(safeio.InvalidOptionError, match="timeout"):
        safeio.replicated(target, timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(safeio.InvalidOptionError, match="timeout"):
        safeio.torch_save({}, backend.target("x.pt"), timeout=bad)  # type: ignore[arg-type]
    assert not backend.exists(target)


def test_checkpoints_commit_retain_and_find_the_newest(backend: Backend) -> None:
    root = backend.target("run")
    ckpts = safeio.Checkpoints(root, keep=2, timeout=60)
    for step in (1, 2, 3):
        with ckpts.save(step) as ckpt:
            with fsspec.open(f"{ckpt.path}/weights.bin", "wb") as f:  # a sharded writer: the stage
                f.write(bytes([step]) * 8)
            with safeio.replicated(f"{ckpt.path}/tokenizer", timeout=60) as stage:  # written once
                Path(stage.path, "tokenizer.json").write_text(f"v{step}")
    assert ckpts.steps() == [2, 3]
    latest = ckpts.latest()
    assert latest is not None and latest.step == 3
    assert backend.read(latest.path, "weights.bin") == bytes([3]) * 8
    assert backend.read(latest.path, "tokenizer/tokenizer.json") == b"v3"
    assert backend.read(root, "latest") == b"step_3"
    assert safeio.verify(latest.path) == []
    assert not backend.exists(f"{root}/step_1")
