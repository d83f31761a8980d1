"""The benchmark suite runs and writes its three outputs (no speed is asserted: timings are noise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._bounds import PATIENT

ROOT = Path(__file__).resolve().parents[1]


def _quick(out: Path, name: str, timeout: float = PATIENT - 10) -> dict[str, Any]:
    """Run one benchmark in quick mode into ``out``; its result as results.json holds it."""
    subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", name, "--out", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    result: dict[str, Any] = json.loads((out / "results.json").read_text())["benchmarks"][name]
    return result


@pytest.mark.timeout(PATIENT)
def test_quick_promotion_benchmark_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "results"
    _quick(out, "promotion")
    doc = json.loads((out / "results.json").read_text())
    assert set(doc) == {"meta", "benchmarks"}
    assert {"command", "date", "machine", "seconds", "ran"} <= set(doc["meta"])
    result = doc["benchmarks"]["promotion"]
    assert {"title", "about", "rows", "tables", "plots", "samples", "params", "quick"} <= set(result)
    assert result["quick"] is True
    row = result["rows"][0]
    assert {"figure", "meaning", "target", "value", "unit", "met"} <= set(row)
    assert {"median", "lo", "hi", "n"} <= set(row["value"])
    assert "## 4. Promotion cost vs size" in (out / "results.md").read_text()
    assert (out / "results.png").stat().st_size > 0


@pytest.mark.timeout(PATIENT)
def test_quick_seed_benchmark_reports_rows(tmp_path: Path) -> None:
    """Figure 8 (4 ranks in quick mode) on the NFS-like mount: every row is there, every value finite."""
    import math

    from safeio.testing.pytest_plugin import require_fuse

    require_fuse()
    out = tmp_path / "results"
    result = _quick(out, "seed")
    assert result["quick"] is True
    figures = [row["figure"] for row in result["rows"]]
    assert any("safeio wall / unguarded wall" in f for f in figures), result["notes"]
    assert any("safeio: shared write ops" in f for f in figures)
    assert any("unguarded: hazards" in f for f in figures)
    assert any("safeio: failed saves" in f for f in figures)
    for row in result["rows"]:
        assert all(math.isfinite(row["value"][k]) for k in ("median", "lo", "hi")), row
    assert "## 8. The seed's job size" in (out / "results.md").read_text()


@pytest.mark.timeout(PATIENT)
def test_quick_peers_benchmark_reports_rows(tmp_path: Path) -> None:
    """Figure 7 in quick mode (4 gloo ranks, 64 simulated peers on one TCPStore): rows there, values finite."""
    import math

    out = tmp_path / "results"
    result = _quick(out, "peers")
    assert result["quick"] is True
    figures = [row["figure"] for row in result["rows"]]
    for setup in ("4 ranks", "64 simulated peers"):
        for what in (
            "last peer return, p50",
            "last peer return, p99",
            "store keys after a save minus before",
        ):
            assert any(f.startswith(f"7. {setup}: ") and f.endswith(what) for f in figures), figures
    for row in result["rows"]:
        assert all(math.isfinite(row["value"][k]) for k in ("median", "lo", "hi")), row
    assert len(result["samples"]["64 simulated peers"]["per_peer_p50_p99_max_ms"]) == 64
    assert "## 7. Peer release latency" in (out / "results.md").read_text()


@pytest.mark.timeout(PATIENT)
def test_quick_history_benchmark_reports_rows(tmp_path: Path) -> None:
    """Figure 10 in quick mode: the commit and latest() at few and many steps, and a save that retires a
    step against one that retires none: every row there, every value a finite positive ratio."""
    result = _quick(tmp_path / "results", "history")
    figures = [row["figure"] for row in result["rows"]]
    assert len(figures) == 3 and figures[0].startswith("10. commit with 300 committed steps"), figures
    for row in result["rows"]:
        value = row["value"]
        assert row["unit"] == "x" and value["n"] >= 3, row
        assert 0 < value["lo"] <= value["median"] <= value["hi"] < float("inf"), row


@pytest.mark.timeout(PATIENT)
def test_quick_wrapper_benchmark_reports_the_two_1mb_targets(tmp_path: Path) -> None:
    """Figure 1 in quick mode (ext4 only): the 1 MB tokenizer's two targets, each with a note saying met or
    missed and why (issue 26)."""
    out = tmp_path / "results"
    result = _quick(out, "wrapper")
    targets = {
        row["figure"]: row for row in result["rows"] if row["met"] is not None and "1 MB" in row["figure"]
    }
    assert sorted((row["target"], row["figure"].split(": ", 1)[1]) for row in targets.values()) == [
        ("≤ 1.1", "safeio durable=False / plain"),
        ("≤ 1.2", "safeio durable=True / (plain + user's fsyncs)"),
    ]
    reasons = [note for note in result["notes"] if note.startswith("fast 1 MB tokenizer, disk")]
    assert len(reasons) == 2, result["notes"]
    for note, row in zip(reasons, targets.values(), strict=True):
        assert f": {'met' if row['met'] else 'missed'}. safeio adds " in note, note
