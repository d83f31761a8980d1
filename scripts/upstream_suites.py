#!/usr/bin/env python3
"""Run other projects' own test suites plain and with safeio's drop-ins, file by file, and compare them
test by test against the differences the docs list: python-atomicwrites' (kept in tests/upstream, also
run by tests/test_upstream_suites.py) and, given a Lightning checkout, Lightning's checkpoint tests (a
release check: Lightning ships no tests in its distributions, and none are kept here).

    git clone --branch 2.6.5 https://github.com/Lightning-AI/pytorch-lightning /tmp/lightning
    .venv/bin/python scripts/upstream_suites.py --lightning /tmp/lightning       # both
    .venv/bin/python scripts/upstream_suites.py atomicwrites                      # one

Prints each file's wall time both ways and each problem (an undocumented difference, a documented one
that no longer happens, a test failing in the plain run); exits 1 when there is one.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import _upstream_suites as upstream  # noqa: E402

NAMES = ("atomicwrites", "lightning")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("suites", nargs="*", help=f"some of {', '.join(NAMES)} (default: all)")
    parser.add_argument("--lightning", type=Path, help="a Lightning checkout at the installed version's tag")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for one run of one file")
    args = parser.parse_args()
    suites = {"atomicwrites": upstream.ATOMICWRITES}
    if args.lightning is not None:
        suites["lightning"] = upstream.lightning(args.lightning)
    elif "lightning" in args.suites:
        parser.error("Lightning's tests need --lightning CHECKOUT (none are kept in this repository)")
    unknown = set(args.suites) - set(suites)
    if unknown:
        parser.error(f"unknown suites {sorted(unknown)}; known: {', '.join(NAMES)}")
    problems: list[str] = []
    print("| suite | file | tests | plain (s) | with the drop-ins (s) | differences |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.suites or list(suites):
        suite = suites[name]
        for file in suite.files:
            with tempfile.TemporaryDirectory(prefix=f"upstream-{name}-") as workdir:
                plain = upstream.run(suite, (file,), Path(workdir), dropins=False, timeout=args.timeout)
                dropins = upstream.run(suite, (file,), Path(workdir), dropins=True, timeout=args.timeout)
            found = upstream.differences(plain, dropins)
            problems += upstream.compare(suite, (file,), plain, dropins)
            print(
                f"| {name} | {file} | {len(plain.outcomes)} | {plain.seconds:.1f} | {dropins.seconds:.1f} "
                f"| {len(found)} |",
                flush=True,
            )
    for problem in problems:
        print(f"\nPROBLEM {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
