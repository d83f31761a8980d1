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
from tests._bounds import PATIENT, RUN
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

    if clients is not None and rank % 2 == 1:
        _enter_client_b(*clients)  # odd ranks are the second NFS client, with its own caches
    ckpts = safeio.Checkpoints(root, keep=keep, timeout=PATIENT)
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
    tokenizer, trainer_state = _load_replicated(latest.path)
    return {
        "seen": seen,
        "steps": ckpts.steps(),
        "same_model": same,
        "tokenizer_version": tokenizer.chat_template,
        "trainer_state": trainer_state,
    }


def _load_replicated(path: str) -> tuple[Any, Any]:
    """The tokenizer and trainer state of a committed step (from an object store: downloaded first)."""
    import tempfile

    import fsspec
    import torch
    from transformers import AutoTokenizer

    if "://" in path:
        fs, prefix = fsspec.core.url_to_fs(path)
        local = tempfile.mkdtemp()
        fs.get(prefix + "/", local, recursive=True)
        path = local
    tokenizer = AutoTokenizer.from_pretrained(path)
    return tokenizer, torch.load(os.path.join(path, "trainer_state.pt"))


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
    results = run_ranks(_save_loop, world, str(root), steps, 2, None, timeout=RUN)
    _check_loop(results, root, steps, 2)


@pytest.mark.fuse_opts(attr_timeout=5.0, entry_timeout=5.0, negative_timeout=5.0)
def test_ranks_on_two_nfs_clients_agree_on_latest(nfslike_clients: tuple[Mount, Mount]) -> None:
    a, b = nfslike_clients
    root = a.path / "ckpts"
    steps = [1, 2, 3]
    results = run_ranks(_save_loop, 4, str(root), steps, 2, (str(a.path), str(b.path)), timeout=RUN)
    _check_loop(results, root, steps, 2)
    assert a.hazards() == []


def test_dcp_tokenizer_and_state_on_s3(s3: dict[str, str]) -> None:
    """On an object store each step is written in place and committed by its marker, then latest."""
    import s3fs

    root = f"s3://{s3['BUCKET']}/run"
    steps = [1, 2, 3]
    results = run_ranks(_save_loop, 4, root, steps, 2, None, timeout=RUN, env=s3)
    for r in results:
        assert r.value["seen"] == steps and r.value["steps"] == steps[-2:], r
        assert r.value["same_model"] is True and r.value["trainer_state"] == {"step": 3}, r
        assert r.value["tokenizer_version"].endswith("v3"), r
    fs = s3fs.S3FileSystem(endpoint_url=s3["FSSPEC_S3_ENDPOINT_URL"], key="x", secret="x")
    prefix = f"{s3['BUCKET']}/run"
    assert fs.cat_file(f"{prefix}/latest") == b"step_3"
    listed = sorted(k.rsplit("/", 1)[-1] for k in fs.ls(prefix))
    assert listed == [".checkpoints.safeio.sequence", "latest", "step_2", "step_3"]
    names = [k.rsplit("/", 1)[-1] for k in fs.find(f"{prefix}/step_3")]
    assert len([n for n in names if n.endswith(".distcp")]) == 4  # every rank's shard, committed
    assert ".safeio-in-progress" not in names and "tokenizer.json" in names and "trainer_state.pt" in names
    assert safeio.verify(f"{root}/step_3") == []


