"""Reliability: SIGKILL a random rank (writer or not) at a random moment of a checkpoint loop, again and
again; after every kill the job restarts and resumes, as a preempted job does.

Invariants checked after every kill: ``latest()`` is the same on every rank of the restarted job, names a
committed step, and that step loads completely (``dcp.load`` of every rank's shard equals what it saved
at that step, the replicated trainer state says the step, the tokenizer loads); no step directory under
its final name is partial; retention never left zero committed checkpoints once one was committed.

The ranks are real processes sharing a real TCPStore (hosted here, so it survives the kills) through
``safeio.Group``; they do not start torch.distributed's process group, which makes a restart cost
milliseconds instead of a second (the protocol under test uses the store only), so each rank's DCP
shard is a checkpoint of its own (``no_dist``) in its own directory of the step; the killed-rank case
with real gloo ranks and one collective DCP checkpoint is in tests/test_checkpoints.py. The default scale makes 100 kills, in two
independent jobs run side by side (the suite must stay under 10 minutes); ``--scale 3`` makes 300.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import safeio
from tests._reliability import SEED, record, scaled

WORLD = 3
TIMEOUT = 0.25  # how long ranks wait for each other: a dead rank is noticed within about twice this
KILLS = scaled(100)  # 300 with scripts/reliability_report.py --scale 3
JOBS = 2
SHARD_ELEMENTS = 16 << 10  # 64 KiB of float32 per rank


def _shard(step: int, rank: int) -> Any:
    import torch

    return {"w": torch.full((SHARD_ELEMENTS,), float(step * 10 + rank))}


def _rank(rank: int, port: int, cycle: int, root: str, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from safeio.testing import hf_objects

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    group = safeio.Group(rank, WORLD, store=store, name=f"cycle{cycle}")
    # Resuming waits as long as a job's start may take (under load, longer than TIMEOUT); the saves
    # wait TIMEOUT, so that a killed rank is noticed at once.
    found = safeio.Checkpoints(root, group=group, timeout=30).latest()
    ckpts = safeio.Checkpoints(root, keep=2, group=group, timeout=TIMEOUT, durable=False)
    tokenizer = hf_objects.fast_tokenizer()
    with open(os.path.join(out, f"{cycle}-{rank}.json"), "w") as f:
        json.dump({"latest": found.step if found else None}, f)
    store.set(f"started/{rank}", "1")
    start = found.step if found else 0
    for step in range(start + 1, start + 10_000):
        with ckpts.save(step) as ckpt:
            # Sharded: each rank its own DCP files (without a process group: one DCP checkpoint per rank).
            dcp.save(_shard(step, rank), checkpoint_id=os.path.join(ckpt.path, f"rank{rank}"), no_dist=True)
            safeio.save_pretrained(tokenizer, ckpt.path, group=group)  # replicated: written once
            safeio.torch_save({"step": step}, os.path.join(ckpt.path, "trainer_state.pt"), group=group)


def _check_root(root: Path) -> tuple[int | None, int]:
    """The checkpoint a restart resumes from, checked complete; and how many are committed."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoTokenizer

    ckpts = safeio.Checkpoints(root, keep=2)
    for entry in os.listdir(root) if root.exists() else []:
        if entry.startswith("step_"):  # a stage is renamed to its final name only once it is whole
            assert safeio.verify(root / entry) == [], f"{entry} is partial under its final name"
    latest = ckpts.latest()
    if latest is None:
        return None, 0
    for rank in range(WORLD):  # dcp.load gives back exactly what each rank saved at that step
        loaded = {"w": torch.zeros(SHARD_ELEMENTS)}
        dcp.load(loaded, checkpoint_id=os.path.join(latest.path, f"rank{rank}"), no_dist=True)
        assert torch.equal(loaded["w"], _shard(latest.step, rank)["w"]), (latest, rank)
    assert torch.load(os.path.join(latest.path, "trainer_state.pt")) == {"step": latest.step}
    AutoTokenizer.from_pretrained(latest.path)  # the replicated tokenizer loads
    # The pointer names a whole step: the newest, or the one before if a kill fell between the rename
    # and the pointer's replacement (the next commit moves it on).
    assert safeio.verify(root / (root / "latest").read_text()) == []
    return latest.step, len(ckpts.steps())


