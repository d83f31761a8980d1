"""What ``safeio demo``'s child processes run: the ranks (both patterns) and the reader.

The ranks run under ``safeio.testing.ranks.run_ranks`` (real gloo ranks on loopback). Both patterns
run in the same rank processes, one after the other, so torch and transformers are imported once; the
parent starts each pattern with an event and is told of progress through a queue, so it can count the
filesystem's operations and hazards per pattern and switch the reader between patterns.
"""

from __future__ import annotations

import os
import time
from typing import Any

PATTERNS = ("unguarded", "safeio")
# What each pattern calls on every rank, for the demo's output.
DESCRIPTIONS = {
    "unguarded": "every rank calls tokenizer.save_pretrained(shared_dir), then loads it back",
    "safeio": "every rank calls safeio.save_pretrained(tokenizer, shared_dir), then loads it back",
}
_MAX_ERRORS = 3
VOCAB = 40_000


def build_tokenizer(vocab: int = VOCAB) -> Any:
    """A fast tokenizer built in code (no model hub needed), its tokenizer.json about 1 MB.

    The size matters: real tokenizer.json files are 1-10 MB, and the longer a file is open for writing
    or reading, the likelier another rank truncates it meanwhile, which is the NFS hazard.
    """
    from safeio.testing import hf_objects

    return hf_objects.fast_tokenizer(words=vocab)


def _quiet() -> None:
    # The unguarded pattern fails on purpose; transformers would log every failure at length.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from transformers.utils import logging as hf_logging

    set_verbosity_error: Any = hf_logging.set_verbosity_error
    set_verbosity_error()


class Tally:
    def __init__(self) -> None:
        self.attempts = 0
        self.failures = 0
        self.errors: list[str] = []

    def attempt(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        self.attempts += 1
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            self.failures += 1
            text = f"{type(exc).__name__}: {str(exc)[:160]}"
            if len(self.errors) < _MAX_ERRORS and text not in self.errors:
                self.errors.append(text)

    def to_dict(self) -> dict[str, Any]:
        return {"attempts": self.attempts, "failures": self.failures, "errors": list(self.errors)}


def _save(pattern: str, tokenizer: Any, target: str, timeout: float) -> None:
    if pattern == "unguarded":
        tokenizer.save_pretrained(target)
        return
    import safeio

    safeio.save_pretrained(tokenizer, target, timeout=timeout)


def rank_main(rank: int, world: int, plan: dict[str, Any], messages: Any, go: list[Any]) -> int:
    """One rank: seed (rank 0), then for each pattern wait for the parent's go and save+load K times."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    messages.put(("hello", rank, os.getpid()))
    _quiet()
    tokenizer = build_tokenizer()
    if rank == 0:
        # A checkpoint from an earlier step already exists, so the reader has something to load from the
        # start. Written beside the mount (in its backing directory): no operations, no hazards counted.
        for seed in plan["seeds"]:
            tokenizer.save_pretrained(seed)
    # What the first safeio save would import lazily, imported now: wall times compare saves, not imports
    # (free when the forkserver preloaded it).
    import transformers.modeling_utils  # noqa: F401

    dist.barrier()
    messages.put(("ready", rank, os.getpid()))
    for index, pattern in enumerate(PATTERNS):
        if not go[index].acquire(timeout=plan["timeout"]):
            raise TimeoutError(f"rank {rank}: the demo did not start the {pattern} pattern in time")
        target = plan["targets"][pattern]
        saves, loads = Tally(), Tally()
        for iteration in range(plan["iterations"]):
            dist.barrier()  # every rank saves at the same moment, as after a training step
            saves.attempt(_save, pattern, tokenizer, target, plan["timeout"])
            loads.attempt(AutoTokenizer.from_pretrained, target)
            messages.put(("progress", rank, index, iteration + 1))
        messages.put(("done", rank, index, {"saves": saves.to_dict(), "loads": loads.to_dict()}))
    return os.getpid()


def reader_main(plan: dict[str, Any], commands: Any, messages: Any, stops: list[Any]) -> None:
    """A process that only reads: loads the tokenizer in a loop while a pattern runs."""
    from transformers import AutoTokenizer

    _quiet()
    messages.put(("reader-ready", os.getpid()))
    while True:
        command = commands.get(timeout=plan["timeout"])
        if command[0] == "quit":
            return
        _, index, target = command
        loads = Tally()
        loads.attempt(AutoTokenizer.from_pretrained, target)
        messages.put(("reader-started", index))
        while not stops[index].is_set():
            loads.attempt(AutoTokenizer.from_pretrained, target)
            time.sleep(0.001)  # yield the CPU to the ranks on small machines; not synchronisation
        messages.put(("reader-done", index, loads.to_dict()))
