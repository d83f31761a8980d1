"""Figure 4 — promotion cost vs size: safeio renames a stage created beside the target, so promoting
1 GB should cost what promoting 1 MB costs. The comparison is what a user gets by staging in a temp
directory on another filesystem and moving it into place (``shutil.move``: copy + delete).

Stages hold one sparse file of the given size (``truncate``): a rename does not care, a copy still
has to write every byte. Every file is deleted right after its measurement.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from benchmarks._core import Result, Row, Spread, fs_type, interleave, ratio_row, ratios, scratch

NAME = "promotion"
FLAT_LIMIT = 1.2
MIB = 1 << 20


def _label(size: int) -> str:
    return f"{size // 1024**3} GB" if size >= 1024**3 else f"{size // MIB} MB"


def _fill(directory: str, size: int) -> None:
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.truncate(size)


class _Case:
    """One (method, size): a fresh target per call; setup and cleanup untimed, page cache settled."""

    def __init__(self, root: str, name: str, size: int, promote: Callable[[str, str, int], float]) -> None:
        self.root, self.name, self.size, self.promote = root, name, size, promote
        self.count = 0

    def __call__(self) -> float:
        self.count += 1
        target = os.path.join(self.root, f"{self.name}-{self.count}")
        os.sync()  # a previous copy's dirty gigabyte must not throttle this measurement
        elapsed = self.promote(target, self.root, self.size)
        shutil.rmtree(target, ignore_errors=True)
        return elapsed


def _safeio(durable: bool) -> Callable[[str, str, int], float]:
    def promote(target: str, root: str, size: int) -> float:
        import safeio

        with safeio.replicated(target, durable=durable) as stage:
            _fill(stage.path, size)
            start = time.perf_counter()  # the body is done: from here on it is promotion
        return time.perf_counter() - start

    return promote


def _rename(target: str, root: str, size: int) -> float:
    stage = target + ".tmp"
    os.mkdir(stage)
    _fill(stage, size)
    start = time.perf_counter()
    os.rename(stage, target)
    return time.perf_counter() - start


def _cross_device(other: str) -> Callable[[str, str, int], float]:
    def promote(target: str, root: str, size: int) -> float:
        import tempfile

        stage = tempfile.mkdtemp(dir=other)  # "stage in /tmp, then move": here the tmp is another fs
        try:
            _fill(stage, size)
            start = time.perf_counter()
            shutil.move(stage, target)  # EXDEV: copytree + rmtree
            return time.perf_counter() - start
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    return promote


def run(quick: bool = False, disk: str = "/tmp", other: str = "/dev/shm") -> Result:
    sizes = [MIB, 16 * MIB] if quick else [MIB, 100 * MIB, 1024 * MIB]
    reps = 3 if quick else 11
    durable_reps = 2 if quick else 3
    same_device = os.stat(disk).st_dev == os.stat(other).st_dev
    result = Result(
        NAME,
        "4. Promotion cost vs size",
        f"A stage holding one sparse file is promoted to a fresh target on {disk} ({fs_type(disk)}). "
        "safeio: time from the end of the body to the end of `replicated` (permissions, manifest, lock, "
        "rename). Cross-device fallback: the stage is on "
        f"{other} ({fs_type(other)}) and `shutil.move` copies it. Methods and sizes interleaved.",
        params={
            "sizes": [_label(s) for s in sizes],
            "reps": reps,
            "durable_reps": durable_reps,
            "disk": disk,
            "disk_fs": fs_type(disk),
            "other": other,
            "other_fs": fs_type(other),
        },
    )
    if same_device:
        result.notes.append(
            f"{disk} and {other} are one filesystem here: the cross-device rows are a rename."
        )
    with scratch(disk) as root:
        cases: dict[str, Any] = {}
        for size in sizes:
            cases[f"safeio {_label(size)}"] = _Case(root, f"s{size}", size, _safeio(False))
            cases[f"rename {_label(size)}"] = _Case(root, f"r{size}", size, _rename)
            cases[f"cross-device move {_label(size)}"] = _Case(root, f"x{size}", size, _cross_device(other))
        samples = interleave(cases, reps, warmup=1)
        durable_cases = {
            f"safeio durable {_label(s)}": _Case(root, f"d{s}", s, _safeio(True))
            for s in (sizes[0], sizes[-1])
        }
        samples.update(interleave(durable_cases, durable_reps, warmup=1))
    result.samples = samples
    small, large = _label(sizes[0]), _label(sizes[-1])
    result.rows += [
        ratio_row(
            f"safeio promotion {large} / {small} (durable=False)",
            "promotion is a rename: flat in size",
            f"≤ {FLAT_LIMIT}",
            ratios(samples[f"safeio {large}"], samples[f"safeio {small}"]),
            FLAT_LIMIT,
        ),
        ratio_row(
            f"plain os.rename {large} / {small}",
            "the floor: a bare rename of the stage",
            "-",
            ratios(samples[f"rename {large}"], samples[f"rename {small}"]),
            None,
        ),
        ratio_row(
            f"safeio promotion {small} / plain os.rename {small}",
            "safeio's fixed promotion work (permissions, manifest, lock, stale-stage scan) over a bare rename",
            "-",
            ratios(samples[f"safeio {small}"], samples[f"rename {small}"]),
            None,
        ),
        ratio_row(
            f"cross-device move {large} / safeio promotion {large}",
            f"what staging on another filesystem ({fs_type(other)}) costs instead: a copy",
            "-",
            ratios(samples[f"cross-device move {large}"], samples[f"safeio {large}"]),
            None,
        ),
        ratio_row(
            f"safeio promotion {large} / {small} (durable=True)",
            "durable promotion also fsyncs and sha256-hashes every file for the manifest: O(size) by design",
            "- (not a rename-only figure)",
            ratios(samples[f"safeio durable {large}"], samples[f"safeio durable {small}"]),
            None,
        ),
    ]
    for size in sizes:
        for method in ("safeio", "rename", "cross-device move"):
            result.rows.append(
                Row(
                    f"{method} {_label(size)}",
                    "absolute promotion time",
                    "-",
                    Spread.of(samples[f"{method} {_label(size)}"]).scaled(1e3),
                    "ms",
                )
            )
    for s in (sizes[0], sizes[-1]):
        result.rows.append(
            Row(
                f"safeio durable {_label(s)}",
                "absolute promotion time, durable=True",
                "-",
                Spread.of(samples[f"safeio durable {_label(s)}"]).scaled(1e3),
                "ms",
            )
        )
    series: dict[str, Any] = {}
    for method in ("safeio", "rename", "cross-device move"):
        spreads = [Spread.of(samples[f"{method} {_label(s)}"]).scaled(1e3) for s in sizes]
        series[method] = {
            "x": [s / MIB for s in sizes],
            "y": [p.median for p in spreads],
            "lo": [p.lo for p in spreads],
            "hi": [p.hi for p in spreads],
        }
    result.plots.append(
        {
            "title": "4. promotion time vs size",
            "kind": "lines",
            "xlabel": "stage size (MB)",
            "ylabel": "ms",
            "logx": True,
            "logy": True,
            "series": series,
        }
    )
    return result
