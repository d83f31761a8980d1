"""Writer-only sections: a collective that only the writer would call fails at once instead of hanging."""

from __future__ import annotations

import os
import re
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import safeio
from safeio._diagnostics.collectives import COLLECTIVES, writer_only_section
from safeio.testing.ranks import run_ranks

# -- in one process: what is patched, when, and for which thread ----------------------------------


def test_collectives_raise_inside_the_section_and_are_restored_after() -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    assert {"barrier", "all_gather_object", "broadcast_object_list", "all_to_all"} <= set(originals)
    with writer_only_section("/ckpt/step_5/tokenizer"):
        for name in ("barrier", "all_reduce", "all_gather_object", "scatter_object_list", "reduce_scatter"):
            with pytest.raises(safeio.CollectiveInWriterSection) as info:
                getattr(dist, name)()  # raises before the arguments (or a process group) matter
            assert f"torch.distributed.{name}()" in str(info.value)
            assert "/ckpt/step_5/tokenizer" in str(info.value) and info.value.path == "/ckpt/step_5/tokenizer"
            assert f"pid {os.getpid()}" in str(info.value)
        # DCP and c10d's object collectives look functions up in distributed_c10d too.
        with pytest.raises(safeio.CollectiveInWriterSection):
            c10d.all_gather()
    # Outside every section the very same function objects are back (torch.compile matches them by identity).
    assert all(getattr(dist, name) is fn for name, fn in originals.items())
    assert all(getattr(c10d, name) is fn for name, fn in originals.items())


def test_a_section_belongs_to_its_thread() -> None:
    import torch.distributed as dist

    entered, release = threading.Event(), threading.Event()

    def writer() -> None:
        with writer_only_section("/ckpt/tok"):
            entered.set()
            release.wait(30)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert entered.wait(30)
        # Another thread (an async checkpoint thread running DCP on every rank) calls through to torch.
        with pytest.raises((RuntimeError, ValueError)) as info:
            dist.barrier()
        assert not isinstance(info.value, safeio.CollectiveInWriterSection)
        assert "not been initialized" in str(info.value) or "process group" in str(info.value).lower()
    finally:
        release.set()
        thread.join(30)