def test_object_store_steps_interrupted_foreign_and_retained(s3: dict[str, str]) -> None:
    import fsspec

    root = f"s3://{s3['BUCKET']}/run"
    fs = fsspec.filesystem("s3")
    ckpts = safeio.Checkpoints(root, keep=2, name="checkpoint-{step}")
    for step in (1, 2):
        with ckpts.save(step) as ckpt:
            fs.pipe_file(f"{ckpt.path}/weights.bin", bytes([step]) * 100)
            safeio.torch_save({"step": step}, f"{ckpt.path}/trainer_state.pt")  # the writer's, uploaded
    # A save killed in its body: objects under the step's prefix, no marker. Never a checkpoint.
    killed = ckpts.save(3)
    ckpt = killed.__enter__()
    fs.pipe_file(f"{ckpt.path}/weights.bin", b"partial")
    from safeio._promotion import active

    assert killed._entry is not None and killed._watchdog is not None
    active.pop(killed._entry)
    killed._watchdog.stop()  # the process "died": its watchdog went with it
    restarted = safeio.Checkpoints(root, keep=2, name="checkpoint-{step}")
    latest = restarted.latest()
    assert latest is not None and latest.step == 2 and latest.path == f"{root}/checkpoint-2"
    assert safeio.verify(f"{root}/checkpoint-3") != []
    # The same step saved again after the restart: the interrupted save's leftovers go, then it commits.
    with restarted.save(3) as ckpt:
        fs.pipe_file(f"{ckpt.path}/weights.bin", b"\3" * 100)
    assert restarted.steps() == [2, 3]
    assert fs.cat_file(f"{root}/checkpoint-3/weights.bin") == b"\3" * 100
    assert not fs.exists(f"{root}/checkpoint-1/weights.bin")  # retention: the marker, then the rest
    assert fs.cat_file(f"{root}/latest") == b"checkpoint-3"
    # Objects under a step's prefix that this layer did not write are never deleted.
    fs.pipe_file(f"{root}/checkpoint-4/notes.txt", b"someone else's")
    with pytest.raises(safeio.InvalidTargetError, match="not a committed checkpoint"), restarted.save(4):
        pass
    assert fs.cat_file(f"{root}/checkpoint-4/notes.txt") == b"someone else's"
    assert restarted.steps() == [2, 3]


