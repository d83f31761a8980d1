"""results.png: one subplot per plot spec of every benchmark.

A spec is ``{"title", "kind": "bars"|"lines", "xlabel", "ylabel", "hline", "logx", "logy",
"series": {label: {"x": [...], "y": [...], "lo": [...], "hi": [...]}}}``; lo/hi draw the min-max spread.
"""

from __future__ import annotations

import math
from typing import Any


def _bars(ax: Any, spec: dict[str, Any]) -> None:
    series = spec["series"]
    labels: list[str] = []
    for s in series.values():
        for x in s["x"]:
            if str(x) not in labels:
                labels.append(str(x))
    width = 0.8 / max(len(series), 1)
    for i, (name, s) in enumerate(series.items()):
        xs = [labels.index(str(x)) + (i - (len(series) - 1) / 2) * width for x in s["x"]]
        err = [
            [y - lo for y, lo in zip(s["y"], s["lo"], strict=True)],
            [hi - y for y, hi in zip(s["y"], s["hi"], strict=True)],
        ]
        ax.bar(xs, s["y"], width, yerr=err, capsize=3, label=name)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=7)


def _lines(ax: Any, spec: dict[str, Any]) -> None:
    for name, s in spec["series"].items():
        err = [
            [y - lo for y, lo in zip(s["y"], s["lo"], strict=True)],
            [hi - y for y, hi in zip(s["y"], s["hi"], strict=True)],
        ]
        ax.errorbar(s["x"], s["y"], yerr=err, marker="o", capsize=3, label=name)


def write(path: str, specs: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on CI machines
    import matplotlib.pyplot as plt

    if not specs:
        return
    cols = min(3, len(specs))
    rows = math.ceil(len(specs) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.0 * rows), squeeze=False)
    for ax, spec in zip(axes.flat, specs, strict=False):
        (_bars if spec["kind"] == "bars" else _lines)(ax, spec)
        if spec.get("hline") is not None:
            ax.axhline(
                spec["hline"], color="red", linestyle="--", linewidth=1, label=f"target {spec['hline']}"
            )
        if spec.get("logx"):
            ax.set_xscale("log")
        if spec.get("logy"):
            ax.set_yscale("log")
        ax.set_title(spec["title"], fontsize=9)
        ax.set_xlabel(spec.get("xlabel", ""), fontsize=8)
        ax.set_ylabel(spec.get("ylabel", ""), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(specs) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
