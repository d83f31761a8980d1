"""The audit sanitizer: unsafe writes to shared paths are found, attributed to ranks, and merged."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

import safeio
from safeio._diagnostics.audit import (
    LIMIT_NOTE,
    Auditor,
    AuditRecord,
    _registry,
    audit,
    install_from_environment,
)
from safeio._diagnostics.audit_report import find_conflicts, format_report, merge_reports
from safeio.testing.ranks import run_ranks


def _ops(auditor: Auditor, root: Path) -> list[tuple[str, str]]:
    def rel(p: str | None) -> str:
        return os.path.relpath(p, root) if p is not None else ""

    return [(r.op, rel(r.path) + (f" -> {rel(r.dest)}" if r.dest else "")) for r in auditor.records]


def test_every_kind_of_unsafe_operation_under_root_is_recorded(shared_dir: Path, tmp_path: Path) -> None:
    root = shared_dir
    with audit(root, "record") as auditor:
        with open(root / "a", "w") as f:
            f.write("a")
        (root / "b").write_text("b")
        fd = os.open(root / "c", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.ftruncate(fd, 0)  # by descriptor: attributed to the file through /proc/self/fd
        os.close(fd)
        os.truncate(root / "a", 0)
        (root / "a").read_text()  # reads, appends and exclusive creates are context, not unsafe
        with open(root / "a", "a") as f:
            f.write("more")
        with open(root / "fresh", "x") as f:
            f.write("new")
        os.rename(root / "a", root / "a2")
        os.replace(root / "a2", root / "a3")
        os.remove(root / "a3")
        os.mkdir(root / "d")
        (root / "d" / "x").write_text("x")
        shutil.rmtree(root / "d")  # one record, not one per entry removed
        os.mkdir(root / "e")
        os.rmdir(root / "e")
        (tmp_path / "outside").write_text("not under root")
    (root / "after").write_text("the auditor has stopped")
    assert _ops(auditor, root) == [
        ("open-truncate", "a"),
        ("open-truncate", "b"),
        ("open-truncate", "c"),
        ("truncate", "c"),
        ("truncate", "a"),
        ("rename", "a -> a2"),
        ("rename", "a2 -> a3"),
        ("remove", "a3"),
        ("open-truncate", "d/x"),
        ("rmtree", "d"),
        ("rmdir", "e"),
    ]
    assert [(r.op, os.path.basename(r.path)) for r in auditor.opens] == [
        ("open", "a"),
        ("open", "a"),
        ("open", "fresh"),
    ]
    first = auditor.records[0]
    assert first.pid == os.getpid() and first.host and first.rank is None  # no process group here
    assert any("test_every_kind_of_unsafe_operation_under_root_is_recorded" in line for line in first.stack)


def test_raise_refuses_the_write_before_it_truncates(shared_dir: Path) -> None:
    config = shared_dir / "config.json"
    config.write_text('{"old": true}')
    with audit(shared_dir, "raise"), pytest.raises(safeio.UnsafeWriteError) as info:
        config.write_text('{"new": true}')
    assert config.read_text() == '{"old": true}'  # the open never happened
    message = str(info.value)
    assert info.value.path == str(config)
    assert f"unsafe open-truncate of {config} outside a safeio stage" in message
    assert f"pid {os.getpid()}" in message and "test_raise_refuses_the_write_before_it_truncates" in message


def test_warn_logs_rank_pid_path_and_stack(shared_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="safeio")
    with audit(shared_dir):
        os.replace(_touch(shared_dir / "new"), shared_dir / "old")
    [record] = caplog.records
    message = record.getMessage()
    assert record.name == "safeio" and record.levelno == logging.WARNING
    assert (
        f"rank ? ({os.uname().nodename} pid {os.getpid()}): unsafe rename of {shared_dir / 'new'}" in message
    )
    assert f"-> {shared_dir / 'old'}" in message and "test_warn_logs_rank_pid_path_and_stack" in message


def _touch(path: Path) -> Path:
    with open(path, "x") as f:  # an exclusive create is not unsafe
        f.write("x")
    return path


def test_safeio_own_writes_pass_where_plain_writes_are_refused(shared_dir: Path) -> None:
    tok = shared_dir / "tok"
    with audit(shared_dir, "raise") as auditor:
        for mode in ("replace", "replace", "merge", "versioned", "versioned"):
            with safeio.replicated(tok if mode != "versioned" else shared_dir / "vtok", mode=mode) as stage:
                Path(stage.path, "tokenizer_config.json").write_text(mode)
                os.replace(_touch(Path(stage.path, "tmp")), Path(stage.path, "vocab.txt"))
        for _ in range(2):
            with safeio.atomic_open(shared_dir / "trainer_state.json") as f:
                f.write("{}")
        safeio.torch_save({"step": 1}, shared_dir / "extra_state.pt")
        # Without safeio, the same files written in place are refused.
        with pytest.raises(safeio.UnsafeWriteError):
            (tok / "tokenizer_config.json").write_text("in place")
        with pytest.raises(safeio.UnsafeWriteError):
            (shared_dir / "trainer_state.json").write_text("in place")
    assert [r.path for r in auditor.records] == [
        str(tok / "tokenizer_config.json"),
        str(shared_dir / "trainer_state.json"),
    ]
    assert (tok / "tokenizer_config.json").read_text() == "merge"


def test_only_python_level_io_is_seen(shared_dir: Path) -> None:
    """The sanitizer's limit, pinned down: tokenizers writes tokenizer.json from Rust, unseen."""
    from safeio.testing.hf_objects import fast_tokenizer

    tokenizer = fast_tokenizer()
    target = shared_dir / "tok"
    with audit(shared_dir, "record", record_dir=shared_dir / "records") as auditor:
        tokenizer.save_pretrained(target)
    written = {os.path.basename(r.path) for r in auditor.records if r.op == "open-truncate"}
    assert "tokenizer_config.json" in written  # Python's open: seen
    assert (target / "tokenizer.json").stat().st_size > 0  # written, by Rust...
    assert not [r for r in auditor.records + auditor.opens if "tokenizer.json" in r.path]  # ...and unseen
    assert LIMIT_NOTE in format_report(merge_reports(shared_dir / "records"))


