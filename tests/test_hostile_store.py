"""Every store value is untrusted input (issue 34, item 4). The job's TCPStore has no authentication:
another user on the machine who reaches its port can set any key. Here a separate process does exactly
that, through a TCPStore client of its own, to the keys of a checkpoint's next call (their names are
computable from the root's path), and every rank must end with a SafeIOError naming the rank whose value
it was, the writer publishing an outcome and abandoning its stage, nothing committed."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import safeio
from safeio._coordination.calls import digest
from safeio._coordination.channel import Channel
from safeio.testing.ranks import run_ranks
from tests._bounds import PATIENT, RUN

DEEP = "[" * 100_000 + "]" * 100_000  # json.loads: RecursionError
HUGE = json.dumps("x" * (5 << 20))  # over the 4 MiB a store value may be (TCPStore itself takes 8)
VALUES = {"depth": DEEP, "size": HUGE}


def _plant(key: str, value: str) -> None:
    """Another process sets ``key`` in the job's store, as any local user reaching its port could."""
    code = (
        "import sys, torch.distributed as dist\n"
        "from datetime import timedelta\n"
        "store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, timeout=timedelta(seconds=600))\n"
        "store.set(sys.argv[3], sys.stdin.read())\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], key],
        input=value.encode(),
        check=True,
        timeout=PATIENT,
    )


def _key(root: str, call: int, name: str) -> str:
    # The default group's store is a PrefixStore over the TCPStore: "default_pg/0/" + "/" + the key.
    return f"default_pg/0//safeio/ckpt/{digest(root, 16)}/{call}/{name}"


def _bounded_wait(store: Any, key: str, seconds: float = PATIENT) -> None:
    # On the code before the writer never decided: go on, and fail the test by the outcome.
    with contextlib.suppress(Exception):
        store.wait([key], timedelta(seconds=seconds))


def _save_with_a_planted_value(rank: int, world: int, root: str, name: str, value: str) -> dict[str, Any]:
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    call = f"safeio/ckpt/{digest(root, 16)}/1"
    if rank == 0:
        _plant(_key(root, 1, name), value)
        store.set("planted", "1")
    else:
        store.wait(["planted"])
    if rank == 0 and name == "announce":
        _bounded_wait(store, f"{call}/rank/1")  # rank 1 heard the planted announcement before rank 0's
    # warn_after: a waiting rank looks at where the others are after each of its stall lines (and at
    # least every 30 s); the well-formed outcome's writer must find rank 1 done within its first.
    ckpts = safeio.Checkpoints(root, timeout=PATIENT, durable=name == "fsync", warn_after=0.5)
    try:
        with ckpts.save(1) as ckpt:
            Path(ckpt.path, f"shard-{rank}").write_text(str(rank))
            if rank == 1:
                store.set("written", "1")
            elif name == "rank/1":
                _bounded_wait(store, "written")  # the writer must not abandon the stage under rank 1
            if rank == 1 and name == "rank/1":
                _bounded_wait(store, f"{call}/outcome")  # the writer read the planted report, not rank 1's
            if rank == 0 and name == "fsync":
                _bounded_wait(store, f"{call}/synced/1")  # rank 1 heard the planted shares, not rank 0's
            if rank == 0 and name == "outcome":
                _bounded_wait(store, "heard")  # rank 1 heard the planted outcome before the writer collected
    except safeio.SafeIOError as exc:
        failed = getattr(exc, "failed", None)
        return {"type": type(exc).__name__, "error": str(exc), "failed": failed}
    finally:
        if rank == 1:
            store.set("heard", "1")
    return {"type": None}


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("rank/1", "depth"),
        ("rank/1", "size"),
        ("announce", "depth"),
        ("fsync", "depth"),
        ("outcome", "type"),
        ("outcome", "well-formed"),
    ],
)
def test_a_malformed_store_value_of_a_checkpoint_is_an_error_naming_its_rank_on_every_rank(
    shared_dir: Path, name: str, kind: str
) -> None:
    """On the code before: a report nested 100,000 deep killed the writer with RecursionError (no
    outcome published, its stage left, rank 1 waiting out its timeout); the same as the announcement or
    the fsync shares killed rank 1, the writer waiting for its report; an outcome of the wrong types
    (``failed: {"x": {}}``) made rank 1 raise ValueError; later, rank 1 acknowledged that planted outcome
    and so deleted its own report before the writer read it: the writer waited out its whole timeout
    (600 s in the stress run) and named rank 1 missing."""
    root = shared_dir / "ckpts"
    value = {
        "type": json.dumps({"ok": False, "failed": {"x": {}}, "missing": ["a"]}),
        "well-formed": json.dumps({"ok": False, "failed": {}, "missing": []}),
    }.get(kind) or VALUES[kind]
    results = run_ranks(_save_with_a_planted_value, 2, str(root), name, value, timeout=RUN)
    writer, peer = results[0].value, results[1].value
    if kind == "well-formed":
        # Not told apart from the writer's (the store has no authentication): rank 1 acknowledged it,
        # which deleted its own report, and ended. The writer sees rank 1 done without a report to read
        # and decides at once (on the code before it waited out its timeout, then named rank 1
        # missing): nothing committed, as rank 1 heard.
        assert writer["type"] == peer["type"] == "CheckpointError", results
        assert "in done of save of step 1" in writer["failed"][1], writer
        assert "not committed" in writer["error"] and "not committed" in peer["error"], results
        assert not (root / "step_1").exists()
        return
    if name == "outcome":
        # The writer's own decision is fine: only rank 1 heard the planted one, and its report, made before
        # it heard, was still there for the writer (the code before deleted it with the call's keys as it
        # acknowledged the planted outcome; the writer waited out its timeout and named rank 1 missing).
        assert writer["type"] is None, results
    else:
        assert writer["type"] == peer["type"] == "CheckpointError", results
    assert peer["type"] == "CheckpointError", peer
    assert "malformed" in peer["error"], peer
    if name in ("announce", "fsync", "outcome"):  # a value only the writer sets: rank 1 names rank 0's
        assert "heard from rank 0" in peer["error"] or "of rank 0" in peer["error"], peer
    if name == "outcome":
        assert "does not know whether step 1 was committed" in peer["error"], peer
        return
    # The writer named the rank whose value was bad, or that heard a bad one of the writer's (which that
    # rank names), abandoned its stage and told every rank: nothing committed, nothing left.
    assert "malformed" in writer["failed"][1], writer
    assert set(peer["failed"]) == ({1} if name == "rank/1" else {0}), peer
    assert "not committed" in writer["error"] and "not committed" in peer["error"]
    assert not (root / "step_1").exists()
    assert [p.name for p in root.iterdir() if "step_1" in p.name] == []


