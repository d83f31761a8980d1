"""The engine on real torch.distributed ranks (gloo on loopback): one writer, bounded waits, outcomes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import safeio
from safeio.testing.ranks import run_ranks
from tests._bounds import PATIENT, RUN


def _watch_writes(parent: str) -> list[str]:
    """Record this process's Python-level opens for writing, and mkdirs, under ``parent``."""
    seen: list[str] = []

    def hook(event: str, args: tuple[object, ...]) -> None:
        if event == "open" and isinstance(args[0], str) and args[0].startswith(parent):
            mode, flags = args[1], args[2]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            )
            if writing:
                seen.append(f"open {args[0]}")
        elif event in ("os.mkdir", "os.rename", "os.replace", "os.remove", "shutil.rmtree"):
            path = os.fspath(args[0]) if args and isinstance(args[0], (str, os.PathLike)) else ""
            if isinstance(path, str) and path.startswith(parent):
                seen.append(f"{event} {path}")

    sys.addaudithook(hook)
    return seen


def _leave_together(rank: int, world: int) -> None:
    """Rank 0 hosts the store: it stays until every peer has heard the outcomes. Left to chance, on a
    loaded machine rank 0 finished first and took the store with it while a peer still waited for the
    writer's published failure, which no filesystem shows (issue 37: PeerTimeout). A rank gone while a
    peer waits is test_store_gone_peers_fall_back_to_the_filesystem's subject."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    if store.add("leave", 1) == world:
        store.set("leave/all", "1")
    store.wait(["leave/all"], timedelta(seconds=PATIENT))
    if rank != 0:
        store.set(f"leave/{rank}", "1")
    else:
        store.wait([f"leave/{r}" for r in range(1, world)], timedelta(seconds=PATIENT))


def _save_everywhere(rank: int, world: int, target: str) -> dict[str, object]:
    writes = _watch_writes(os.path.dirname(target))
    with safeio.replicated(target, timeout=PATIENT) as stage:
        with open(os.path.join(stage.path, "tokenizer.json"), "w") as f:
            f.write(f'{{"written_by": {rank}}}')
        os.mkdir(os.path.join(stage.path, "sub"))
        with open(os.path.join(stage.path, "sub", "vocab.txt"), "w") as f:
            f.write("a\nb\n" * 1000)
        stage_path = stage.path
    # On return the promoted target must be complete, on every rank.
    return {
        "complete": safeio.is_complete(target),
        "content": Path(target, "tokenizer.json").read_text(),
        "stage_in_parent": stage_path.startswith(os.path.dirname(target)),
        "stage_left": os.path.exists(stage_path),
        "writes": list(writes),
    }


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_one_writer_every_rank_sees_the_promoted_target(shared_dir: Path, world: int) -> None:
    target = str(shared_dir / "ckpt" / "tokenizer")
    results = run_ranks(_save_everywhere, world, target, timeout=RUN)
    for r in results:
        assert r.value["complete"], r
        assert r.value["content"] == '{"written_by": 0}'
        assert r.value["stage_left"] is False
        if r.rank == 0:
            assert r.value["stage_in_parent"] and r.value["writes"]
        else:
            # Non-writers never write under the target's parent: their stage is node-local scratch.
            assert r.value["stage_in_parent"] is False
            assert r.value["writes"] == []
    assert sorted(os.listdir(shared_dir / "ckpt")) == ["tokenizer"]  # a first save takes no lock


def _only_rank0_saves(rank: int, world: int, target: str) -> str:
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    if rank == 0:  # the already-guarded shape: HF Trainer's should_save, accelerate's is_main_process
        try:
            with safeio.replicated(target, timeout=PATIENT) as stage:
                Path(stage.path, "config.json").write_text("{}")
        finally:
            store.set("saved", "1")
        return "returned"
    # The peers call no save, and wait for the writer to return: a writer that waited for them would
    # wait for ever (its timeout), not by time but by the outcome (PeerTimeout).
    store.wait(["saved"], timedelta(seconds=RUN))
    return "released"


def test_guarded_shape_writer_returns_without_waiting(shared_dir: Path) -> None:
    target = str(shared_dir / "cfg")
    results = run_ranks(_only_rank0_saves, 4, target, timeout=RUN)
    assert [r.value for r in results] == ["returned", "released", "released", "released"]
    assert safeio.is_complete(target)


def _writer_body_fails(rank: int, world: int, target: str) -> str:
    try:
        with safeio.replicated(target, timeout=PATIENT) as stage:
            Path(stage.path, "tokenizer.json").write_text("new")
            if stage.is_writer:
                raise ValueError("tokenizer exploded")
    except safeio.RemoteWriterError as exc:
        assert exc.error_type == "ValueError" and exc.writer_rank == 0 and exc.path == target
        outcome = f"remote: {exc}"
    except ValueError as exc:
        outcome = f"own: {exc}"
    else:
        outcome = "no error"
    _leave_together(rank, world)
    return outcome


def test_writer_failure_reaches_every_rank_and_target_is_untouched(shared_dir: Path) -> None:
    target = shared_dir / "tok"
    with safeio.replicated(target) as stage:
        Path(stage.path, "tokenizer.json").write_text("old")
    results = run_ranks(_writer_body_fails, 4, str(target), timeout=RUN)
    assert results[0].value == "own: tokenizer exploded"
    for r in results[1:]:
        assert r.value.startswith("remote: ") and "tokenizer exploded" in r.value and str(target) in r.value
    assert (target / "tokenizer.json").read_text() == "old"
    assert sorted(os.listdir(shared_dir)) == ["tok"]  # a first save takes no lock (and makes no lock file)


def _writer_hangs(rank: int, world: int, target: str, timeout: float) -> dict[str, object]:
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    start = time.monotonic()
    try:
        with safeio.replicated(target, timeout=timeout) as stage:
            if stage.is_writer:
                # Stands for a writer stuck in the kernel; released once every peer has timed out. Its
                # own bound is far beyond the peers' timeout: a peer that did not end by its timeout
                # would end only at this one, with another error.
                store.wait(["all-timed-out"], timedelta(seconds=timeout + PATIENT))
    except safeio.PeerTimeout as exc:
        if store.add("timed-out", 1) == world - 1:
            store.set("all-timed-out", "1")
        return {
            "error": str(exc),
            "phase": exc.phase,
            "waited_for": exc.waited_for,
            "took": time.monotonic() - start,
        }
    return {"error": None, "took": time.monotonic() - start}


def test_a_writer_that_never_finishes_makes_peers_time_out(shared_dir: Path) -> None:
    target = str(shared_dir / "stuck")
    timeout = 3.0
    results = run_ranks(_writer_hangs, 4, target, timeout, timeout=RUN)
    assert results[0].value["error"] is None
    for r in results[1:]:
        v = r.value
        assert v["error"] is not None, v
        # The timeout is the subject: never before it; after it, by as much as load delays a wake-up
        # (well under a minute), never by the writer's hold (PATIENT), which another wait would meet.
        assert timeout <= v["took"] < timeout + 60, v
        assert v["waited_for"] == 0 and v["phase"] == "body"
        assert "rank 0" in v["error"] and "in body of" in v["error"] and target in v["error"]


def _rank0_exits_first(rank: int, world: int, target: str) -> bool:
    """Rank 0 (the TCPStore's host) saves and leaves; the others call the save afterwards."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    if rank == 0:
        store.set("rank0-pid", str(os.getpid()))
    else:
        pid = int(store.get("rank0-pid"))
        deadline = time.monotonic() + PATIENT
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)  # bounded poll: rank 0 is not our child, so there is no wait() to block on
    with safeio.replicated(target, timeout=PATIENT) as stage:  # one save, made from one line on every rank
        Path(stage.path, "f").write_text("x" if stage.is_writer else "ignored")
    if rank == 0:
        dist.destroy_process_group()
        os._exit(0)  # like the end of a run: the store goes with this process
    return safeio.is_complete(target)


