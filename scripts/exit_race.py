#!/usr/bin/env python3
"""How often a gloo job fails to exit: torch's teardown race at interpreter exit (issue 33), measured.

Runs our own small job (tests/_exit_race.py: ranks under torchrun whose main() ends right after an
all_gather, without destroy_process_group) RUNS times per variant and counts how each run ended:

- ``clean``: the launcher exited 0;
- ``abort``: a rank died of the race ("terminate called without an active exception", SIGABRT);
- ``hang``: still running at ``--bound`` (killed then; with ``--py-spy``, the ranks still alive are
  dumped first, ``py-spy dump --native``, into the output directory);
- ``other``: any other failure (its output is kept).

Variants: ``plain``; ``safeio`` (the job also saves two checkpoints with safeio.Checkpoints and a
replicated file, so safeio's exit handlers and background threads run beside the race); ``workaround``
and ``safeio+workaround`` (main() ends with the documented workaround). Variants are interleaved run by
run, so the machine's load falls on each alike.

    .venv/bin/python scripts/exit_race.py --runs 40 --ranks 4 --py-spy .venv/bin/py-spy

Prints one line per run and a table (paste it into docs/troubleshooting.md); exit code 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, os.fspath(ROOT))  # the job and its runner live beside the tests, as `tests._exit_race`

from tests._exit_race import run_job  # noqa: E402

VARIANTS = {
    "plain": [],
    "safeio": ["--safeio", "{root}"],
    "workaround": ["--workaround"],
    "safeio+workaround": ["--safeio", "{root}", "--workaround"],
}
KINDS = ("clean", "abort", "hang", "other")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=30, help="runs per variant (default 30)")
    parser.add_argument("--ranks", type=int, default=4, help="ranks per job (default 4)")
    parser.add_argument("--bound", type=float, default=180.0, help="seconds before a run counts as hung")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS)
    )
    parser.add_argument("--py-spy", help="py-spy's path: dump the ranks of a hung run before killing them")
    parser.add_argument(
        "--out", help="directory for the dumps and the failed runs' output (default: a new /tmp one)"
    )
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s): {', '.join(unknown)}")
    out = Path(args.out or tempfile.mkdtemp(prefix="safeio-exit-race-"))
    out.mkdir(parents=True, exist_ok=True)
    counts = {v: Counter[str]() for v in variants}
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    print(f"{args.runs} runs x {variants} on {args.ranks} gloo ranks; output in {out}", flush=True)
    for run in range(1, args.runs + 1):
        for variant in variants:
            with tempfile.TemporaryDirectory(prefix="exit-race-") as work:
                extra = [a.format(root=os.path.join(work, "ckpts")) for a in VARIANTS[variant]]
                outcome = run_job(args.ranks, Path(work), *extra, bound=args.bound, py_spy=args.py_spy)
            counts[variant][outcome.kind] += 1
            seconds[variant].append(outcome.seconds)
            note = ""
            if outcome.kind != "clean":
                kept = out / f"{variant.replace('+', '-')}-{run}"
                kept.mkdir()
                (kept / "job.log").write_text(outcome.output)
                for pid, stack in outcome.stacks.items():
                    (kept / f"py-spy-{pid}.txt").write_text(stack)
                note = f" -> {kept}"
            print(f"run {run:3d} {variant:18s} {outcome.kind:6s} {outcome.seconds:6.1f} s{note}", flush=True)
    print()
    print("| variant | runs | clean | abort | hang | other | median s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for variant in variants:
        c, times = counts[variant], sorted(seconds[variant])
        median = times[len(times) // 2]
        cells = " | ".join(str(c[k]) for k in KINDS)
        print(f"| {variant} | {sum(c.values())} | {cells} | {median:.1f} |")
    (out / "counts.json").write_text(json.dumps({v: dict(c) for v, c in counts.items()}, indent=1))
    print(
        f"\ntorch {_version('torch')}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs; {time.ctime()}"
    )
    return 0


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    sys.exit(main())
