#!/usr/bin/env python3
"""Run other projects' own test suites plain and with safeio's drop-ins, file by file, and compare them
test by test against the differences the docs list: python-atomicwrites' (kept in tests/upstream, also
run by tests/test_upstream_suites.py) and, as release checks from copies outside this repository
(docs/development.md says how to get them), Lightning's checkpoint tests, transformers' Trainer
checkpoint tests and accelerate's state tests (the last two plain and under SAFEIO_PATCH=1).

    git clone --branch 2.6.5 https://github.com/Lightning-AI/pytorch-lightning /tmp/lightning
    .venv/bin/python scripts/upstream_suites.py --lightning /tmp/lightning       # atomicwrites and Lightning
    .venv/bin/python scripts/upstream_suites.py atomicwrites                      # one
    .venv/bin/python scripts/upstream_suites.py --transformers-trainer /tmp/transformers transformers-trainer
    .venv/bin/python scripts/upstream_suites.py --accelerate /tmp/accelerate-1.16.0 accelerate

Prints each file's wall time both ways, every test whose outcome differs (with the reason the docs give,
or UNDOCUMENTED), and each problem (an undocumented difference, a documented one that no longer
happens, a test failing in the plain run); exits 1 when there is a problem.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import _upstream_suites as upstream  # noqa: E402

NAMES = ("atomicwrites", "lightning", "transformers-trainer", "accelerate")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("suites", nargs="*", help=f"some of {', '.join(NAMES)} (default: all given)")
    parser.add_argument("--lightning", type=Path, help="a Lightning checkout at the installed version's tag")
    parser.add_argument(
        "--transformers-trainer",
        type=Path,
        help="a transformers source tree at the installed version's tag (its tests/trainer/)",
    )
    parser.add_argument(
        "--accelerate",
        type=Path,
        help="accelerate's source distribution (or checkout) of the installed version",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds for one run of one file")
    args = parser.parse_args()
    suites = {"atomicwrites": upstream.ATOMICWRITES}
    given = {
        "lightning": (args.lightning, upstream.lightning),
        "transformers-trainer": (args.transformers_trainer, upstream.transformers_trainer),
        "accelerate": (args.accelerate, upstream.accelerate_state),
    }
    for name, (where, make) in given.items():
        if where is not None:
            suites[name] = make(where)
        elif name in args.suites:
            parser.error(f"{name}'s tests need --{name} DIR (none are kept in this repository)")
    unknown = set(args.suites) - set(suites)
    if unknown:
        parser.error(f"unknown suites {sorted(unknown)}; known: {', '.join(NAMES)}")
    problems: list[str] = []
    rows: list[str] = []
    columns = ["suite", "file", "tests", "passed plain", "passed with the drop-ins", "plain (s)"]
    columns += ["with the drop-ins (s)", "differences"]
    print("| " + " | ".join(columns) + " |\n|" + " --- |" * len(columns))
    for name in args.suites or list(suites):
        suite = suites[name]
        why = upstream.reasons(suite)
        for file in suite.files:
            with tempfile.TemporaryDirectory(prefix=f"upstream-{name}-") as workdir:
                plain = upstream.run(suite, (file,), Path(workdir), dropins=False, timeout=args.timeout)
                dropins = upstream.run(suite, (file,), Path(workdir), dropins=True, timeout=args.timeout)
            found = upstream.differences(plain, dropins)
            problems += upstream.compare(suite, (file,), plain, dropins)
            passed = [sum(o == "passed" for o in run.outcomes.values()) for run in (plain, dropins)]
            cells = [
                name,
                file,
                len(plain.outcomes),
                *passed,
                f"{plain.seconds:.1f}",
                f"{dropins.seconds:.1f}",
            ]
            print("| " + " | ".join(map(str, [*cells, len(found)])) + " |", flush=True)
            for nodeid, (before, after) in found.items():
                reason = why.get(nodeid, ("", "", "UNDOCUMENTED"))[2]
                rows.append(f"| `{nodeid}` | {before} | {after} | {reason} |")
    if rows:
        print("\n| test | plain | with safeio | why |\n| --- | --- | --- | --- |")
        print("\n".join(rows))
    for problem in problems:
        print(f"\nPROBLEM {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