def test_store_gone_peers_fall_back_to_the_filesystem(shared_dir: Path) -> None:
    target = str(shared_dir / "late")
    results = run_ranks(_rank0_exits_first, 3, target, check=False, timeout=RUN)
    assert [r.value for r in results[1:]] == [True, True], results


def _storeless(rank: int, world: int, target: str) -> bool:
    group = safeio.Group(rank, world)  # RANK/WORLD_SIZE only: no store, peers watch the filesystem
    with safeio.replicated(target, group=group, timeout=PATIENT) as stage:
        if stage.is_writer:
            # Not synchronisation: it widens the window in which a peer that returned without waiting
            # for the promotion would read no "f" (the assertion below), so that such a bug shows.
            time.sleep(0.5)
        Path(stage.path, "f").write_text(str(rank))
    return Path(target, "f").read_text() == "0"


def test_storeless_group_waits_for_the_promoted_target(shared_dir: Path) -> None:
    target = str(shared_dir / "nostore")
    results = run_ranks(_storeless, 3, target, timeout=RUN)
    assert all(r.value for r in results)


def _bad_input(rank: int, world: int, shared: str) -> dict[str, str]:
    out = {}
    Path(shared, "afile").write_text("x") if rank == 0 else None
    import torch.distributed as dist

    dist.barrier()
    cases = {
        "empty": "",
        "parent_is_file": os.path.join(shared, "afile", "tok"),
        "target_is_file": os.path.join(shared, "afile"),
    }
    for name, target in cases.items():
        try:
            with safeio.replicated(target, timeout=PATIENT) as stage:
                Path(stage.path, "x").write_text("x")
        except safeio.SafeIOError as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        else:
            out[name] = "saved"
    _leave_together(rank, world)
    return out


