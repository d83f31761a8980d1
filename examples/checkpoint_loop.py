"""A training loop that checkpoints the right way, on N ranks (gloo over loopback, CPU): save, crash, resume.

- ``safeio.Checkpoints`` stages each checkpoint beside its final name and commits it once every rank
  has written its part: model and optimizer through ``torch.distributed.checkpoint`` (sharded: every
  rank writes its own files), tokenizer, config and trainer state through safeio (written once).
- ``latest()`` is the newest *committed* checkpoint, the same on every rank: a save interrupted by a
  crash is never resumed from.

Run: python examples/checkpoint_loop.py [--ranks 2] [--steps 3] [--crash-at STEP] [--dir DIR] [--timeout S]
With ``--crash-at``, one rank dies in the middle of that step's save; run the same command again
(without it) and the loop resumes from the last committed step.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import safeio
from safeio.testing import hf_objects
from safeio.testing.ranks import run_ranks


def rank_main(
    rank: int, world: int, root: str, steps: int, crash_at: int | None, timeout: float
) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoTokenizer

    model = hf_objects.tiny_model(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokenizer = hf_objects.fast_tokenizer()
    ckpts = safeio.Checkpoints(root, keep=2, name="checkpoint-{step}", timeout=timeout)

    start = 0
    found = ckpts.latest()  # every rank gets the same answer
    if found is not None:
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=found.path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        AutoTokenizer.from_pretrained(found.path)  # the replicated files load as usual
        start = int(torch.load(os.path.join(found.path, "trainer_state.pt"))["step"])

    batch = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for step in range(start + 1, steps + 1):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        for p in model.parameters():  # a data-parallel step: average gradients across ranks
            torch.distributed.all_reduce(p.grad)
            p.grad /= world
        optimizer.step()
        optimizer.zero_grad()
        with ckpts.save(step) as ckpt:
            dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=ckpt.path)
            if step == crash_at and rank == world - 1:
                os._exit(1)  # a preempted node: this step's checkpoint must never be resumed from
            safeio.save_pretrained(tokenizer, ckpt.path)
            safeio.save_pretrained(model.config, ckpt.path)
            safeio.torch_save({"step": step}, os.path.join(ckpt.path, "trainer_state.pt"))
    latest = ckpts.latest()
    return {"resumed_from": start, "latest": latest.step if latest else None, "steps": ckpts.steps()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--crash-at", type=int, default=None)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--timeout", type=float, default=60.0, help="how long ranks wait for each other")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="safeio-loop-")
    results = run_ranks(
        rank_main, args.ranks, root, args.steps, args.crash_at, args.timeout, timeout=600, check=False
    )
    for result in results:
        print(f"rank {result.rank}: {result.value if result.error is None else repr(result.error)[:200]}")
    print(f"{root}: {sorted(os.listdir(root))}")
    raise SystemExit(0 if all(r.error is None for r in results) else 1)


if __name__ == "__main__":
    main()
