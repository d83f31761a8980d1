"""Whole checkpoints (issue 15, core): torch.distributed.checkpoint shards from every rank, a tokenizer and
trainer state written once, committed together; ``latest`` and retention; a failing and a killed rank.

Real gloo ranks, real DCP, real transformers objects; local disk and two NFS-like clients.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import safeio
from safeio.testing import hf_objects
from safeio.testing.nfslike import Mount
from safeio.testing.ranks import run_ranks
from tests.test_nfs_proof import _enter_client_b


def _state(step: int) -> dict[str, Any]:
    """A model and its optimizer after ``step`` updates (the same on every rank, as after all-reduce)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(step):
        model(torch.ones(2, 16)).sum().backward()
        optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def _save_loop(
    rank: int, world: int, root: str, steps: list[int], keep: int, clients: tuple[str, str] | None
) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoTokenizer

    if clients is not None and rank % 2 == 1:
        _enter_client_b(*clients)  # odd ranks are the second NFS client, with its own caches
    ckpts = safeio.Checkpoints(root, keep=keep, timeout=60)
    seen = []
    for step in steps:
        with ckpts.save(step) as ckpt:
            dcp.save(_state(step), checkpoint_id=ckpt.path)  # every rank writes its own files
            safeio.save_pretrained(hf_objects.fast_tokenizer(version=step), ckpt.path)  # one writer
            safeio.torch_save({"step": step}, os.path.join(ckpt.path, "trainer_state.pt"))
        found = ckpts.latest()  # every rank, right after the commit: the same answer, visible here
        assert found is not None
        seen.append(found.step)
    latest = ckpts.latest()
    assert latest is not None
    restored = _state(0)
    dcp.load(restored, checkpoint_id=latest.path)
    expected = _state(latest.step)
    same = all(torch.equal(restored["model"][k], v) for k, v in expected["model"].items())
    tokenizer = AutoTokenizer.from_pretrained(latest.path)
    trainer_state = torch.load(os.path.join(latest.path, "trainer_state.pt"))
    return {
        "seen": seen,
        "steps": ckpts.steps(),
        "same_model": same,
        "tokenizer_version": tokenizer.chat_template,
        "trainer_state": trainer_state,
    }


def _check_loop(results: list[Any], root: Path, steps: list[int], keep: int) -> None:
    for r in results:
        assert r.value["seen"] == steps, r  # every rank found each step the moment it was committed
        assert r.value["steps"] == steps[-keep:], r
        assert r.value["same_model"] is True, r
        assert r.value["trainer_state"] == {"step": steps[-1]}, r
        assert r.value["tokenizer_version"].endswith(f"v{steps[-1]}"), r  # the newest step's tokenizer
    assert (root / "latest").read_text() == f"step_{steps[-1]}"  # DeepSpeed's pointer format
    names = sorted(os.listdir(root))
    assert [n for n in names if n.startswith("step_")] == [f"step_{s}" for s in steps[-keep:]]
    assert [n for n in names if ".safeio-" in n and not n.endswith(".lock")] == []  # no stage, no aside
    shards = [n for n in os.listdir(root / f"step_{steps[-1]}") if n.endswith(".distcp")]
    assert len(shards) == len(results), shards  # every rank's shard file was committed
    assert safeio.verify(root / f"step_{steps[-1]}") == []


@pytest.mark.parametrize("world", [4, 8])
def test_dcp_tokenizer_and_state_committed_together(shared_dir: Path, world: int) -> None:
    root = shared_dir / "ckpts"
    steps = [1, 2, 3]
    results = run_ranks(_save_loop, world, str(root), steps, 2, None, timeout=400)
    _check_loop(results, root, steps, 2)


@pytest.mark.fuse_opts(attr_timeout=5.0, entry_timeout=5.0, negative_timeout=5.0)
def test_ranks_on_two_nfs_clients_agree_on_latest(nfslike_clients: tuple[Mount, Mount]) -> None:
    a, b = nfslike_clients
    root = a.path / "ckpts"
    steps = [1, 2, 3]
    results = run_ranks(_save_loop, 4, str(root), steps, 2, (str(a.path), str(b.path)), timeout=400)
    _check_loop(results, root, steps, 2)
    assert a.hazards() == []