def test_bad_input_is_a_clear_error_on_every_rank(shared_dir: Path) -> None:
    results = run_ranks(_bad_input, 4, str(shared_dir), timeout=RUN)
    for r in results:
        assert r.value["empty"].startswith("InvalidTargetError: target path is empty")
        for case in ("parent_is_file", "target_is_file"):
            message = r.value[case]
            expected = "InvalidTargetError" if r.rank == 0 else "RemoteWriterError"
            assert message.startswith(expected), (r.rank, message)
            assert str(shared_dir / "afile") in message
    assert Path(shared_dir, "afile").read_text() == "x"


def _not_writable(rank: int, world: int, parent: str) -> str:
    os.setgid(65534)
    os.setuid(65534)  # run as nobody: root would ignore the missing write permission
    try:
        with safeio.replicated(os.path.join(parent, "tok"), timeout=PATIENT) as stage:
            Path(stage.path, "x").write_text("x")
    except safeio.SafeIOError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    else:
        outcome = "saved"
    _leave_together(rank, world)
    return outcome


def test_parent_not_writable(shared_dir: Path) -> None:
    parent = shared_dir / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    results = run_ranks(_not_writable, 2, str(parent), timeout=RUN)
    assert results[0].value.startswith("PromotionError") and "ermission denied" in results[0].value
    assert str(parent) in results[0].value
    assert results[1].value.startswith("RemoteWriterError") and "PromotionError" in results[1].value
    assert os.listdir(parent) == []


def _torch_save_everywhere(rank: int, world: int, path: str) -> float:
    import torch

    safeio.torch_save({"step": 5, "rank_seen": rank}, path, timeout=PATIENT)
    return float(torch.load(path)["rank_seen"])


def test_torch_save_writes_once(shared_dir: Path) -> None:
    path = str(shared_dir / "extra_state.pt")
    results = run_ranks(_torch_save_everywhere, 3, path, timeout=RUN)
    assert [r.value for r in results] == [0.0, 0.0, 0.0]
    assert sorted(os.listdir(shared_dir)) == ["extra_state.pt"]


def _subgroup_save(rank: int, world: int, root: str) -> str:
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    target = os.path.join(root, f"group{rank // 2}")
    with safeio.replicated(target, group=mine, timeout=PATIENT) as stage:
        Path(stage.path, "who").write_text(str(rank))
    return Path(target, "who").read_text()


def test_process_subgroups_each_have_their_own_writer(shared_dir: Path) -> None:
    results = run_ranks(_subgroup_save, 4, str(shared_dir), timeout=RUN)
    assert [r.value for r in results] == ["0", "0", "2", "2"]


def _superseded(rank: int, world: int, target: str) -> str:
    """The peer is slow: by the time it looks, a rival job has replaced the target again."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    with safeio.replicated(target, timeout=PATIENT) as stage:
        Path(stage.path, "f").write_text(f"ours {rank}")
        if not stage.is_writer:
            store.wait(["rival-done"], timedelta(seconds=PATIENT))  # hold the peer back until the rival saved
    if rank == 0:
        # Another job (its own process, no launcher variables) replaces the target meanwhile.
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        }
        code = (
            "import pathlib, sys, safeio\n"
            "with safeio.replicated(sys.argv[1], timeout=600) as stage:\n"
            "    pathlib.Path(stage.path, 'f').write_text('rival')\n"
        )
        subprocess.run([sys.executable, "-c", code, target], env=env, check=True, timeout=PATIENT)
        store.set("rival-done", "1")
    return Path(target, "f").read_text()


def test_a_peer_whose_save_was_superseded_returns(shared_dir: Path) -> None:
    """The store may be gone and the manifest may show a newer save: the peer must not time out."""
    target = str(shared_dir / "busy")
    results = run_ranks(_superseded, 2, target, timeout=RUN)
    assert [r.value for r in results] == ["rival", "rival"]