def _one_rank_fails(rank: int, world: int, root: str, how: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    ckpts = safeio.Checkpoints(root, keep=3, timeout=PATIENT)
    with ckpts.save(1) as ckpt:
        dcp.save(_state(1), checkpoint_id=ckpt.path)
    # The save that loses rank 2: the writer waits out a killed rank's report, so that wait is short
    # (its length is the subject). Every other wait here asserts an outcome and is patient.
    dying = safeio.Checkpoints(root, keep=3, timeout=4) if how == "killed" else ckpts
    outcome: dict[str, Any] = {}
    try:
        with dying.save(2) as ckpt:
            dcp.save(_state(2), checkpoint_id=ckpt.path)
            _every_rank_past_dcp(rank, world)  # so that the collectives inside dcp.save are all over
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
    # Rank 0 hosts the store: it stays until the others have heard (a job's end is another test).
    _every_rank_past_dcp(rank, world, "end", dead=(2,) if how == "killed" else ())
    return outcome


def _every_rank_past_dcp(rank: int, world: int, key: str = "past-dcp", dead: tuple[int, ...] = ()) -> None:
    """A barrier through the store (a gloo barrier could need the rank about to die to relay it) of
    every rank but ``dead``. Rank 0 hosts the store, so it leaves last: once every other rank passed."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    if store.add(key, 1) == world - len(dead):
        store.set(f"{key}/all", "1")
    store.wait([f"{key}/all"], timedelta(seconds=PATIENT))
    if rank != 0:
        store.set(f"{key}/passed/{rank}", "1")
    else:
        others = [r for r in range(1, world) if r not in dead]
        store.wait([f"{key}/passed/{r}" for r in others], timedelta(seconds=PATIENT))


@pytest.mark.parametrize("how", ["raises", "killed"])
def test_a_failing_or_killed_rank_makes_every_rank_raise_and_commits_nothing(
    shared_dir: Path, how: str
) -> None:
    root = shared_dir / "ckpts"
    results = run_ranks(_one_rank_fails, 4, str(root), how, timeout=RUN, check=False)
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
    assert ckpts.steps() == [20, 30]


def _done(path: str) -> bool:
    """A framework's own completion marker (as the Trainer's trainer_state.json is)."""
    return os.path.exists(os.path.join(path, "done"))


def test_a_save_moves_aside_only_this_users_step_written_without_safeio(
    shared_dir: Path, caplog: Any
) -> None:
    root = shared_dir / "ckpts"
    ckpts = safeio.Checkpoints(root, keep=None, name="checkpoint-{step}")
    for step, files in [(5, ["weights.bin"]), (6, ["weights.bin", "done"]), (7, ["weights.bin"])]:
        (root / f"checkpoint-{step}").mkdir(parents=True)  # written without safeio
        for name in files:
            (root / f"checkpoint-{step}" / name).write_bytes(b"plain")
    foreign = root / "checkpoint-8"
    foreign.mkdir()
    (foreign / "weights.bin").write_bytes(b"another user's")
    for path in (foreign, foreign / "weights.bin"):
        os.lchown(path, 4242, 4242)
    with ckpts.save(9) as ckpt:
        Path(ckpt.path, "weights.bin").write_bytes(b"safeio's")
    (root / "checkpoint-9" / "weights.bin").unlink()  # a commit damaged afterwards: safeio's marker stays
    caplog.set_level("WARNING", logger="safeio")
    # Unfinished by the framework's marker, this user's, no safeio marker: moved aside, kept, committed.
    with ckpts.save(5, unmarked=_done) as ckpt:
        Path(ckpt.path, "weights.bin").write_bytes(b"new")
    aside = [n for n in os.listdir(root) if n.startswith("incomplete-checkpoint-5.")]
    assert len(aside) == 1 and (root / aside[0] / "weights.bin").read_bytes() == b"plain", os.listdir(root)
    assert f"{root}/checkpoint-5 was written without safeio" in caplog.text
    assert f"moved aside to {root}/{aside[0]}" in caplog.text
    assert safeio.verify(root / "checkpoint-5") == [] and ckpts.committed() == [(5, "checkpoint-5")]
    # Complete by its marker (a plain run's checkpoint of a step this run saves again): moved aside too.
    with ckpts.save(6, unmarked=_done) as ckpt:
        Path(ckpt.path, "weights.bin").write_bytes(b"new")
    previous = [n for n in os.listdir(root) if n.startswith("previous-checkpoint-6.")]
    assert len(previous) == 1 and (root / previous[0] / "done").read_bytes() == b"plain", os.listdir(root)
    assert f"{root}/checkpoint-6 was written without safeio and is complete" in caplog.text
    # No judgement given, another user's: refused, untouched.
    for step, judge in [(7, None), (8, _done)]:
        before = sorted(os.listdir(root / f"checkpoint-{step}"))
        with (
            pytest.raises(safeio.InvalidTargetError, match=f"checkpoint-{step} exists"),
            ckpts.save(step, unmarked=judge),
        ):
            pass
        assert sorted(os.listdir(root / f"checkpoint-{step}")) == before
    # This user's commit, damaged since: a commit of the step all the same, replaced by the new one.
    with ckpts.save(9, unmarked=_done) as ckpt:
        Path(ckpt.path, "weights.bin").write_bytes(b"again")
    ckpts.wait()
    assert (
        safeio.verify(root / "checkpoint-9") == []
        and (root / "checkpoint-9" / "weights.bin").read_bytes() == b"again"
    )
    assert len([n for n in os.listdir(root) if n.startswith(("incomplete-", "previous-"))]) == 2


def test_write_pointer_replaces_atomically(tmp_path: Path) -> None:
    pointer = tmp_path / "latest"
    safeio.write_pointer(pointer, "global_step100")
    first = os.stat(pointer).st_ino
    safeio.write_pointer(pointer, "global_step200")
    assert pointer.read_text() == "global_step200"
    assert os.stat(pointer).st_ino != first  # a new file renamed over the old, never rewritten in place
    assert os.listdir(tmp_path) == ["latest"]


def _dcp_inside_replicated(rank: int, world: int, target: str) -> str:
    import torch.distributed.checkpoint as dcp

    try:
        with safeio.replicated(target, timeout=PATIENT) as stage:
            dcp.save(_state(1), checkpoint_id=stage.path)  # the misuse: sharded state, one writer kept
    except safeio.UnsupportedSaveError as exc:
        outcome = f"refused: {exc}"
    except safeio.RemoteWriterError as exc:
        outcome = f"remote {exc.error_type}: {exc.error_message}"
    else:
        outcome = "saved"
    _every_rank_past_dcp(rank, world, "done")  # rank 0 hosts the store: it stays until every rank has heard
    return outcome


def test_dcp_inside_replicated_is_refused_on_every_rank(shared_dir: Path) -> None:
    """It used to "work": rank 0's shard promoted, the other ranks' dropped, verify ok, resume broken."""
    target = shared_dir / "ckpt"
    results = run_ranks(_dcp_inside_replicated, 4, str(target), timeout=RUN)
    assert results[0].value.startswith("refused: ") and "safeio.Checkpoints" in results[0].value
    for r in results[1:]:
        assert r.value.startswith("remote UnsupportedSaveError: "), r
    assert not target.exists()


def _per_rank_files_in_replicated(rank: int, world: int, target: str) -> str:
    try:
        with safeio.replicated(target, timeout=PATIENT) as stage:
            Path(stage.path, "config.json").write_text("{}")
            Path(stage.path, f"rank{rank}.pt").write_text(str(rank))  # per-rank data
    except safeio.UnsupportedSaveError as exc:
        outcome = f"refused: {exc}"
    else:
        outcome = "saved"
    _every_rank_past_dcp(rank, world, "done")
    return outcome


def test_per_rank_files_in_replicated_are_named_on_the_rank_that_would_lose_them(shared_dir: Path) -> None:
    target = shared_dir / "out"
    results = run_ranks(_per_rank_files_in_replicated, 3, str(target), timeout=RUN)
    assert results[0].value == "saved"  # the writer's own files are all there
    for r in results[1:]:
        assert r.value.startswith("refused: ") and f"rank{r.rank}.pt" in r.value, r
        assert "safeio.Checkpoints" in r.value, r


def test_safeio_ls_lists_committed_partial_and_in_progress(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    root = tmp_path / "ckpts"
    ckpts = safeio.Checkpoints(root, keep=None)
    for step in (1, 2):
        with ckpts.save(step) as ckpt:
            Path(ckpt.path, "w.bin").write_bytes(b"x" * 1000)
    (root / "step_3").mkdir()  # a step written without safeio, half done
    # Written without safeio and complete by their framework's own marker: the HF Trainer's (its state
    # and weights), torch.distributed.checkpoint's (.metadata, written last).
    trainer_done = root / "checkpoint-5"
    trainer_done.mkdir()
    (trainer_done / "trainer_state.json").write_text('{"global_step": 5}')
    (trainer_done / "model.safetensors").write_bytes(b"w")
    (root / "step_6").mkdir()
    (root / "step_6" / ".metadata").write_bytes(b"m")
    (root / "step_7").mkdir()
    Path(ckpts.path_of("step_1"), "w.bin").write_bytes(b"torn")  # a committed step damaged since
    live = ckpts.save(4)
    live.__enter__()  # a save in progress (this process is alive)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "safeio", "ls", "--json", str(root)],
            capture_output=True,
            text=True,
            timeout=PATIENT,
        )
    finally:
        live.__exit__(None, None, None)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    rows = {row["name"]: row for row in report["checkpoints"]}
    states = {name: row["state"] for name, row in rows.items()}
    assert states["step_2"] == "committed"
    # A safeio marker whose files no longer match it: "damaged", the word verify uses (ls said "partial").
    assert states["step_1"] == "damaged" and "size mismatch: w.bin" in rows["step_1"]["detail"]
    assert states["step_3"] == states["step_7"] == "written-without-safeio-incomplete"
    assert states["checkpoint-5"] == states["step_6"] == "written-without-safeio-complete"
    assert rows["checkpoint-5"]["detail"] == "complete by trainer_state.json"
    assert rows["step_6"]["detail"] == "complete by torch.distributed.checkpoint's .metadata"
    assert [s for n, s in states.items() if n.startswith(".step_4.safeio-stage")] == ["in-progress"]
    # Each problem comes with what fixes it; the others with none.
    assert {n for n, row in rows.items() if row["fix"] is not None} == {"step_1", "step_3", "step_7"}
    assert report["latest"] == "step_2" and report["latest_ok"] is True
    (root / "latest").write_text("step_3")  # a pointer to an incomplete step: flagged
    done = subprocess.run(
        [sys.executable, "-m", "safeio", "ls", str(root)], capture_output=True, text=True, timeout=PATIENT
    )
    assert done.returncode == 1 and "not a committed checkpoint" in done.stdout, done.stdout
    assert "the next committed save rewrites it" in done.stdout
    # verify judges what it can check and says what it cannot: the incomplete ones and the damaged step
    # are problems, the complete ones written without safeio are listed as not checked.
    done = subprocess.run(
        [sys.executable, "-m", "safeio", "verify", str(root)], capture_output=True, text=True, timeout=PATIENT
    )
    problems = [line for line in done.stdout.splitlines() if line.startswith("  step_")]
    assert done.returncode == 1 and sorted(p.split(":")[0].strip() for p in problems) == [
        "step_1",
        "step_3",
        "step_7",
    ], done.stdout
    assert "  step_1: damaged: " in done.stdout, done.stdout  # the same word as ls
    not_checked = [line for line in done.stdout.splitlines() if line.startswith("  not checked:")]
    assert len(not_checked) == 2 and "checkpoint-5" in not_checked[0] and "step_6" in not_checked[1], (
        done.stdout
    )


def _gated_writer(path: str, key: str, fail: bool = False) -> Any:
    """A FileSystemWriter whose data waits for a store key (an upload still in flight at dispatch)."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.checkpoint import FileSystemWriter

    class Gated(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            # Its own connection: a wait holds up every other call on the same TCPStore client.
            c10d._get_default_store().clone().wait([key], timedelta(seconds=PATIENT))
            if fail:
                raise OSError(28, "No space left on device (rank's async upload)")
            return super().write_data(plan, planner)

    return Gated(path)


def _async_loop(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    pg = dist.new_group(backend="gloo")  # DCP's background collectives, apart from the training's
    out: dict[str, Any] = {}

    # Without safeio: `latest` written at dispatch (torchtitan #930) names a step whose data is in flight.
    plain = os.path.join(root, "plain", "step_1")
    fut = dcp.async_save(_state(1), storage_writer=_gated_writer(plain, "plain-go"), process_group=pg)
    if rank == 0:
        os.makedirs(os.path.dirname(plain), exist_ok=True)
        safeio.write_pointer(os.path.join(root, "plain", "latest"), "step_1")
        out["plain_metadata_at_dispatch"] = os.path.exists(os.path.join(plain, ".metadata"))
        store.set("plain-go", "1")
    fut.result()

    ckpts = safeio.Checkpoints(os.path.join(root, "ckpts"), keep=2, timeout=PATIENT)
    dispatch: dict[int, Any] = {}
    for step in (1, 2):
        with ckpts.save(step) as ckpt:
            writer = _gated_writer(ckpt.path, f"go-{step}")
            fut = dcp.async_save(_state(step), storage_writer=writer, process_group=pg)
            safeio.save_pretrained(hf_objects.fast_tokenizer(version=step), ckpt.path)
            ckpt.commit_after(fut)
        # Dispatched, the upload held: nothing under the final name, latest unchanged, on every rank.
        dispatch[step] = (os.path.isdir(os.path.join(root, "ckpts", f"step_{step}")), _read_latest(root))
        if store.add(f"checked-{step}", 1) == world:
            store.set(f"go-{step}", "1")
    found = ckpts.latest()  # waits for step 2's commit first
    out["dispatch"] = dispatch
    out["latest"] = found.step if found else None
    # A rank whose async upload fails: every rank raises when the commit is waited for; nothing committed.
    with ckpts.save(3) as ckpt:
        writer = _gated_writer(ckpt.path, "go-3", fail=rank == 2)
        ckpt.commit_after(dcp.async_save(_state(3), storage_writer=writer, process_group=pg))
    if store.add("checked-3", 1) == world:
        store.set("go-3", "1")
    try:
        ckpts.wait()
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        out["error"] = (type(exc).__name__, str(exc))
    found = ckpts.latest()
    out["after_failure"] = found.step if found else None
    _every_rank_past_dcp(rank, world, "end")
    return out


def _read_latest(root: str) -> str | None:
    path = os.path.join(root, "ckpts", "latest")
    return Path(path).read_text() if os.path.exists(path) else None


def test_async_save_commits_when_its_future_completes(shared_dir: Path) -> None:
    results = run_ranks(_async_loop, 4, str(shared_dir), timeout=RUN)
    assert results[0].value["plain_metadata_at_dispatch"] is False  # the failure: latest -> no .metadata
    for r in results:
        v = r.value
        assert v["dispatch"] == {1: (False, None), 2: (False, "step_1")}, r  # never at dispatch
        assert v["latest"] == 2, r
        kind, message = v["error"]
        # DCP hands rank 2's failure to every rank's future; a rank whose future succeeded would get
        # CheckpointError naming rank 2 from the writer.
        assert kind in ("CheckpointError", "CheckpointException") and "No space left" in message, r
        assert v["after_failure"] == 2, r  # step 3 never committed; latest unchanged
    root = shared_dir / "ckpts"
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_1", "step_2"]
    assert (root / "latest").read_text() == "step_2"
    assert safeio.verify(root / "step_2") == []


def _die_inside_a_save(root: str) -> None:
    ckpts = safeio.Checkpoints(root, keep=3)
    with ckpts.save(4) as ckpt:
        Path(ckpt.path, "w.bin").write_bytes(b"half")
        os._exit(9)  # killed in the body: its stage stays behind, its owner is gone


def test_verify_and_gc_understand_a_checkpoint_root(tmp_path: Path) -> None:
    import json
    import multiprocessing
    import subprocess
    import sys

    root = tmp_path / "ckpts"
    ckpts = safeio.Checkpoints(root, keep=3)
    for step in (1, 2):
        with ckpts.save(step) as ckpt:
            Path(ckpt.path, "w.bin").write_bytes(b"x" * 1000)
    child = multiprocessing.get_context("fork").Process(target=_die_inside_a_save, args=(str(root),))
    child.start()
    child.join(PATIENT)
    assert child.exitcode == 9
    stages = [n for n in os.listdir(root) if n.startswith(".step_4.safeio-stage")]
    assert len(stages) == 1

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "safeio", *args], capture_output=True, text=True, timeout=PATIENT
        )

    done = cli("verify", str(root))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 committed checkpoint(s), latest 'step_2'" in done.stdout
    # The dead writer's stage is named stale, with the command that removes it (it was not suggested).
    assert f"note: {stages[0]}: stale: " in done.stdout, done.stdout
    assert f"fix stale ({stages[0]}): `safeio gc {root}` removes it" in done.stdout, done.stdout
    # A committed step damaged afterwards, and a step directory written without safeio: both named.
    (root / "step_1" / "w.bin").write_bytes(b"short")
    (root / "step_3").mkdir()
    done = cli("verify", "--json", str(root))
    assert done.returncode == 1, done.stdout
    report = json.loads(done.stdout)
    assert any(p.startswith("step_1: damaged: ") for p in report["problems"]), report
    assert any(p.startswith("step_3: written-without-safeio-incomplete: ") for p in report["problems"]), (
        report
    )
    # gc removes the dead writer's stage and nothing else: committed and partial steps stay.
    done = cli("gc", str(root))
    assert done.returncode == 0, done.stdout + done.stderr
    # (the root's lock and the sequence of its commits are the root's own bookkeeping)
    assert sorted(n for n in os.listdir(root) if not n.startswith(".checkpoints.safeio.")) == [
        "latest",
        "step_1",
        "step_2",
        "step_3",
    ]
    assert ckpts.latest() == safeio.Checkpoint(2, str(root / "step_2"))