def _one_rank_fails(rank: int, world: int, root: str, how: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    ckpts = safeio.Checkpoints(root, keep=3, timeout=8)
    with ckpts.save(1) as ckpt:
        dcp.save(_state(1), checkpoint_id=ckpt.path)
    outcome: dict[str, Any] = {}
    try:
        with ckpts.save(2) as ckpt:
            dcp.save(_state(2), checkpoint_id=ckpt.path)
            _every_rank_past_dcp(world)  # so that the collectives inside dcp.save are all over
            if rank == 2:
                if how == "killed":
                    os._exit(9)  # a rank that dies mid-save never reports
                raise RuntimeError("rank 2's disk is full")
    except safeio.CheckpointError as exc:
        outcome = {"error": str(exc), "failed": exc.failed, "missing": exc.missing}
    except RuntimeError as exc:
        outcome = {"own": str(exc)}
    latest = ckpts.latest()
    outcome["latest"] = latest.step if latest else None
    return outcome


def _every_rank_past_dcp(world: int) -> None:
    """A barrier through the store (a gloo barrier could need the rank about to die to relay it)."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    if store.add("past-dcp", 1) == world:
        store.set("past-dcp/all", "1")
    store.wait(["past-dcp/all"], timedelta(seconds=60))


@pytest.mark.parametrize("how", ["raises", "killed"])
def test_a_failing_or_killed_rank_makes_every_rank_raise_and_commits_nothing(
    shared_dir: Path, how: str
) -> None:
    root = shared_dir / "ckpts"
    results = run_ranks(_one_rank_fails, 4, str(root), how, timeout=200, check=False)
    for r in results:
        if r.rank == 2:
            if how == "raises":
                assert r.value == {"own": "rank 2's disk is full", "latest": 1}, r
            continue
        assert r.error is None, r
        assert r.value["latest"] == 1, r  # latest unchanged, on every rank
        assert "rank 2" in r.value["error"] and "step 2 was not committed" in r.value["error"], r
        if how == "raises":
            assert "disk is full" in r.value["failed"][2], r
        else:
            assert r.value["missing"] == [2], r
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_1"]
    assert (root / "latest").read_text() == "step_1"
    assert [n for n in os.listdir(root) if ".safeio-stage" in n] == []


def test_retention_keeps_the_newest_and_never_an_uncommitted_step(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    ckpts = safeio.Checkpoints(root, keep=2, name="checkpoint-{step}")
    for step in (10, 20, 30):
        with ckpts.save(step) as ckpt:
            Path(ckpt.path, "weights.bin").write_bytes(bytes([step]) * 100)
    # A half-written step (a plain crash without safeio) and a dead writer's stage are never "latest".
    (root / "checkpoint-40").mkdir()
    (root / "checkpoint-40" / "weights.bin").write_bytes(b"partial")
    latest = ckpts.latest()
    assert latest is not None and latest.step == 30
    assert ckpts.steps() == [20, 30]
    assert (root / "latest").read_text() == "checkpoint-30"
    with pytest.raises(safeio.InvalidTargetError, match="not a committed checkpoint"), ckpts.save(40):
        pass
    with pytest.raises(safeio.TargetExistsError), ckpts.save(30):
        pass
    assert ckpts.steps() == [20, 30]


def test_write_pointer_replaces_atomically(tmp_path: Path) -> None:
    pointer = tmp_path / "latest"
    safeio.write_pointer(pointer, "global_step100")
    first = os.stat(pointer).st_ino
    safeio.write_pointer(pointer, "global_step200")
    assert pointer.read_text() == "global_step200"
    assert os.stat(pointer).st_ino != first  # a new file renamed over the old, never rewritten in place
    assert os.listdir(tmp_path) == ["latest"]
