#!/usr/bin/env python3
"""How far one save travels through safeio's code: the files, classes and file-to-file transitions of
one ``Checkpoints.save`` (2 gloo ranks, the writer traced, a tokenizer and a DCP shard in its body)
and of one merge ``save_pretrained`` (one process), counted with ``sys.settrace``.

    .venv/bin/python scripts/trace_save.py [--show]

A *transition* is a change of the safeio file whose code runs (a call into another file, or a return
to one). Only code under ``safeio/`` counts, ``safeio/testing`` excluded; what the body calls (DCP,
the tokenizer) is not safeio's and is left out. The second save of each kind is traced, so that
first-call work (imports, caches) does not count.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent  # the checkout whose safeio is traced
sys.path.insert(0, str(ROOT))

import safeio  # noqa: E402

PACKAGE = str(Path(safeio.__file__).parent) + os.sep
EXCLUDED = PACKAGE + "testing" + os.sep


@dataclass
class Trace:
    files: list[str] = field(default_factory=list)  # in order of first arrival
    classes: set[str] = field(default_factory=set)
    transitions: int = 0
    path: list[str] = field(default_factory=list)  # the sequence of files, one entry per transition

    def summary(self) -> str:
        return f"{len(self.files)} files, {len(self.classes)} classes, {self.transitions} transitions"


def _ours(filename: str) -> bool:
    return filename.startswith(PACKAGE) and not filename.startswith(EXCLUDED)


@contextmanager
def traced() -> Iterator[Trace]:
    trace = Trace()
    stack: list[str] = []  # the safeio file of each frame on the stack ("" where not ours)

    def current() -> str:
        for name in reversed(stack):
            if name:
                return name
        return ""

    def arrive(before: str) -> None:
        now = current()
        if now and now != before:
            if before:
                trace.transitions += 1
            trace.path.append(now)
            if now not in trace.files:
                trace.files.append(now)

    def tracer(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if event == "call":
            before = current()
            filename = frame.f_code.co_filename
            ours = _ours(filename)
            stack.append(os.path.relpath(filename, PACKAGE) if ours else "")
            if ours:
                qualname = frame.f_code.co_qualname
                owner = qualname.rsplit(".", 1)[0] if "." in qualname else ""
                if owner and "<locals>" not in owner and owner[0].isupper():
                    trace.classes.add(f"{os.path.relpath(filename, PACKAGE)}:{owner}")
            arrive(before)
            return tracer
        if event == "return" and stack:
            before = current()
            stack.pop()
            arrive(before)
        return tracer

    sys.settrace(tracer)
    threading.settrace(tracer)
    try:
        yield trace
    finally:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]


def checkpoint_save(root: str, traces: dict[str, Trace]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from safeio.testing import hf_objects

    model, tokenizer = torch.nn.Linear(4, 4), hf_objects.fast_tokenizer()
    ckpts = safeio.Checkpoints(root, keep=2, name="checkpoint-{step}")
    for step in (1, 2):
        context = traced() if step == 2 and dist.get_rank() == 0 else _untraced()
        with context as trace, ckpts.save(step) as ckpt:
            dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt.path)
            safeio.save_pretrained(tokenizer, ckpt.path)
        if trace is not None:
            traces["Checkpoints.save"] = trace


@contextmanager
def _untraced() -> Iterator[None]:
    yield None


def _rank(rank: int, world_size: int, root: str) -> dict[str, tuple[list[str], list[str], int, list[str]]]:
    traces: dict[str, Trace] = {}
    checkpoint_save(root, traces)
    return {k: (t.files, sorted(t.classes), t.transitions, t.path) for k, t in traces.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--show", action="store_true", help="print the files, classes and path too")
    args = parser.parse_args()
    from safeio.testing import hf_objects
    from safeio.testing.ranks import run_ranks

    results: dict[str, Trace] = {}
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = run_ranks(_rank, 2, os.path.join(tmp, "ckpts"), timeout=600)
        files, classes, transitions, path = outcomes[0].value["Checkpoints.save"]
        results["Checkpoints.save (2 ranks, the writer)"] = Trace(files, set(classes), transitions, path)

        tokenizer = hf_objects.fast_tokenizer()
        target = os.path.join(tmp, "merge")
        safeio.save_pretrained(tokenizer, target)
        with traced() as trace:
            safeio.save_pretrained(tokenizer, target)
        results["save_pretrained, merge (1 process)"] = trace
    for name, trace in results.items():
        print(f"{name}: {trace.summary()}")
        if args.show:
            print("  files:", ", ".join(trace.files))
            print("  classes:", ", ".join(sorted(trace.classes)))
            print("  path:", " -> ".join(trace.path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