def test_keep_tells_its_default_from_a_chosen_3_and_is_checked_when_set(tmp_path: Path) -> None:
    """An adapter applies a framework's own retention only when the user chose no ``keep``
    (``keep_given``); setting ``keep`` later is validated like the argument and applies to what follows."""
    default, chosen = safeio.Checkpoints(tmp_path / "a"), safeio.Checkpoints(tmp_path / "b", keep=3)
    assert (default.keep, default.keep_given) == (3, False)
    assert (chosen.keep, chosen.keep_given) == (3, True)
    default.keep = 1
    for step in (1, 2):
        with default.save(step) as ckpt:
            Path(ckpt.path, "w.bin").write_bytes(b"w")
    assert default.steps() == [2]
    with pytest.raises(safeio.InvalidOptionError, match=str(tmp_path / "a")):
        default.keep = 0


def _counting_tokenizer(fail_on_writer: bool = False) -> Any:
    """The tiny tokenizer, counting the calls of its own ``save_pretrained`` (and raising on rank 0 when
    ``fail_on_writer``: a full disk on the writer)."""
    tok = hf_objects.fast_tokenizer()

    class Counting(type(tok)):  # type: ignore[misc]
        calls = 0

        def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
            type(self).calls += 1
            if fail_on_writer and os.environ["RANK"] == "0":
                raise OSError(28, "No space left on device (the writer's)")
            return super().save_pretrained(*args, **kwargs)

    tok.__class__ = Counting
    return tok


