"""A training loop that checkpoints the right way, on N ranks (gloo over loopback, CPU).

- Model and optimizer state: ``torch.distributed.checkpoint`` (DCP) on **every** rank. DCP is collective
  and writes rank-disjoint files; never wrap it in "rank 0 only" (it would deadlock) nor in safeio.
- Replicated files (tokenizer, config, generation config, trainer state): ``safeio`` — every rank
  calls it, one writes, atomically, and the others wait for the outcome.
- Resume: DCP loads the shards back on every rank; ``from_pretrained`` reads the replicated files.

Run: python examples/checkpoint_loop.py [--ranks 2] [--steps 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

import safeio
from safeio.testing import hf_objects
from safeio.testing.ranks import run_ranks


def save_checkpoint(directory: str, step: int, model: Any, optimizer: Any, tokenizer: Any) -> None:
    import torch.distributed.checkpoint as dcp

    # Collective and sharded: every rank, no guard, no safeio.
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=f"{directory}/dcp")
    # Replicated: every rank calls, safeio makes it one atomic write.
    safeio.save_pretrained(tokenizer, directory)
    safeio.save_pretrained(model.config, directory)
    safeio.save_pretrained(model.generation_config, directory)
    with safeio.replicated(os.path.join(directory, "trainer"), mode="replace") as stage:
        if stage.is_writer:
            with open(os.path.join(stage.path, "trainer_state.json"), "w") as f:
                json.dump({"step": step}, f)


def load_checkpoint(directory: str, model: Any, optimizer: Any) -> int:
    import torch.distributed.checkpoint as dcp
    from transformers import AutoTokenizer

    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=f"{directory}/dcp")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    AutoTokenizer.from_pretrained(directory)  # the replicated files load as usual
    with open(os.path.join(directory, "trainer", "trainer_state.json")) as f:
        return int(json.load(f)["step"])


def rank_main(rank: int, world: int, root: str, steps: int) -> dict[str, Any]:
    import torch

    model = hf_objects.tiny_model(seed=0)
    tokenizer = hf_objects.fast_tokenizer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randint(0, 64, (2, 8))
    for step in range(1, steps + 1):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        for p in model.parameters():  # a data-parallel step: average gradients across ranks
            torch.distributed.all_reduce(p.grad)
            p.grad /= world
        optimizer.step()
        optimizer.zero_grad()
        save_checkpoint(os.path.join(root, f"checkpoint-{step}"), step, model, optimizer, tokenizer)
    # Resume into a fresh model from the last checkpoint.
    fresh = hf_objects.tiny_model(seed=123)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1)
    resumed_step = load_checkpoint(os.path.join(root, f"checkpoint-{steps}"), fresh, fresh_optimizer)
    same = all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True)
    )
    return {"resumed_step": resumed_step, "weights_match": same, "loss": float(loss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="safeio-loop-")
    for result in run_ranks(rank_main, args.ranks, root, args.steps, timeout=600):
        print(f"rank {result.rank}: {result.value}")
    last = os.path.join(root, f"checkpoint-{args.steps}")
    print(f"{last}: {sorted(os.listdir(last))}")


if __name__ == "__main__":
    main()
