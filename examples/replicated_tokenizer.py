"""Every rank saves the tokenizer, as unmodified training code does; safeio makes it one atomic write.

Run: python examples/replicated_tokenizer.py [--ranks 4] [--dir DIR]
It launches N ranks on torch.distributed (gloo over loopback), builds a small tokenizer in code (no
model hub needed), and has every rank call ``safeio.save_pretrained(tokenizer, shared_dir)``. Only rank
0 writes, into a private stage that is renamed into place; the other ranks wait for its published
outcome and then load the tokenizer back.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import safeio
from safeio.testing import hf_objects
from safeio.testing.ranks import run_ranks


def rank_main(rank: int, world: int, target: str) -> str:
    from transformers import AutoTokenizer

    tokenizer = hf_objects.fast_tokenizer()  # built in code: no model hub needed
    start = time.monotonic()
    group = safeio.current_group()
    safeio.save_pretrained(tokenizer, target)  # every rank calls it, exactly like tokenizer.save_pretrained
    took = (time.monotonic() - start) * 1e3
    reloaded = AutoTokenizer.from_pretrained(target)
    ids = reloaded("hello world")["input_ids"]
    role = "wrote it" if group.is_writer else "waited for rank 0"
    return f"rank {rank}/{world}: {role} in {took:.1f} ms; reloaded, 'hello world' -> {ids}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--dir", default=None, help="shared directory (default: a new temp dir)")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="safeio-example-")
    target = os.path.join(root, "checkpoint-1", "tokenizer")
    print(f"{args.ranks} ranks save one tokenizer into {target}")
    for result in run_ranks(rank_main, args.ranks, target, timeout=300):
        print("  " + result.value)
    print("files:", sorted(os.listdir(target)))
    print("complete per manifest:", safeio.is_complete(target))


if __name__ == "__main__":
    main()