def _replicated_saves_in_a_checkpoint(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    ckpts = safeio.Checkpoints(root, keep=3, timeout=PATIENT)
    every, guarded, failing = _counting_tokenizer(), _counting_tokenizer(), _counting_tokenizer(True)
    with ckpts.save(1) as ckpt:
        dcp.save(_state(1), checkpoint_id=ckpt.path)
        returned = safeio.save_pretrained(every, os.path.join(ckpt.path, "tokenizer"))  # every rank
        if rank == 0:  # the already-guarded shape: nobody waits for its result, nothing hangs
            safeio.save_pretrained(guarded, os.path.join(ckpt.path, "guarded"))
    error = ""
    try:
        with ckpts.save(2) as ckpt:
            dcp.save(_state(2), checkpoint_id=ckpt.path)  # collective: every rank has seen the stage
            safeio.save_pretrained(failing, os.path.join(ckpt.path, "tokenizer"))
    except (safeio.SafeIOError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    latest = ckpts.latest()
    _every_rank_past_dcp(rank, world, "end")  # rank 0 hosts the store: it leaves last
    return {
        "calls": every.calls,
        "returned": [str(p) for p in returned],
        "error": error,
        "latest": latest.step if latest else None,
    }


def test_peers_in_a_checkpoint_skip_replicated_saves_and_return_the_writers_result(shared_dir: Path) -> None:
    """Issue 26, item 4: inside a checkpoint only the writer's replicated files are kept, so a peer's
    ``save_pretrained`` does not serialise the object at all (on main every rank did, into scratch it then
    deleted, and returned paths in that scratch); it returns what the writer's call returned, and raises
    when the writer's save failed."""
    root = shared_dir / "ckpts"
    results = run_ranks(_replicated_saves_in_a_checkpoint, 4, str(root), timeout=RUN)
    writer = results[0].value
    assert writer["calls"] == 1
    assert writer["returned"] and all(p.startswith(str(root) + "/.step_1.") for p in writer["returned"])
    for r in results[1:]:
        assert r.value["calls"] == 0, r  # the object was never serialised on a peer
        assert r.value["returned"] == writer["returned"], r
        assert "RemoteWriterError" in r.value["error"] and "No space left" in r.value["error"], r
    assert "No space left" in writer["error"]
    assert all(r.value["latest"] == 1 for r in results)
    step = root / "step_1"
    assert sorted(os.listdir(step / "tokenizer")) == sorted(os.path.basename(p) for p in writer["returned"])
    assert (step / "guarded" / "tokenizer.json").is_file()
    assert [n for n in os.listdir(root) if ".safeio-stage" in n] == []


def _fsyncs_per_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """A durable checkpoint with DCP's own fsync off, every ``os.fsync`` of this rank recorded by the
    path of the file it synced."""
    import stat

    import torch.distributed.checkpoint as dcp

    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: Any) -> None:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    os.fsync = recording_fsync  # type: ignore[assignment]
    try:
        ckpts = safeio.Checkpoints(root, timeout=PATIENT)
        with ckpts.save(1) as ckpt:
            writer = dcp.FileSystemWriter(ckpt.path, sync_files=False)
            dcp.save(_state(1), storage_writer=writer)
            safeio.save_pretrained(hf_objects.fast_tokenizer(), os.path.join(ckpt.path, "tokenizer"))
            stage = ckpt.path
    finally:
        os.fsync = real_fsync
    return {"synced": [os.path.relpath(p, stage) for p in synced if p.startswith(stage + "/")]}


def test_each_rank_syncs_its_share_of_a_durable_checkpoint(shared_dir: Path) -> None:
    """Issue 26, item 3: with DCP's own fsync off, a durable commit's file fsyncs are shared out among
    the ranks, which sync their shares at once; the writer syncs its own share and the manifest, not
    every rank's files one after another (on main it synced all of them, and no other rank any)."""
    root = shared_dir / "ckpts"
    results = run_ranks(_fsyncs_per_rank, 4, str(root), timeout=RUN)
    synced = {r.rank: r.value["synced"] for r in results}
    step = root / "step_1"
    files = sorted(
        str(p.relative_to(step)) for p in step.rglob("*") if p.is_file() and p.name != ".safeio-manifest.json"
    )
    everyone = [name for names in synced.values() for name in names if name != ".safeio-manifest.json"]
    assert sorted(everyone) == files, synced  # every file synced, each by exactly one rank
    for rank, names in synced.items():
        assert names, f"rank {rank} synced no file: {synced}"
    assert len(synced[0]) < len(files) / 2, synced  # the writer synced its share, not everyone's


class _CloneRecordingStore:
    """The job's store, recording which thread opens a new connection to it (``clone``)."""

    def __init__(self, store: Any, clones: list[str]) -> None:
        self._store = store
        self.clones = clones

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)  # set, get, add, check, wait, delete_key

    def clone(self) -> _CloneRecordingStore:
        import threading

        self.clones.append(threading.current_thread().name)
        return _CloneRecordingStore(self._store.clone(), self.clones)


