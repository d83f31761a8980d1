"""What every benchmark shares: interleaved timing, median/min-max summaries, report rows, scratch."""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# A method of one comparison: run once, return its own elapsed seconds (so it can leave setup out).
Method = Callable[[], float]


@dataclass(frozen=True)
class Spread:
    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            return cls(float("nan"), float("nan"), float("nan"), 0)
        return cls(statistics.median(values), min(values), max(values), len(values))

    def scaled(self, factor: float) -> Spread:
        return Spread(self.median * factor, self.lo * factor, self.hi * factor, self.n)


@dataclass
class Row:
    """One line of a results table: a figure, what it means, its target, the measurement, the verdict."""

    figure: str
    meaning: str
    target: str
    value: Spread
    unit: str  # "x" (a ratio), "ms", "ops", "MB", "%"
    met: bool | None = None  # None: informational, no target

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["value"] = asdict(self.value)
        return data


@dataclass
class Result:
    """What a benchmark hands to the report: rows, extra tables, plot series, raw samples."""

    name: str
    title: str
    about: str
    rows: list[Row] = field(default_factory=list)
    tables: list[dict[str, Any]] = field(default_factory=list)  # {"title", "header", "rows"}
    plots: list[dict[str, Any]] = field(default_factory=list)  # see benchmarks._plot
    samples: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "about": self.about,
            "rows": [r.as_json() for r in self.rows],
            "tables": self.tables,
            "plots": self.plots,
            "samples": self.samples,
            "params": self.params,
            "notes": self.notes,
        }


def timed(fn: Callable[[], object]) -> Method:
    def method() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return method


def interleave(methods: Mapping[str, Method], reps: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run every method once per repetition, rotating who goes first, so machine noise (another job,
    writeback, CPU frequency) hits all of them alike; the warm-up repetitions are dropped."""
    names = list(methods)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(warmup + reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            elapsed = methods[name]()
            if rep >= warmup:
                samples[name].append(elapsed)
    return samples


def ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Per-repetition ratios: both were measured in the same repetition, under the same noise."""
    return [a / b for a, b in zip(numerator, denominator, strict=True) if b > 0]


def ratio_row(figure: str, meaning: str, target: str, values: Sequence[float], limit: float | None) -> Row:
    spread = Spread.of(values)
    met = None if limit is None else spread.median <= limit
    return Row(figure, meaning, target, spread, "x", met)


@contextlib.contextmanager
def scratch(base: str, prefix: str = "safeio-bench-") -> Iterator[str]:
    """A directory under ``base``, removed afterwards whatever happens (benchmarks write GBs)."""
    path = tempfile.mkdtemp(prefix=prefix, dir=base)
    os.chmod(path, 0o755)  # ranks and the FUSE daemon must traverse it
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def fs_type(path: str) -> str:
    from safeio._storage.mounts import mount_of

    info = mount_of(os.path.realpath(path))
    return info.fs_type if info is not None else "unknown"


class FsyncClock:
    """Times every ``os.fsync`` made through the ``os`` module while installed.

    safeio (and the plain-save-plus-fsync baseline) call ``os.fsync`` by attribute, so patching the
    module attribute sees all of them; the share of a durable save spent in fsync is what durability
    costs, the rest is safeio's own work.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._original = os.fsync

    def __enter__(self) -> FsyncClock:
        original = self._original

        def fsync(fd: Any) -> None:
            start = time.perf_counter()
            try:
                original(fd)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        os.fsync = fsync
        return self

    def __exit__(self, *exc: object) -> None:
        os.fsync = self._original

    def take(self) -> tuple[float, int]:
        """The fsync time and count since the last take."""
        seconds, calls = self.seconds, self.calls
        self.seconds, self.calls = 0.0, 0
        return seconds, calls


def fsync_dir_files(directory: str) -> None:
    """What a careful user adds to a plain save for durability: fsync each file, then the directory."""
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if os.path.isfile(full):
            fd = os.open(full, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def wall_table(
    times: Mapping[int, Mapping[str, Sequence[float]]],
    worlds: Sequence[int],
    methods: Sequence[str],
    digits: int,
) -> dict[str, Any]:
    """The results table of wall seconds per checkpoint: one row per method, one column per world size."""

    def ranks(world: int) -> str:
        return f"{world} rank" if world == 1 else f"{world} ranks"

    rows = []
    for method in methods:
        cells = []
        for w in worlds:
            s = Spread.of(times[w][method]).scaled(1e3)
            cells.append(f"{s.median:.{digits}f} [{s.lo:.{digits}f}-{s.hi:.{digits}f}]")
        rows.append([method, *cells])
    header = ["method", *[f"{ranks(w)} (ms)" for w in worlds]]
    return {"title": "Wall time per checkpoint, median [min-max]", "header": header, "rows": rows}


def mounts_per_method(base: str, methods: Sequence[str], **options: Any) -> dict[str, Any]:
    """One NFS-like mount (not started) per method under ``base``, so that each method's operations and
    hazards are counted on a daemon of its own."""
    from safeio.testing import nfslike

    mounts = {}
    for i, method in enumerate(methods):
        backing, point = os.path.join(base, f"backing{i}"), os.path.join(base, f"mnt{i}")
        os.mkdir(backing)
        os.chmod(backing, 0o777)  # every rank and the daemon write there
        mounts[method] = nfslike.mount(backing, point, **options)
    return mounts