def test_safeio_audit_environment_variable(shared_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_registry, "from_environment", None)
    assert install_from_environment({}) is None
    with pytest.raises(ValueError, match="SAFEIO_AUDIT_ACTION"):
        install_from_environment({"SAFEIO_AUDIT": str(shared_dir), "SAFEIO_AUDIT_ACTION": "panic"})
    monkeypatch.setenv("RANK", "5")
    env = {
        "SAFEIO_AUDIT": str(shared_dir / "ckpt"),
        "SAFEIO_AUDIT_DIR": str(shared_dir / "records"),
        "SAFEIO_AUDIT_ACTION": "record",
    }
    auditor = install_from_environment(env)
    try:
        assert auditor is not None and install_from_environment(env) is auditor  # once per process
        (shared_dir / "ckpt").mkdir()
        (shared_dir / "ckpt" / "config.json").write_text("{}")
    finally:
        auditor.stop() if auditor is not None else None
    [name] = os.listdir(shared_dir / "records")
    assert name == f"audit-rank5-pid{os.getpid()}.jsonl"
    [line] = (shared_dir / "records" / name).read_text().splitlines()
    record = AuditRecord.from_dict(json.loads(line))
    assert (record.op, record.path, record.rank) == (
        "open-truncate",
        str(shared_dir / "ckpt" / "config.json"),
        5,
    )


