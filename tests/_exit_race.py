"""torch's gloo teardown race at the end of a job, reproduced with our own small job (issue 33).

Run under torchrun, this file is one rank. Its training function ends the way evaluation loops end: a
metric gathered from every rank into fresh tensors, the previous batch's dropped as the next is gathered
(``all_gather``, as accelerate's ``gather`` does on gloo), and ``main()`` returns without
``destroy_process_group()``. The group is then destroyed by the interpreter's own teardown, while gloo's
worker thread may still be releasing the last gather's tensors, which takes the GIL; after finalization
began that ends the worker thread inside a C++ destructor, and the rank aborts ("terminate called without
an active exception"). Where the group's last holder is freed with the GIL held instead (a DDP model
freed after ``destroy_process_group()``, as accelerate's ``end_training()`` leaves it), the same release
hangs for ever: see docs/troubleshooting.md, which shows both and the workaround.

``--workaround`` ends ``main()`` the documented way (the lines between the markers below, which
docs/troubleshooting.md shows and tests/test_exit_race.py checks are the same). ``--safeio ROOT`` also
saves two checkpoints with ``safeio.Checkpoints`` and a replicated file, so that safeio's own exit work
(its exit handlers, its background deletion thread) runs beside the race.

`run_job` starts one job under torchrun and classifies how it ended; scripts/exit_race.py measures the
rates.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ABORT = "terminate called without an active exception"
GATHERS = 20  # evaluation batches; the race is at the last one


def _train(safeio_root: str | None) -> None:
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if safeio_root is not None:
        _save_with_safeio(safeio_root, rank)
    for _ in range(GATHERS):
        scores = torch.full((1000,), float(rank))  # a metric's inputs, a thousand numbers
        gathered = [torch.empty_like(scores) for _ in range(world)]
        dist.all_gather(gathered, scores)  # the previous batch's tensors are dropped here


_KEPT: list[object] = []  # what a script keeps to its end: safeio's objects outlive the group here


def _save_with_safeio(root: str, rank: int) -> None:
    """Two checkpoints (keep=1: step 1 is retired, its deletion on safeio's background thread, joined by
    safeio's exit handler) and a replicated file: safeio's exit work runs beside the race. The
    Checkpoints object (it holds the group's store) lives until the interpreter's teardown, as one made
    at a script's top level does."""
    import torch

    import safeio

    ckpts = safeio.Checkpoints(root, keep=1, timeout=600)
    _KEPT.append(ckpts)
    for step in (1, 2):
        with ckpts.save(step) as ckpt:
            torch.save({"rank": rank, "step": step}, os.path.join(ckpt.path, f"shard_{rank}.pt"))
    safeio.torch_save({"step": 2}, os.path.join(root, "extra_state.pt"), timeout=600)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workaround", action="store_true")
    parser.add_argument("--safeio", metavar="ROOT")
    args = parser.parse_args(argv)
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    _train(args.safeio)  # what holds the group (a DDP model, an Accelerator) lives and dies in here
    if args.workaround:
        # workaround: begin
        gc.collect()  # what reference cycles still hold (a DDP model does) goes while the group lives
        if dist.is_initialized():
            dist.destroy_process_group()  # its last holder: gloo's threads end, the interpreter whole
        # workaround: end


# ---- the parent's side: one job under torchrun, how it ended ----------------------------------------


@dataclass
class Outcome:
    kind: str  # "clean", "abort" (a rank died of the race), "hang" (killed at the bound), "other"
    seconds: float
    code: int | None  # the launcher's exit code (None: killed at the bound)
    output: str  # every rank's output
    stacks: dict[int, str]  # py-spy dumps of the ranks still alive at the bound, when asked for


def run_job(
    ranks: int,
    workdir: Path,
    *extra: str,
    bound: float,
    py_spy: str | None = None,
    env: dict[str, str] | None = None,
) -> Outcome:
    """One job of ``ranks`` ranks of this file under torchrun, to the launcher's exit or ``bound`` seconds;
    on the bound, the ranks still alive are dumped with ``py_spy`` (its path) and the tree is killed."""
    torchrun = Path(sys.executable).with_name("torchrun")
    log = workdir / "job.log"
    cmd = [os.fspath(torchrun), "--standalone", "--nproc_per_node", str(ranks), __file__, *extra]
    job_env = dict(env if env is not None else os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    began = time.monotonic()
    with open(log, "wb") as sink:
        # A session of its own: the ranks (torchrun's children) are found through /proc and killed by pid.
        proc = subprocess.Popen(
            cmd, stdout=sink, stderr=subprocess.STDOUT, env=job_env, start_new_session=True
        )
    stacks: dict[int, str] = {}
    try:
        code: int | None = proc.wait(bound)
    except subprocess.TimeoutExpired:
        from tests._launcher import descendants

        code = None
        pids = descendants(proc.pid)
        if py_spy is not None:
            for pid in pids:
                dump = subprocess.run(
                    [py_spy, "dump", "--native", "--pid", str(pid)],
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                stacks[pid] = dump.stdout + dump.stderr
        for pid in [proc.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    took = time.monotonic() - began
    output = log.read_text(errors="replace")
    if code is None:
        kind = "hang"
    elif code == 0:
        kind = "clean"
    elif ABORT in output:
        kind = "abort"
    else:
        kind = "other"
    return Outcome(kind, took, code, output, stacks)


if __name__ == "__main__":
    main()