def _async_commit_connects_off_the_training_thread(rank: int, world: int, root: str) -> dict[str, Any]:
    import concurrent.futures
    import threading

    from torch.distributed import distributed_c10d as c10d

    clones: list[str] = []
    group = safeio.Group(rank, world, store=_CloneRecordingStore(c10d._get_default_store(), clones))
    ckpts = safeio.Checkpoints(root, group=group, timeout=PATIENT)
    upload: concurrent.futures.Future[None] = concurrent.futures.Future()
    with ckpts.save(1) as ckpt:
        safeio.torch_save({"step": 1}, os.path.join(ckpt.path, "trainer_state.pt"))
        ckpt.commit_after(upload)
    before_upload = list(clones)  # what the training thread waited for
    upload.set_result(None)
    ckpts.wait()
    _every_rank_past_dcp(rank, world, "end")
    return {"training": threading.current_thread().name, "before": before_upload, "all": clones}


def test_an_async_commit_connects_to_the_store_on_its_own_thread(shared_dir: Path) -> None:
    """Issue 26, item 5: the async commit's own connection to the store (a TCPStore clone: 2-24 ms here)
    is made on the commit's thread once the upload is done, not on the training thread at the end of the
    ``with`` block (on main every rank's training thread made it there)."""
    results = run_ranks(
        _async_commit_connects_off_the_training_thread, 2, str(shared_dir / "ckpts"), timeout=RUN
    )
    for r in results:
        assert r.value["before"] == [], r  # nothing connected while training went on
        assert r.value["all"] and all(name.startswith("safeio-commit") for name in r.value["all"]), r
    assert (shared_dir / "ckpts" / "step_1" / "trainer_state.pt").is_file()