def test_conflicts_between_processes() -> None:
    def rec(op: str, path: str, rank: int | None, pid: int = 1) -> AuditRecord:
        return AuditRecord(op, path, rank, pid, "host", 0.0)

    conflicts = find_conflicts(
        [
            rec("open-truncate", "/c/config.json", 0),
            rec("open-truncate", "/c/config.json", 0),  # one process twice: no conflict by itself
            rec("open-truncate", "/c/solo.json", 0),
            rec("open-truncate", "/c/config.json", 2),
            rec("open", "/c/vocab.txt", 1),
            rec("truncate", "/c/vocab.txt", 0),
            rec("open", "/c/mine.txt", 3),
            rec("open-truncate", "/c/mine.txt", 3),
            rec("open-truncate", "/c/x", None, pid=7),
            rec("remove", "/c/x", None, pid=8),
        ]
    )
    assert [(c.kind, c.path, c.processes) for c in conflicts] == [
        ("multiple-writers", "/c/config.json", ("rank 0", "rank 2")),
        ("multiple-writers", "/c/x", ("host pid 7", "host pid 8")),  # no rank known: told apart by pid
        ("truncate-while-open", "/c/vocab.txt", ("rank 0", "rank 1")),
    ]


# -- on real gloo ranks ----------------------------------------------------------------------------


WORLD = 3


def _unguarded_then_patched(rank: int, world: int, shared: str) -> int:
    import torch.distributed as dist

    import safeio._saves.hf_patch
    from safeio.testing.hf_objects import config

    # What `import safeio` does when SAFEIO_AUDIT is set (run_ranks put it in this rank's environment).
    assert install_from_environment() is not None
    cfg = config()
    cfg.save_pretrained(os.path.join(shared, "unguarded", "ckpt"))  # every rank writes config.json
    # A rank truncating a file that another rank has open for reading: the NFS hang.
    data = os.path.join(shared, "unguarded", "data.txt")
    with open(data) if rank == 1 else open(os.devnull) as reader:
        dist.barrier()
        if rank == 0:
            with open(data, "w") as f:
                f.write("rewritten")
        dist.barrier()
        reader.read()
    # The same save of the config under the patch.
    guarded = os.path.join(shared, "guarded")
    with (
        audit(guarded, "record", guarded + "-records"),
        safeio._saves.hf_patch.patch_save_pretrained(timeout=60),
    ):
        cfg.save_pretrained(os.path.join(guarded, "ckpt"))
    return len(os.listdir(os.path.join(shared, "guarded", "ckpt")))


def test_unguarded_save_pretrained_is_reported_with_every_rank(shared_dir: Path) -> None:
    (shared_dir / "unguarded").mkdir()
    (shared_dir / "unguarded" / "data.txt").write_text("original")
    env = {
        "SAFEIO_AUDIT": str(shared_dir / "unguarded"),
        "SAFEIO_AUDIT_DIR": str(shared_dir / "records"),
        "SAFEIO_AUDIT_ACTION": "record",
    }
    results = run_ranks(_unguarded_then_patched, WORLD, str(shared_dir), env=env, timeout=120)
    assert all(r.value >= 1 for r in results)  # the patched save did write

    report = merge_reports(shared_dir / "records")
    assert len(report.files) == WORLD
    config = str(shared_dir / "unguarded" / "ckpt" / "config.json")
    data = str(shared_dir / "unguarded" / "data.txt")
    kinds = {(c.kind, c.path): c.processes for c in report.conflicts}
    assert kinds[("multiple-writers", config)] == tuple(f"rank {r}" for r in range(WORLD))
    assert kinds[("truncate-while-open", data)] == ("rank 0", "rank 1")
    text = format_report(report)
    assert "CONFLICTS" in text and config in text and f"rank {WORLD - 1}" in text and LIMIT_NOTE in text
    assert json.loads(json.dumps(report.to_dict()))["conflicts"]

    guarded = merge_reports(shared_dir / "guarded-records")
    assert guarded.conflicts == [] and guarded.unsafe == [], format_report(guarded)
    assert "no unsafe writes, no conflicts" in format_report(guarded)
