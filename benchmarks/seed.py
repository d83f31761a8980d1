"""Figure 8 — the seed's job size: 32 gloo ranks each save a ~1 MB fast tokenizer into one shared
directory per checkpoint on the NFS-like FUSE mount with its inode interlock on, unguarded (every rank
calls ``tokenizer.save_pretrained(dir)``, the pattern of the 35-hour hang) vs ``safeio.save_pretrained``.

What ``safeio demo --ranks 32`` shows once, as a repeatable figure: the methods are interleaved per
checkpoint (barriers between them), each on its own mount so that the per-process operation counters
and the hazard log are exact per method; a 1-rank pass on the same mounts gives the writes one rank
makes. An unguarded save that fails (a truncation deadlocked behind another rank's open file, I/O
behind it) is caught and counted on its rank, and the benchmark goes on.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
from collections import Counter
from typing import Any

from benchmarks._core import Result, Row, Spread, mounts_per_method, ratio_row, ratios, scratch, wall_table
from benchmarks._ranks import time_on_ranks, walls
from benchmarks.scaling import WRITE_OPS, _count

NAME = "seed"
WORLD = 32
QUICK_WORLD = 4
METHODS = ("unguarded", "safeio", "safeio durable=False")
SAVE_TIMEOUT = 60.0  # safeio's own bound on waiting for the writer's outcome
_MAX_ERRORS = 3
_CHECKPOINT = re.compile(r"checkpoint-(\d+)/")


def _rank(rank: int, world: int, reps: int, roots: dict[str, str]) -> dict[str, Any]:
    import safeio
    from safeio.cli._demo_work import build_tokenizer

    tok = build_tokenizer()  # safeio.testing.hf_objects.fast_tokenizer(words=40_000): ~1 MB tokenizer.json
    import transformers.modeling_utils  # noqa: F401  # safeio's first save would import it: time saves only

    failures: dict[str, list[int]] = {m: [] for m in METHODS}  # per call (warm-up included): 0 or 1
    errors: dict[str, list[str]] = {m: [] for m in METHODS}

    def target(method: str, rep: int) -> str:
        return os.path.join(roots[method], f"checkpoint-{rep}", "tokenizer")

    def counted(method: str, save: Any) -> Any:
        def call(rep: int) -> None:
            try:
                save(target(method, rep))
            except Exception as exc:  # a failed save must not stop the benchmark: counted, reported
                failures[method].append(1)
                text = f"{type(exc).__name__}: {str(exc)[:160]}"
                if len(errors[method]) < _MAX_ERRORS and text not in errors[method]:
                    errors[method].append(text)
            else:
                failures[method].append(0)

        return call

    methods = {
        "unguarded": counted("unguarded", tok.save_pretrained),
        "safeio": counted("safeio", lambda d: safeio.save_pretrained(tok, d, timeout=SAVE_TIMEOUT)),
        "safeio durable=False": counted(
            "safeio durable=False",
            lambda d: safeio.save_pretrained(tok, d, durable=False, timeout=SAVE_TIMEOUT),
        ),
    }
    spans = time_on_ranks(methods, reps, warmup=1)
    return {"pid": os.getpid(), "spans": spans, "failures": failures, "errors": errors}


def _ranks(world: int) -> str:
    return f"{world} rank" if world == 1 else f"{world} ranks"


def run(quick: bool = False, disk: str = "/tmp") -> Result:
    from safeio.cli.demo import DEFAULT_HAZARD_TIMEOUT
    from safeio.testing import nfslike

    top = QUICK_WORLD if quick else WORLD
    worlds = [1, top]
    reps = 2 if quick else 16
    result = Result(
        NAME,
        f"8. The seed's job size: {top} ranks save a 1 MB tokenizer into one directory, NFS-like mount",
        f"{top} gloo ranks (loopback, 2 cores) each save the same fast tokenizer (tokenizer.json about 1 MB) "
        "into one fresh checkpoint-N/tokenizer per checkpoint on the NFS-like FUSE mount with its inode "
        f"interlock on (as `safeio demo`: a truncation of a file another process holds open waits "
        f"{DEFAULT_HAZARD_TIMEOUT:g} s, then fails and is logged as a hazard; a real NFS client waits "
        "forever). Unguarded: every rank calls tokenizer.save_pretrained(dir); safeio: every rank calls "
        "safeio.save_pretrained(tokenizer, dir) (durable, the default), and durable=False. Methods "
        "interleaved per checkpoint, each on its own mount. Wall time per checkpoint: first rank entering "
        "to last returning. Failed saves: exceptions caught on the ranks. Shared write operations: the "
        "mount's per-process counters summed over ranks, per checkpoint (write-class as in figure 3); "
        "a 1-rank pass on the same mounts gives one rank's.",
        params={
            "worlds": worlds,
            "reps": reps,
            "hazard_timeout_s": DEFAULT_HAZARD_TIMEOUT,
            "mount": f"nfslike passthrough, hazard_timeout={DEFAULT_HAZARD_TIMEOUT:g}",
        },
    )
    reason = nfslike.fuse_unavailable_reason()
    if reason is not None:
        result.notes.append(f"skipped: FUSE unavailable ({reason})")
        return result
    times: dict[int, dict[str, list[float]]] = {}
    ops: dict[str, dict[int, dict[str, list[float]]]] = {m: {} for m in METHODS}
    hazards: dict[int, dict[str, list[dict[str, Any]]]] = {}
    failed: dict[int, dict[str, list[int]]] = {}
    errors: dict[str, list[str]] = {m: [] for m in METHODS}
    damaged: dict[int, dict[str, list[int]]] = {}
    reference: dict[str, bytes] = {}
    with scratch(disk) as base:
        mounts = mounts_per_method(base, METHODS, hazard_timeout=DEFAULT_HAZARD_TIMEOUT)
        try:
            for m in mounts.values():
                m.start()
            for world in worlds:
                measured = _pass(mounts, world, reps, reference)
                if isinstance(measured, str):
                    result.notes.append(f"the {_ranks(world)} pass failed, no figures:\n{measured}")
                    return result
                times[world], failed[world], hazards[world], damaged[world] = (
                    measured["times"],
                    measured["failed"],
                    measured["hazards"],
                    measured["damaged"],
                )
                for method in METHODS:
                    ops[method][world] = measured["ops"][method]
                    errors[method] += [e for e in measured["errors"][method] if e not in errors[method]]
                result.params["tokenizer_bytes"] = {name: len(data) for name, data in reference.items()}
        finally:
            for m in mounts.values():
                m.stop()
    per_checkpoint = {w: {m: _per_checkpoint(hazards[w][m], reps + 1) for m in METHODS} for w in worlds}
    result.samples = {
        "wall_s": times,
        "ops_per_rank_per_checkpoint": ops,
        "failed_saves_per_checkpoint": failed,
        "damaged_checkpoints": damaged,
        "hazards_per_checkpoint": per_checkpoint,
        "hazard_kinds": {
            w: {m: dict(Counter(str(h.get("kind")) for h in hazards[w][m])) for m in METHODS} for w in worlds
        },
        "errors": errors,
    }
    figures = _Figures(worlds, reps, times, ops, per_checkpoint, failed, damaged, errors)
    _rows(result, figures)
    _tables(result, figures)
    return result


def _pass(mounts: dict[str, Any], world: int, reps: int, reference: dict[str, bytes]) -> dict[str, Any] | str:
    """One run of ``world`` ranks over every mount: what it measured, or why it failed. The first
    (1-rank) pass fills ``reference`` with what one rank's plain save writes, byte for byte."""
    from safeio.testing.ranks import describe, run_ranks

    calls = reps + 1  # the warm-up checkpoint touches the mount too
    roots = {method: str(m.path) for method, m in mounts.items()}
    for root in roots.values():  # the parent prepares the tree; its pid is not a rank's
        for rep in range(calls):
            os.makedirs(os.path.join(root, f"checkpoint-{rep}"), exist_ok=True)
    logged = {method: len(m.hazards()) for method, m in mounts.items()}
    for m in mounts.values():
        m.reset_ops()
    env = {"TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
    outcome = run_ranks(_rank, world, reps, roots, timeout=240 + 30 * calls, env=env, check=False)
    if not all(r.ok for r in outcome):
        return describe(outcome)[:4000]
    values = [r.value for r in outcome]
    pids = [v["pid"] for v in values]
    measured: dict[str, Any] = {
        "times": {m: walls([v["spans"] for v in values], m) for m in METHODS},
        "failed": {m: [sum(v["failures"][m][i] for v in values) for i in range(1, calls)] for m in METHODS},
        "hazards": {method: m.hazards()[logged[method] :] for method, m in mounts.items()},
        "ops": {},
        "errors": {m: [e for v in values for e in v["errors"][m]] for m in METHODS},
    }
    if not reference:  # one rank alone, saving plainly: the whole checkpoint
        reference.update(_files(os.path.join(mounts["unguarded"].backing, "checkpoint-0", "tokenizer")))
    measured["damaged"] = {
        method: [
            int(_files(os.path.join(m.backing, f"checkpoint-{i}", "tokenizer"), reference) != reference)
            for i in range(1, calls)
            if reference  # else one rank alone could not save: nothing to compare with
        ]
        for method, m in mounts.items()
    }
    for method, m in mounts.items():
        counts = m.ops()
        measured["ops"][method] = {
            "write": [_count(counts.of(p), WRITE_OPS) / calls for p in pids],
            "all": [_count(counts.of(p), None) / calls for p in pids],
        }
    for root in roots.values():
        for entry in os.listdir(root):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    return measured


def _files(directory: str, like: dict[str, bytes] | None = None) -> dict[str, bytes]:
    """The saved files' contents (read beside the mount: no hazards, no counts); only ``like``'s names."""
    names = list(like) if like is not None else [n for n in os.listdir(directory) if not n.startswith(".")]
    found = {}
    for name in names:
        try:
            with open(os.path.join(directory, name), "rb") as f:
                found[name] = f.read()
        except OSError:
            pass
    return found


def _per_checkpoint(records: list[dict[str, Any]], calls: int) -> list[int]:
    """Hazards per measured checkpoint (the warm-up, checkpoint-0, left out), by the path they name."""
    counts = [0] * calls
    for record in records:
        found = _CHECKPOINT.search(str(record.get("path", "")))
        if found is not None and int(found.group(1)) < calls:
            counts[int(found.group(1))] += 1
    return counts[1:]


@dataclasses.dataclass(frozen=True)
class _Figures:
    """What the passes measured, keyed by world size (two: one rank, the top) and method."""

    worlds: list[int]
    reps: int
    times: dict[int, dict[str, list[float]]]
    ops: dict[str, dict[int, dict[str, list[float]]]]
    hazards: dict[int, dict[str, list[int]]]  # per checkpoint
    failed: dict[int, dict[str, list[int]]]
    damaged: dict[int, dict[str, list[int]]]
    errors: dict[str, list[str]]


def _rows(result: Result, figures: _Figures) -> None:
    worlds, reps, times, ops = figures.worlds, figures.reps, figures.times, figures.ops
    hazards, failed, damaged = figures.hazards, figures.failed, figures.damaged
    one, top = worlds
    for method, what in (
        ("safeio", "safeio (durable, the default) against every rank writing"),
        ("safeio durable=False", "the same at the unguarded pattern's durability (it fsyncs nothing)"),
    ):
        result.rows.append(
            ratio_row(
                f"{_ranks(top)}: {method} wall / unguarded wall",
                f"time per checkpoint, {what}",
                "≤ 1.0 (below)",
                ratios(times[top][method], times[top]["unguarded"]),
                1.0,
            )
        )
    for method in METHODS:
        at_one, at_top = sum(ops[method][one]["write"]), sum(ops[method][top]["write"])
        ratio = at_top / at_one if at_one else float("nan")
        guarded = method != "unguarded"
        result.rows.append(
            Row(
                f"{method}: shared write ops per checkpoint, {_ranks(top)} / {_ranks(one)}",
                f"summed over ranks: {at_one:.1f} at {_ranks(one)}, {at_top:.1f} at {top}",
                "= 1.0 (equal to one rank's)" if guarded else f"- (every rank writes: ≈ {top // one})",
                Spread(ratio, ratio, ratio, 1),
                "x",
                math.isclose(at_top, at_one, rel_tol=1e-9) if guarded else None,
            )
        )
    result.rows.append(
        Row(
            f"unguarded: hazards per checkpoint, {_ranks(top)}",
            "truncations blocked behind another rank's open file, and I/O blocked behind them",
            "-",
            Spread.of(hazards[top]["unguarded"]),
            "hazards",
        )
    )
    result.rows.append(
        Row(
            f"unguarded: failed saves per checkpoint, of {top}",
            "ranks whose tokenizer.save_pretrained raised",
            "-",
            Spread.of(failed[top]["unguarded"]),
            "saves",
        )
    )
    bad = damaged[top]["unguarded"]
    total = float(sum(bad)) if bad else float("nan")
    result.rows.append(
        Row(
            f"unguarded: checkpoints not whole after the save, {_ranks(top)}",
            "files missing or not byte-identical to one rank's save, read after every rank returned",
            "-",
            Spread(total, total, total, len(bad)),
            f"of {len(bad)}",
        )
    )
    for method in METHODS[1:]:
        for label, series, unit in (
            ("hazards", hazards, "hazards"),
            ("failed saves", failed, "saves"),
            ("checkpoints not whole", damaged, "checkpoints"),
        ):
            values = [n for w in worlds for n in series[w][method]]
            total = float(sum(values)) if values else float("nan")
            result.rows.append(
                Row(
                    f"{method}: {label}, all checkpoints",
                    f"{reps} checkpoints at {_ranks(top)} and {reps} at {_ranks(one)}; expected none: "
                    "any is a safeio bug",
                    "0",
                    Spread(total, total, total, len(values)),
                    unit,
                    total == 0,
                )
            )


def _tables(result: Result, figures: _Figures) -> None:
    worlds, times, ops = figures.worlds, figures.times, figures.ops
    hazards, failed, errors = figures.hazards, figures.failed, figures.errors
    one, top = worlds
    result.tables.append(wall_table(times, worlds, METHODS, digits=0))
    header = [
        "method",
        f"write ops, {_ranks(one)}",
        f"write ops, {_ranks(top)}: total",
        "busiest rank",
        "other ranks (max)",
        f"all ops, {_ranks(one)} / {_ranks(top)}",
        f"hazards, {_ranks(top)}",
        f"failed saves, {_ranks(top)}",
    ]
    rows = []
    for method in METHODS:
        writes = sorted(ops[method][top]["write"], reverse=True)
        h, f = Spread.of([float(n) for n in hazards[top][method]]), Spread.of(failed[top][method])
        rows.append(
            [
                method,
                f"{sum(ops[method][one]['write']):.1f}",
                f"{sum(writes):.1f}",
                f"{writes[0]:.1f}",
                f"{writes[1]:.1f}" if len(writes) > 1 else "-",
                f"{sum(ops[method][one]['all']):.1f} / {sum(ops[method][top]['all']):.1f}",
                f"{h.median:.0f} [{h.lo:.0f}-{h.hi:.0f}]",
                f"{f.median:.0f} [{f.lo:.0f}-{f.hi:.0f}] of {top}",
            ]
        )
    result.tables.append(
        {
            "title": "Per checkpoint: shared-filesystem operations (mean), hazards and failed saves "
            "(median [min-max])",
            "header": header,
            "rows": rows,
        }
    )
    guarded = ops["safeio"][top]
    peers = [every for every, writes in zip(guarded["all"], guarded["write"], strict=True) if not writes]
    if peers:
        result.notes.append(
            f"safeio: the {len(peers)} of {top} ranks that wrote nothing make {min(peers):.1f}-"
            f"{max(peers):.1f} counted shared operations each per checkpoint (see figure 3): the outcome "
            "arrives through the store, and one stat of the manifest it names (the mount counts opens, reads "
            "and writes, not stats) confirms that the new version is visible from the rank's own client."
        )
    result.notes.append(
        "The unguarded wall time is bounded by the mount's interlock timeout: each blocked truncation fails "
        f"after {result.params['hazard_timeout_s']:g} s, where a real NFS client blocks until the other "
        "writers close (the 35-hour hang), so the ratios above favour the unguarded pattern. A rank whose "
        "unguarded save failed stops writing at the failure, which keeps the unguarded write count below "
        "ranks x one rank's."
    )
    for method in METHODS:
        if errors[method]:
            result.notes.append(f"{method} save errors, for example: " + "; ".join(errors[method][:2]))
    spreads = {m: Spread.of(times[top][m]).scaled(1e3) for m in METHODS}
    result.plots.append(
        {
            "title": f"8a. wall time per checkpoint, {_ranks(top)}, NFS-like mount",
            "kind": "bars",
            "ylabel": "ms",
            "series": {
                "median [min-max]": {
                    "x": list(METHODS),
                    "y": [spreads[m].median for m in METHODS],
                    "lo": [spreads[m].lo for m in METHODS],
                    "hi": [spreads[m].hi for m in METHODS],
                }
            },
        }
    )
    result.plots.append(
        {
            "title": "8b. shared write ops per checkpoint (all ranks)",
            "kind": "bars",
            "ylabel": "operations",
            "series": {
                m: {
                    "x": [_ranks(w) for w in worlds],
                    "y": [sum(ops[m][w]["write"]) for w in worlds],
                    "lo": [sum(ops[m][w]["write"]) for w in worlds],
                    "hi": [sum(ops[m][w]["write"]) for w in worlds],
                }
                for m in METHODS
            },
        }
    )
