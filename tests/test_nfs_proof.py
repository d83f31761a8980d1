"""The failure from the mission, reproduced on the NFS-like filesystem, and prevented by safeio.

Every test here runs real gloo ranks against a real FUSE mount; the emulation is asserted to fail the
unguarded pattern, so it can never silently stop emulating.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import safeio
from safeio._boundary import io_errno
from safeio.testing import hf_objects
from safeio.testing.nfslike import Mount
from safeio.testing.ranks import run_ranks

pytest.importorskip("transformers")

INTERLOCK = {"hazard_timeout": 0.5}
WRITE_OPS = (
    "open_write",
    "open_trunc",
    "open_create",
    "write",
    "truncate",
    "rename",
    "unlink",
    "mkdir",
    "rmdir",
    "fsync",
)


def _read_back(directory: str) -> None:
    """What training code that reloads does: open every saved file and read it."""
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                f.read()


def _workload(rank: int, world: int, target: str, how: str, iterations: int) -> dict[str, Any]:
    import torch.distributed as dist

    tok = hf_objects.fast_tokenizer()
    errors: list[str] = []
    for _ in range(iterations):
        dist.barrier()  # line the ranks up, as a training step does before its checkpoint
        try:
            if how == "unguarded":
                tok.save_pretrained(target)
            elif how == "safeio":
                safeio.save_pretrained(tok, target, timeout=60)
            else:
                with safeio.patch_save_pretrained(timeout=60):
                    tok.save_pretrained(target)
            _read_back(target)
        except OSError as exc:
            errors.append(errno.errorcode.get(exc.errno or 0, str(exc.errno)))
        except safeio.SafeIOError as exc:
            errors.append(type(exc).__name__)
        except Exception as exc:  # the tokenizers library (Rust) raises a bare Exception for an io error
            code = io_errno(exc)
            if code is None:
                raise
            errors.append(errno.errorcode.get(code, str(code)))
    return {"pid": os.getpid(), "errors": errors}


@pytest.mark.fuse_opts(**INTERLOCK)
@pytest.mark.parametrize("world", [4, 8])
def test_the_hang_reproduced_without_safeio(nfslike_mount: Mount, world: int) -> None:
    target = str(nfslike_mount.path / "tokenizer")
    results = run_ranks(_workload, world, target, "unguarded", 6, timeout=240)
    errors = [e for r in results for e in r.value["errors"]]
    hazards = nfslike_mount.hazards()
    assert hazards, "the emulated interlock produced no hazard: the NFS emulation stopped emulating"
    assert {"EDEADLK", "EIO"} & set(errors), errors
    assert {h["kind"] for h in hazards} <= {"truncate_blocked_by_open_file", "io_blocked_behind_truncate"}


@pytest.mark.fuse_opts(**INTERLOCK)
@pytest.mark.parametrize(("how", "world"), [("safeio", 4), ("safeio", 8), ("patch", 4)])
def test_the_hang_prevented_with_safeio(nfslike_mount: Mount, world: int, how: str) -> None:
    target = str(nfslike_mount.path / "tokenizer")
    results = run_ranks(_workload, world, target, how, 6, timeout=240)
    assert [r.value["errors"] for r in results] == [[]] * world
    assert nfslike_mount.hazards() == []


def _save_once(rank: int, world: int, target: str) -> int:
    safeio.save_pretrained(hf_objects.fast_tokenizer(), target, timeout=60)
    return os.getpid()


def test_one_writer_constant_work(nfslike_mount: Mount) -> None:
    writer_ops = []
    for world in (2, 4, 8):
        nfslike_mount.reset_ops()
        target = str(nfslike_mount.path / f"tok-{world}")
        pids = [r.value for r in run_ranks(_save_once, world, target)]
        ops = nfslike_mount.ops()
        for pid in pids[1:]:
            assert {op: ops.of(pid).get(op, 0) for op in WRITE_OPS} == dict.fromkeys(WRITE_OPS, 0)
        writer = ops.of(pids[0])
        writer_ops.append({op: writer.get(op, 0) for op in WRITE_OPS})
        assert writer_ops[-1]["rename"] >= 1
    assert writer_ops[0] == writer_ops[1] == writer_ops[2], writer_ops  # flat in the world size


def _enter_client_b(path_a: str, path_b: str) -> None:
    """Make this process a second NFS client: its own mount namespace, with client B's mount at the
    path client A has, so both ranks name the target identically (as two nodes do)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    subprocess.run(["mount", "--bind", path_b, path_a], check=True)


def _two_clients(rank: int, world: int, path_a: str, path_b: str, use_safeio: bool) -> dict[str, Any]:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    if rank == 1:
        _enter_client_b(path_a, path_b)
    target = os.path.join(path_a, "safe" if use_safeio else "plain")
    seen_before = os.path.exists(target)  # client B now caches "no such entry" (negative_timeout)
    dist.barrier()
    if use_safeio:
        safeio.save_pretrained(hf_objects.config(), target, timeout=60)
    elif rank == 0:
        safeio.save_pretrained(hf_objects.config(), target, timeout=60)
        store.set("promoted", "1")
    else:
        store.wait(["promoted"], timedelta(seconds=60))  # told "done" the way a barrier would
    visible = os.path.exists(os.path.join(target, "config.json"))
    return {"seen_before": seen_before, "visible": visible}


