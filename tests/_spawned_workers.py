"""Unmodified user programs whose workers are fresh interpreters (``mp.spawn``, Lightning ``ddp_spawn``).

Each worker saves a tokenizer into one shared directory with a plain ``tokenizer.save_pretrained`` on
every rank — the seed's pattern — and reads it back. Nothing here mentions safeio: with
``SAFEIO_PATCH=1`` in the environment the start-up hook patches every worker. Run as
``python -m tests._spawned_workers spawn|lightning TARGET OUT [WORLD]``; each worker writes
``OUT/rank<r>.json`` (errors seen, whether the patch was active in it).
"""

from __future__ import annotations

import errno
import json
import os
import sys
from typing import Any

ITERATIONS = 8  # at most: every rank stops after the first iteration in which any rank failed


def _save_and_read(target: str) -> list[str]:
    from safeio.testing import hf_objects

    tok = hf_objects.fast_tokenizer()
    errors = []
    try:
        tok.save_pretrained(target)
        for name in sorted(os.listdir(target)):
            path = os.path.join(target, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    f.read()
    except OSError as exc:
        errors.append(errno.errorcode.get(exc.errno or 0, str(exc.errno)))
    except Exception as exc:
        errors.append(type(exc).__name__)
    return errors


def _report(out: str, rank: int, errors: list[str]) -> None:
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"errors": errors, "patched": bool(os.environ.get("SAFEIO_PATCH_ACTIVE"))}, f)


def save_until_a_failure(barrier: Any, failed_anywhere: Any, target: str) -> list[str]:
    """The seed's loop: line up, every rank saves and reads back; stop once any rank has failed."""
    errors: list[str] = []
    for _ in range(ITERATIONS):
        barrier()  # the ranks line up, as at the end of a training step
        errors += _save_and_read(target)
        if failed_anywhere(bool(errors)):
            break
    return errors


def _spawned(rank: int, world: int, port: int, target: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)

    def failed_anywhere(failed: bool) -> bool:
        count = torch.tensor([int(failed)])
        dist.all_reduce(count)
        return bool(count.item())

    errors = save_until_a_failure(dist.barrier, failed_anywhere, target)
    dist.barrier()
    _report(out, rank, errors)
    dist.destroy_process_group()


def run_spawn(target: str, out: str, world: int) -> None:
    import torch.multiprocessing as mp

    from safeio.testing.ranks import free_port

    mp.spawn(_spawned, args=(world, free_port(), target, out), nprocs=world, join=True)


if __name__ == "__main__":
    how, target, out = sys.argv[1:4]
    world = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    if how == "lightning":
        from tests._lightning_workers import run_lightning

        run_lightning(target, out, world)
    else:
        run_spawn(target, out, world)
