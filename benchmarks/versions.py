"""One ordinary save and one checkpoint, this checkout against an earlier commit, side by side in one run.

``python -m benchmarks.versions --base REV [--rounds N]`` checks REV out into a temporary git worktree,
starts one worker process per version (each imports its own ``safeio``), and interleaves them: every
round each worker times a batch of saves of every kind, alternating which goes first, so machine noise
falls on both. It prints the median ratio (this checkout / REV) per kind, with its min-max over rounds.

Used for "an ordinary save must not get slower by more than 5%" (issue 13), for fixed-cost work, and for
"Checkpoints.save within noise" when the checkpoint layer moved onto the core (issue 22): a
``checkpoint-*`` kind is one process committing a step of a 1 MB file and a replicated directory, with
retention of the third-newest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent

# The worker: each command is one batch; it answers with the median seconds per save of the batch.
_WORKER = r"""
import json, os, pathlib, statistics, sys, time
import safeio
print(safeio.__file__, flush=True)  # which checkout this worker really imported
payload = os.urandom(1 << 20)
counter = 0
checkpoints = {}

def checkpoint(durable, root):
    ckpts = checkpoints.get((durable, root))
    if ckpts is None:
        ckpts = checkpoints[durable, root] = safeio.Checkpoints(root, keep=3, durable=durable)
    start = time.perf_counter()
    with ckpts.save(counter) as ckpt:
        pathlib.Path(ckpt.path, "model.bin").write_bytes(payload)
        with safeio.replicated(os.path.join(ckpt.path, "tokenizer")) as stage:
            pathlib.Path(stage.path, "config.json").write_text(json.dumps({"n": counter}))
    return time.perf_counter() - start

def one(kind, root):
    global counter
    counter += 1
    mode, durable = kind.split("-")
    if mode == "checkpoint":
        return checkpoint(durable == "durable", root)
    target = pathlib.Path(root, f"t-{mode}")
    start = time.perf_counter()
    with safeio.replicated(target, mode=mode, durable=durable == "durable") as stage:
        pathlib.Path(stage.path, "tokenizer.json").write_bytes(payload)
        pathlib.Path(stage.path, "config.json").write_text(json.dumps({"n": counter}))
    return time.perf_counter() - start

for line in sys.stdin:
    kind, root, n = line.split()
    times = [one(kind, root) for _ in range(int(n))]
    print(statistics.median(times), flush=True)
"""

KINDS = (
    "replace-durable",
    "replace-fast",
    "merge-durable",
    "merge-fast",
    "checkpoint-durable",
    "checkpoint-fast",
)


def _worktree(rev: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", str(into), rev], check=True)
    return into


def _worker(source: Path, scratch: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(source), "PYTHONSAFEPATH": "1"}
    worker = subprocess.Popen(
        [sys.executable, "-c", _WORKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=scratch,
    )
    assert worker.stdout is not None
    imported = Path(worker.stdout.readline().strip())
    if source.resolve() not in imported.resolve().parents:
        worker.kill()
        raise RuntimeError(f"the worker for {source} imported {imported} instead")
    return worker


def _batch(worker: subprocess.Popen[str], kind: str, root: Path, n: int) -> float:
    assert worker.stdin is not None
    assert worker.stdout is not None
    worker.stdin.write(f"{kind} {root} {n}\n")
    worker.stdin.flush()
    return float(worker.stdout.readline())


def compare(base_rev: str, rounds: int, batch: int, where: list[Path]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="safeio-versions-") as tmp:
        base_src = _worktree(base_rev, Path(tmp) / "base")
        try:
            workers = {"new": _worker(HERE, Path(tmp)), "base": _worker(base_src, Path(tmp))}
            try:
                for place in where:
                    for kind in KINDS:
                        roots = {v: Path(tempfile.mkdtemp(prefix=f"{v}-", dir=place)) for v in workers}
                        ratios = []
                        _batch(workers["new"], kind, roots["new"], 3)  # warm both up
                        _batch(workers["base"], kind, roots["base"], 3)
                        for r in range(rounds):
                            order = ("new", "base") if r % 2 == 0 else ("base", "new")
                            timed = {v: _batch(workers[v], kind, roots[v], batch) for v in order}
                            ratios.append(timed["new"] / timed["base"])
                        for root in roots.values():
                            shutil.rmtree(root, ignore_errors=True)
                        results[f"{place} {kind}"] = {
                            "median": statistics.median(ratios),
                            "lo": min(ratios),
                            "hi": max(ratios),
                        }
            finally:
                for worker in workers.values():
                    worker.kill()
                    worker.wait()
        finally:
            subprocess.run(
                ["git", "-C", str(HERE), "worktree", "remove", "--force", str(base_src)], check=False
            )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.versions", description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=20, help="saves per batch")
    parser.add_argument("--disk", default="/tmp")
    parser.add_argument("--tmpfs", default="/dev/shm")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = compare(args.base, args.rounds, args.batch, [Path(args.tmpfs), Path(args.disk)])
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"time per save, this checkout / {args.base} (median of {args.rounds} rounds [min-max])")
        for name, r in results.items():
            print(f"  {name:<32} {r['median']:.3f}x  [{r['lo']:.3f}-{r['hi']:.3f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