@pytest.mark.fuse_opts(entry_timeout=4.0, negative_timeout=4.0, attr_timeout=4.0)
def test_two_clients_see_the_promoted_version(nfslike_clients: tuple[Mount, Mount]) -> None:
    a, b = nfslike_clients
    plain = run_ranks(_two_clients, 2, str(a.path), str(b.path), False)
    # Without safeio's visibility wait, client B is told "done" and still sees nothing: the failure.
    assert plain[1].value == {"seen_before": False, "visible": False}, plain
    safe = run_ranks(_two_clients, 2, str(a.path), str(b.path), True)
    assert [r.value for r in safe] == [{"seen_before": False, "visible": True}] * 2


@pytest.mark.fuse_opts(silly_rename=True)
def test_silly_renamed_leftover_is_swept_later(
    nfslike_mount: Mount, caplog: pytest.LogCaptureFixture
) -> None:
    target = nfslike_mount.path / "tok"
    safeio.save_pretrained(hf_objects.fast_tokenizer(1), target, mode="replace")
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; f = open(sys.argv[1]); print('open', flush=True); sys.stdin.read()",
            str(target / "tokenizer.json"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "open"
        with caplog.at_level(logging.WARNING, logger="safeio"):
            safeio.save_pretrained(hf_objects.fast_tokenizer(2), target, mode="replace")
        assert "silly-renamed" in caplog.text
        leftovers = [n for n in os.listdir(nfslike_mount.path) if ".safeio-old-" in n]
        assert len(leftovers) == 1
        assert any(n.startswith(".nfs") for n in os.listdir(nfslike_mount.path / leftovers[0]))
    finally:
        reader.communicate("")
    assert "v2" in (target / "chat_template.jinja").read_text()
    safeio.save_pretrained(hf_objects.fast_tokenizer(3), target, mode="replace")  # the next save sweeps it
    assert [n for n in os.listdir(nfslike_mount.path) if ".safeio-" in n and not n.endswith(".lock")] == []


def _faulty_save(rank: int, world: int, target: str, timeout: float) -> str:
    try:
        safeio.save_pretrained(hf_objects.fast_tokenizer(5), target, timeout=timeout)
    except safeio.SafeIOError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def _old_version_intact(target: Path) -> None:
    from transformers import AutoTokenizer

    assert "v1" in (target / "chat_template.jinja").read_text()
    assert AutoTokenizer.from_pretrained(target)("hello")["input_ids"]
    assert safeio.verify(target) == []
    assert [n for n in os.listdir(target.parent) if ".safeio-stage" in n] == []


def test_enospc_while_staging(nfslike_mount: Mount) -> None:
    target = nfslike_mount.path / "tok"
    safeio.save_pretrained(hf_objects.fast_tokenizer(1), target)
    nfslike_mount.set_faults(enospc_after=500)
    results = run_ranks(_faulty_save, 4, str(target), 30.0)
    assert results[0].value.startswith("PromotionError") and "No space left" in results[0].value
    for r in results[1:]:
        assert r.value.startswith("RemoteWriterError") and "No space left" in r.value, r.value
    nfslike_mount.set_faults(enospc_after=None)
    _old_version_intact(target)


@pytest.mark.fuse_opts(eio_on_fsync="*tokenizer.json")
def test_eio_on_fsync(nfslike_mount: Mount) -> None:
    target = nfslike_mount.path / "tok"
    safeio.save_pretrained(hf_objects.fast_tokenizer(1), target, durable=False)
    results = run_ranks(_faulty_save, 2, str(target), 30.0)
    assert results[0].value.startswith("PromotionError") and "Input/output error" in results[0].value
    assert results[1].value.startswith("RemoteWriterError")
    _old_version_intact(target)


@pytest.mark.fuse_opts(hang="*.safeio-stage-*/tokenizer.json", hang_timeout=60)
def test_hang_fault_makes_peers_time_out(nfslike_mount: Mount) -> None:
    target = nfslike_mount.path / "tok"
    import threading

    releaser = threading.Timer(7.0, nfslike_mount.release)  # the writer stays stuck until then
    releaser.start()
    try:
        start = time.monotonic()
        results = run_ranks(_faulty_save, 3, str(target), 3.0, timeout=120, check=False)
    finally:
        releaser.cancel()
        nfslike_mount.release()
    for r in results[1:]:
        assert r.value.startswith("PeerTimeout"), r
        assert "rank 0" in r.value and "in body of" in r.value and str(target) in r.value
    assert time.monotonic() - start < 60