def _kill_loop(root: Path, out: Path, rng: random.Random, kills: int) -> dict[str, Any]:
    """One job on ``root``: started, a random rank killed at a random moment, restarted; ``kills`` times."""
    import torch.distributed as dist

    out.mkdir(parents=True)
    ctx = mp.get_context("forkserver")
    resumed: list[int | None] = []
    committed_max = 0
    ended_before_the_kill = 0
    for cycle in range(kills):
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
        ranks = [
            ctx.Process(target=_rank, args=(r, store.port, cycle, str(root), str(out))) for r in range(WORLD)
        ]
        for proc in ranks:
            proc.start()
        # Every rank agreed on latest() and is saving.
        store.wait([f"started/{r}" for r in range(WORLD)], timedelta(seconds=60))
        time.sleep(rng.uniform(0, 0.3))  # a random moment of the loop (tens of saves): this is the point
        victim = rng.randrange(WORLD)
        try:
            os.kill(ranks[victim].pid, signal.SIGKILL)  # type: ignore[arg-type]
        except ProcessLookupError:
            # The cycle already failed: under load one rank's body outlasted TIMEOUT, so every rank raised
            # CheckpointError and left. A failure too, which must leave the root as consistent as a kill.
            ended_before_the_kill += 1
        for proc in ranks:
            proc.join(timeout=10 * TIMEOUT + 10)  # survivors raise within about twice the timeout
            assert not proc.is_alive(), f"cycle {cycle}: a rank still runs after rank {victim} was killed"
        starts = {json.loads((out / f"{cycle}-{r}.json").read_text())["latest"] for r in range(WORLD)}
        assert len(starts) == 1, f"cycle {cycle}: ranks disagreed on latest(): {starts}"
        resumed.append(starts.pop())
        step, count = _check_root(root)
        assert step is None or step >= (resumed[-1] or 0)
        if committed_max:
            assert count >= 1, f"cycle {cycle}: retention left no committed checkpoint"
        committed_max = max(committed_max, count)
    final, _ = _check_root(root)
    assert final is not None and final > 0, f"{root}: no checkpoint was ever committed"
    assert ended_before_the_kill < kills // 2, (
        f"{ended_before_the_kill} of {kills} cycles ended before the kill"
    )
    return {
        "kills": kills,
        "final_step": final,
        "resumed": resumed,
        "ended_before_the_kill": ended_before_the_kill,
    }


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # dcp.load(no_dist=True)
def test_kill_a_random_rank_of_a_checkpoint_loop_again_and_again(tmp_path: Path) -> None:
    print(f"seed {SEED}, {KILLS} kills in {JOBS} jobs")
    import torch.distributed.checkpoint  # noqa: F401 - imported here: the jobs' threads must not race
    from transformers import AutoTokenizer  # noqa: F401 - on transformers' lazy imports

    mp.get_context("forkserver").set_forkserver_preload(
        ["torch.distributed", "torch.distributed.checkpoint", "transformers", "safeio"]
    )
    # Independent jobs (own root, own store, own ranks) run side by side: a cycle mostly waits (for
    # the random moment, then for the survivors' timeout), so two jobs take little longer than one.
    reports: dict[int, Any] = {}

    def job(index: int) -> None:
        try:
            rng = random.Random(f"{SEED}-{index}")
            root, out = tmp_path / f"job{index}" / "ckpts", tmp_path / f"job{index}" / "out"
            reports[index] = _kill_loop(root, out, rng, KILLS // JOBS)
        except BaseException as exc:
            reports[index] = exc

    threads = [threading.Thread(target=job, args=(i,)) for i in range(JOBS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index in range(JOBS):
        if isinstance(reports[index], BaseException):
            raise reports[index]
    record("checkpoint_kills", {"kills": KILLS, "jobs": [reports[i] for i in range(JOBS)]})
