#!/usr/bin/env python3
"""Rerun the reliability suite (tests/test_reliability_*.py) at a chosen scale and print the figures
as the Markdown of the tables of docs/reliability.md (the docs site's "Reliability" page).

    .venv/bin/python scripts/reliability_report.py --scale 5

Each test writes its counts as JSON into ``SAFEIO_RELIABILITY_OUT``; this script sets it (and
``SAFEIO_RELIABILITY_SCALE``, ``SAFEIO_RELIABILITY_SEED``, ``SAFEIO_REQUIRE_FUSE=1``), runs pytest, and
renders what the tests recorded. A failing test makes the script exit non-zero after printing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run(scale: float, seed: int, out: Path, extra: list[str]) -> int:
    env = {
        **os.environ,
        "SAFEIO_RELIABILITY_SCALE": str(scale),
        "SAFEIO_RELIABILITY_SEED": str(seed),
        "SAFEIO_RELIABILITY_OUT": str(out),
        "SAFEIO_REQUIRE_FUSE": os.environ.get("SAFEIO_REQUIRE_FUSE", "1"),
    }
    tests = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_reliability_*.py"))
    command = [sys.executable, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider"]
    command += ["--timeout", str(int(300 * max(1.0, scale))), "--durations=0", *extra]
    print("$", " ".join(command), file=sys.stderr)
    return subprocess.run(command, cwd=ROOT, env=env, check=False).returncode


def load(out: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render(figures: dict[str, dict[str, Any]]) -> str:
    parts: list[str] = []
    any_figure = next(iter(figures.values()), {})
    parts.append(
        f"Figures from `scripts/reliability_report.py --scale {any_figure.get('scale', '?')}` "
        f"(seed {any_figure.get('seed', '?')}); the default test run uses scale 1."
    )
    crash = [v for k, v in figures.items() if k.startswith("crash-") and k != "crash-unguarded"]
    if crash:
        rows = []
        for c in crash:
            o = c["outcomes"]
            rows.append(
                [
                    c["mode"],
                    c["kills"],
                    c["targeted_kills"],
                    o.get("old version", 0),
                    o.get("new version", 0),
                    o.get("name missing, old version aside", 0),
                    o.get("merge half done, files whole", 0),
                    c["lost"],
                ]
            )
        total = sum(c["kills"] for c in crash)
        parts.append(
            f"**Crash at every instant** — {total} SIGKILLs of a writer saving a tokenizer and a tiny model:"
        )
        parts.append(
            _table(
                [
                    "mode",
                    "kills",
                    "of which at each promotion syscall",
                    "left old version",
                    "left new version",
                    "name missing, old aside (restored)",
                    "merge half done, files whole (rolled forward)",
                    "versions lost / torn files",
                ],
                rows,
            )
        )
        if "crash-unguarded" in figures:
            u = figures["crash-unguarded"]
            parts.append(
                f"Unguarded `save_pretrained` killed the same way ({u['kills']} kills): {u['outcomes']}."
            )
    for fs in ("local", "nfslike"):
        key = f"readers-{fs}"
        if key not in figures:
            continue
        r = figures[key]
        rows = [
            [m["mode"], m.get("saves", 0), m["loads"], m["failed"], m["estale"], m["mixed"]]
            for m in r["modes"].values()
        ]
        parts.append(
            f"**Readers during writes, {fs}** — 2 reader processes, {r['seconds_per_mode']:g} s per mode "
            "(ESTALE: the libfuse rename artefact, counted apart from failures):"
        )
        parts.append(_table(["mode", "saves", "loads", "failed", "ESTALE", "mixed versions"], rows))
    faults = []
    if "enospc" in figures:
        e = figures["enospc"]
        faults.append(
            [
                "ENOSPC at evenly spaced points of a tokenizer+model save (NFS-like budget)",
                e["faults"],
                f"old version kept and loadable {e['old_version_kept']}/{e['faults']}; "
                f"unguarded lost it {e['unguarded_lost']}/{e['unguarded_tries']}",
            ]
        )
    if "propagation" in figures:
        p = figures["propagation"]
        slowest = ", ".join(f"{k} {v:g} s" for k, v in p["slowest_peer_seconds"].items())
        faults.append([f"writer failures on {p['ranks']} gloo ranks", p["cases"], f"slowest peer: {slowest}"])
    for key in ("rivals-local", "rivals-nfslike"):
        if key in figures:
            v = figures[key]
            faults.append(
                [
                    f"rival jobs ({v['jobs']} x {v['ranks_per_job']} ranks), {v['filesystem']}",
                    v["saves"],
                    f"failed {v['failed']}, LockTimeout {v['lock_timeouts']}, ends as one complete version; "
                    f"peers timed out, save superseded by the rival: {v['peer_timeouts_superseded']}",
                ]
            )
    if "rivals-unlocked" in figures:
        v = figures["rivals-unlocked"]
        faults.append(
            [
                "same rivals, lock=False, rename-aside, NFS-like mount with 5 ms per operation (baseline)",
                v["saves"],
                f"failed {v['failed']}",
            ]
        )
    if "stale-lease" in figures:
        v = figures["stale-lease"]
        faults.append(
            [
                "lease holder SIGKILLed (NFS-like)",
                1,
                f"next writer got the lock after {v['recovered_after_seconds']} s",
            ]
        )
    if "s3" in figures:
        v = figures["s3"]
        faults.append(
            [
                "S3 (moto) writer SIGKILLed mid-upload",
                v["kills_mid_upload"],
                f"{v['keys_when_killed']} keys, no marker: verify reports it; next save repaired it",
            ]
        )
    if "names" in figures:
        v = figures["names"]
        faults.append(
            [
                "hostile names (hypothesis)",
                v["saved"] + v["refused"],
                f"saved {v['saved']}, refused {v['refused']} (>255 bytes)",
            ]
        )
    if "shapes" in figures:
        v = figures["shapes"]
        faults.append(
            [f"odd targets on {v['ranks']} ranks", v["cases"], "each saved or a SafeIOError on every rank"]
        )
    if faults:
        parts.append("**Faults injected:**")
        parts.append(_table(["fault", "count", "result"], faults))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scale", type=float, default=5.0, help="multiplier of iterations and durations")
    parser.add_argument("--seed", type=int, default=20261202)
    parser.add_argument("--out", type=Path, default=None, help="keep the JSON figures here")
    parser.add_argument("--render-only", action="store_true", help="render --out without running the tests")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="safeio-reliability-"))
    code = 0 if args.render_only else run(args.scale, args.seed, out, args.pytest_args)
    print(render(load(out)))
    return code


if __name__ == "__main__":
    sys.exit(main())