def test_nested_sections_and_a_monkeypatch_made_meanwhile_survive(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    def mine() -> str:
        return "patched by someone else"

    with writer_only_section("/a"):
        with writer_only_section("/a/b"), pytest.raises(safeio.CollectiveInWriterSection, match="/a/b"):
            dist.broadcast()
        with pytest.raises(safeio.CollectiveInWriterSection, match="of /a:"):
            dist.broadcast()
        monkeypatch.setattr(dist, "gather", mine)
    assert dist.gather is mine  # restoring never clobbers a name patched after safeio's wrapper


# -- on real gloo ranks ----------------------------------------------------------------------------


def _short_group() -> Any:
    """A group whose collectives give up after 2 s, so that the deadlock without safeio ends."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=2))


def _gather_in_writer_body(rank: int, world: int, shared: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    out: dict[str, Any] = {}
    group = _short_group()
    # Without safeio: a rank-0-only section that gathers waits for ranks that never come.
    if rank == 0:
        start = time.monotonic()
        try:
            dist.all_gather_object([None] * world, {"rank": rank}, group=group)
        except Exception as exc:
            out["plain"] = (type(exc).__name__, str(exc)[:300], time.monotonic() - start)
        store.set("plain-done", "1")
    else:
        store.wait(["plain-done"], timedelta(seconds=60))
    # With safeio: the same call inside the writer-only section of a replicated save.
    target = os.path.join(shared, "tok")
    start = time.monotonic()
    try:
        with safeio.replicated(target, timeout=30) as stage:
            Path(stage.path, "tokenizer_config.json").write_text("{}")
            if stage.is_writer:
                with writer_only_section(stage.target):
                    dist.all_gather_object([None] * world, {"rank": rank})
    except safeio.SafeIOError as exc:
        out["safeio"] = (type(exc).__name__, str(exc), time.monotonic() - start)
    return out


def test_all_gather_object_in_the_writer_section(shared_dir: Path) -> None:
    results = run_ranks(_gather_in_writer_body, 2, str(shared_dir), timeout=90)
    kind, message, took = results[0].value["plain"]
    # The failure safeio prevents: the writer blocks for the whole collective timeout (hours by default),
    # and what it finally says names neither the save nor the collective's misuse.
    assert took >= 1.5 and kind != "CollectiveInWriterSection", results[0].value
    kind, message, took = results[0].value["safeio"]
    assert kind == "CollectiveInWriterSection" and took < 1.0, results[0].value
    assert "all_gather_object" in message and str(shared_dir / "tok") in message and "rank 0" in message
    kind, message, _took = results[1].value["safeio"]
    assert (
        kind == "RemoteWriterError"
        and "CollectiveInWriterSection" in message
        and "all_gather_object" in message
    )
    assert not (shared_dir / "tok").exists()


def _dcp_behind_a_rank0_guard(rank: int, world: int, shared: str) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    state = {"weight": torch.full((4,), float(rank))}
    out: dict[str, Any] = {}
    group = _short_group()
    if rank == 0:  # without safeio: "if rank == 0: save" around a collective save hangs rank 0
        start = time.monotonic()
        try:
            dcp.save(state, checkpoint_id=os.path.join(shared, "plain"), process_group=group)
        except Exception as exc:
            out["plain"] = (type(exc).__name__, time.monotonic() - start)
        store.set("plain-done", "1")
    else:
        store.wait(["plain-done"], timedelta(seconds=60))
    start = time.monotonic()
    try:
        with safeio.replicated(os.path.join(shared, "model"), timeout=30) as stage:
            if stage.is_writer:
                with writer_only_section(stage.target):
                    dcp.save(state, checkpoint_id=stage.path)
    except safeio.SafeIOError as exc:
        out["safeio"] = (type(exc).__name__, str(exc), time.monotonic() - start)
    return out


def test_dcp_save_in_the_writer_section_raises_at_once(shared_dir: Path) -> None:
    results = run_ranks(_dcp_behind_a_rank0_guard, 2, str(shared_dir), timeout=90)
    kind, took = results[0].value["plain"]
    assert took >= 1.5 and kind != "CollectiveInWriterSection", results[0].value
    kind, message, took = results[0].value["safeio"]
    assert kind == "CollectiveInWriterSection" and took < 2.0, results[0].value
    # DCP's first collective (gather_object in torch 2.13) names itself; the save's target is named too.
    assert re.search(r"torch\.distributed\.\w+\(\) was called inside the writer-only save of", message)
    assert str(shared_dir / "model") in message
    kind, message, _took = results[1].value["safeio"]
    assert kind == "RemoteWriterError" and "CollectiveInWriterSection" in message
    assert not [n for n in os.listdir(shared_dir) if "model" in n]  # no target, no stage left behind


def _dcp_beside_safeio(rank: int, world: int, shared: str) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    step = os.path.join(shared, "step_5")
    entered, release = threading.Event(), threading.Event()

    def writer_section_elsewhere() -> None:
        # A replicated save on another thread of the writer process must not affect this thread's DCP.
        with writer_only_section(os.path.join(step, "tokenizer")):
            entered.set()
            release.wait(60)

    side = threading.Thread(target=writer_section_elsewhere)
    if rank == 0:
        side.start()
        assert entered.wait(30)
    try:
        state = {f"rank{rank}": torch.full((4,), float(rank)), "shared": torch.arange(3.0)}
        dcp.save(state, checkpoint_id=os.path.join(step, "model"))
    finally:
        release.set()
        if rank == 0:
            side.join(30)
    with safeio.replicated(os.path.join(step, "tokenizer"), timeout=30) as stage:
        if stage.is_writer:
            with writer_only_section(stage.target):
                Path(stage.path, "tokenizer_config.json").write_text('{"step": 5}')
    loaded = {f"rank{rank}": torch.zeros(4), "shared": torch.zeros(3)}
    dcp.load(loaded, checkpoint_id=os.path.join(step, "model"))
    return {
        "mine": loaded[f"rank{rank}"].tolist(),
        "shared": loaded["shared"].tolist(),
        "tokenizer": safeio.is_complete(os.path.join(step, "tokenizer")),
    }


def test_dcp_saves_run_normally_on_every_rank_beside_safeio_saves(shared_dir: Path) -> None:
    results = run_ranks(_dcp_beside_safeio, 2, str(shared_dir), timeout=90)
    for r in results:
        assert r.value == {"mine": [float(r.rank)] * 4, "shared": [0.0, 1.0, 2.0], "tokenizer": True}
    files = sorted(os.listdir(shared_dir / "step_5" / "model"))
    assert ".metadata" in files and len([f for f in files if f.endswith(".distcp")]) == 2, files


def _bound_barrier_in_writer_body(rank: int, world: int, shared: str) -> dict[str, Any]:
    import logging

    # Bound before any section, as `from torch.distributed import barrier` at a module's top binds it:
    # the section's check never sees the call.
    from torch.distributed import barrier as bound_barrier

    from tests.test_watchdog import _Collect

    group = _short_group()
    out: dict[str, Any] = {}
    log = _Collect()
    logging.getLogger("safeio").addHandler(log)
    target = os.path.join(shared, "tok")
    try:
        with safeio.replicated(target, timeout=20, warn_after=0.3) as stage:
            Path(stage.path, "tokenizer_config.json").write_text("{}")
            if stage.is_writer:
                with writer_only_section(stage.target):
                    bound_barrier(group=group)  # blocks until the group's 2 s timeout: no rank joins
    except Exception as exc:
        out["error"] = type(exc).__name__
    out["warnings"] = [m for level, m in log.records if level == logging.WARNING and "has been in" in m]
    return out


def test_the_watchdog_names_a_collective_that_escaped_the_section(shared_dir: Path) -> None:
    results = run_ranks(_bound_barrier_in_writer_body, 2, str(shared_dir), timeout=90)
    writer = results[0].value
    target = str(shared_dir / "tok")
    assert writer["warnings"], writer  # the stall is reported while it lasts ...
    first = writer["warnings"][0]
    # ... and says what it is: a collective only the writer called, in the save of this target.
    assert f"blocked in torch.distributed.barrier() inside the writer-only save of {target}" in first, first
    assert "bound_barrier(group=group)" in first  # the writer's stack, down to the call
    assert writer["error"] != "CollectiveInWriterSection"  # the section's own check did not see it
    assert results[1].value["error"] == "RemoteWriterError", results[1].value  # the peer hears of the failure
    # The peer's lines name the writer it waits for; it has no stall of its own to tell.
    assert all("still waiting after" in m for m in results[1].value["warnings"]), results[1].value
