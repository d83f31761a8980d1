"""``python -m benchmarks [--quick] [--only NAME ...] [--out DIR]`` (``./dev.sh bench``)."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks import _plot, _report
from benchmarks._core import Result

# Into the docs site: docs/benchmarks/results/results.md is the page "Benchmarks: every figure".
DEFAULT_OUT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks", "results"
)


def _registry(disk: str, tmpfs: str) -> dict[str, Callable[[bool], Result]]:
    # Imported lazily: `--only promotion` must not pay for transformers or torch.distributed.
    def wrapper(quick: bool) -> Result:
        from benchmarks import wrapper

        return wrapper.run(quick, disk=disk, tmpfs=tmpfs)

    def atomic(quick: bool) -> Result:
        from benchmarks import atomic_write

        return atomic_write.run(quick, disk=disk)

    def scaling(quick: bool) -> Result:
        from benchmarks import scaling

        return scaling.run(quick, disk=disk)

    def promotion(quick: bool) -> Result:
        from benchmarks import promotion

        return promotion.run(quick, disk=disk, other=tmpfs)

    def control(quick: bool) -> Result:
        from benchmarks import control

        return control.run(quick, tmpfs=tmpfs)

    def checkpoints(quick: bool) -> Result:
        from benchmarks import checkpoints

        return checkpoints.run(quick, disk=disk)

    def rank_fsyncs(quick: bool) -> Result:
        from benchmarks import rank_fsyncs

        return rank_fsyncs.run(quick, disk=disk)

    def async_blocking(quick: bool) -> Result:
        from benchmarks import async_blocking

        return async_blocking.run(quick, disk=disk)

    def history(quick: bool) -> Result:
        from benchmarks import history

        return history.run(quick, disk=disk)

    def seed(quick: bool) -> Result:
        from benchmarks import seed

        return seed.run(quick, disk=disk)

    def peers(quick: bool) -> Result:
        from benchmarks import peers

        return peers.run(quick, disk=disk)

    return {
        "wrapper": wrapper,
        "atomic": atomic,
        "scaling": scaling,
        "promotion": promotion,
        "control": control,
        "checkpoints": checkpoints,
        "rank_fsyncs": rank_fsyncs,
        "async_blocking": async_blocking,
        "history": history,
        "peers": peers,
        "seed": seed,
    }


def main(argv: list[str] | None = None) -> int:
    names = list(_registry("", ""))
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="few sizes and repetitions (smoke test)")
    parser.add_argument(
        "--only",
        action="append",
        choices=names,
        metavar="NAME",
        help=f"run only this benchmark (repeatable): {', '.join(names)}",
    )
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help="output directory (default: docs/benchmarks/results)"
    )
    parser.add_argument("--disk", default="/tmp", help="a directory on local disk (default /tmp)")
    parser.add_argument("--tmpfs", default="/dev/shm", help="a directory on tmpfs (default /dev/shm)")
    args = parser.parse_args(argv)
    registry = _registry(args.disk, args.tmpfs)
    chosen = args.only or names
    # With --only, keep the other benchmarks' last results: results.md stays one complete document.
    previous = _report.load(args.out) if args.only else None
    benchmarks: dict[str, Any] = dict(previous["benchmarks"]) if previous else {}
    started = time.monotonic()
    load_before = os.getloadavg()
    for name in chosen:
        print(f"benchmarks: running {name}{' (quick)' if args.quick else ''}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        result = registry[name](args.quick).as_json()
        result["quick"] = args.quick
        result["seconds"] = round(time.monotonic() - t0, 1)
        benchmarks[name] = result
        print(f"benchmarks: {name} done in {result['seconds']:.0f} s", file=sys.stderr, flush=True)
    ordered = {n: benchmarks[n] for n in names if n in benchmarks}
    doc = {
        "meta": {
            "command": "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "seconds": round(time.monotonic() - started, 1),
            "ran": chosen,
            # Other jobs on a shared machine inflate the spread; the ratios are what to read.
            "load_average_1min": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        },
        "benchmarks": ordered,
    }
    _report.write(args.out, doc)
    _plot.write(os.path.join(args.out, "results.png"), [p for r in ordered.values() for p in r["plots"]])
    print(f"benchmarks: wrote {args.out}/results.json, results.md, results.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