def _latest_with_a_planted_answer(rank: int, world: int, root: str, answer: str) -> dict[str, Any]:
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    if rank == 0:
        _plant(_key(root, 1, "outcome"), answer)
        store.set("planted", "1")
        _bounded_wait(store, "heard")  # rank 1 hears the planted answer before rank 0 sets its own
    else:
        store.wait(["planted"])
    out: dict[str, Any] = {"type": None}
    try:
        out["found"] = safeio.Checkpoints(root, timeout=PATIENT).latest()
    except safeio.SafeIOError as exc:
        out = {"type": type(exc).__name__, "error": str(exc), "writer": getattr(exc, "writer_rank", None)}
    if rank == 1:
        store.set("heard", "1")
    return out


@pytest.mark.parametrize(
    "answer",
    [DEEP, json.dumps({"ok": True, "found": [[1, "../../../etc"]]}), json.dumps({"ok": True, "found": "x"})],
)
def test_a_malformed_answer_to_latest_is_an_error_naming_the_writer(shared_dir: Path, answer: str) -> None:
    """A step name heard from the store is joined to the root: a planted ``../../../etc`` must not send
    a rank's resume elsewhere. On the code before: RecursionError for the deep one; ``Checkpoint(1,
    '<root>/../../../etc')`` waited for; ValueError for the string."""
    root = shared_dir / "ckpts"
    root.mkdir()
    results = run_ranks(_latest_with_a_planted_answer, 2, str(root), answer, timeout=RUN)
    assert results[0].value == {"type": None, "found": None}  # the writer resolves for itself
    peer = results[1].value
    assert peer["type"] == "RemoteWriterError" and peer["writer"] == 0, peer
    assert "answer of rank 0 to latest()" in peer["error"] and "malformed" in peer["error"], peer


@pytest.mark.parametrize(
    "raw",
    [
        DEEP.encode(),
        b'{"ok": true}',
        b'{"ok": "yes", "target": "/t", "writer_rank": 0}',
        b'{"ok": true, "target": "/t", "writer_rank": 0, "version": ["a"]}',
        b'{"ok": true, "target": "/t", "writer_rank": 0, "extra": 1}',
        b"[1, 2]",
    ],
)
def test_a_malformed_outcome_of_a_replicated_save_is_a_remote_writer_error(raw: bytes) -> None:
    """The replicated path's outcome (channel.py) is input too: on the code before ``Outcome(**json.loads)``
    raised RecursionError or TypeError, or made an Outcome whose ``ok`` was the string "yes" (a success)."""
    import torch.distributed as dist

    store = dist.HashStore()  # a c10d store in this process: rank 1's view of the job's store
    channel = Channel(safeio.Group(1, 2, store=store), "/t", "tokenizer", 1)
    store.set(channel.key, raw)  # what anyone reaching the store could set
    with pytest.raises(safeio.RemoteWriterError, match="malformed") as info:
        channel.wait(30, None).raise_if_failed(1)
    assert info.value.writer_rank == 0 and info.value.path == "/t"
