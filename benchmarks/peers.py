"""Figure 7 — peer release latency: how long after the writer returns from a save its peers return.

Every save is ``safeio.save_pretrained(tok, <root>/checkpoint-N/tokenizer)`` of the small fast tokenizer
(``safeio.testing.hf_objects.fast_tokenizer()``), on local disk, with the defaults (durable, merge), into
a fresh ``checkpoint-N`` per save as a trainer does. The writer (rank 0) saves and publishes the outcome
through the store; every peer skips the body, waits for that outcome through safeio's Channel, then looks
at the target on the filesystem until the new version is visible from it. Each save starts right after a
barrier; every process stamps its return with CLOCK_MONOTONIC (one clock for every process of a machine),
and a save's release latency is the last peer's return minus the writer's. Two set-ups:

* real ranks: N gloo ranks over loopback (``torch.distributed``, TCP rendezvous, rank 0 hosting the
  TCPStore, as under torchrun), each a process;
* simulated peers: one real TCPStore (libuv, 127.0.0.1, hosted by the benchmark's parent) shared by a
  writer process and a few worker processes whose threads are the peers, each thread with its own
  TCPStore client and its own ``safeio.Group(rank, world, store=client)``, running the real peer path.
  A peer thread behaves as a rank of its own: safeio numbers the saves of one call site per *process*
  (``Channel.open``), so each worker process counts them per thread here. The store's keys are listed
  (``TCPStore.list_keys``) after every save, once every peer has returned.

On this 2-core machine every peer's code runs on the same two cores (and, for simulated peers, under
one GIL per worker process): with 1,024 peers the latency is mostly CPU time — each peer's wake-up,
acknowledgement and look at the target — not the store's.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import multiprocessing as mp
import os
import queue
import re
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from benchmarks._core import Result, Row, Spread, scratch

NAME = "peers"
WARMUP = 1
SAVE_TIMEOUT = 120.0  # safeio's bound on each peer's wait
BARRIER_TIMEOUT = 300.0  # every harness wait is bounded by this
# Targets, in ms: the release latency measured once (p50 ~2 ms, max 8 at 8 ranks; ~13 ms, max 20 at 32),
# kept so with a margin for a shared machine; 1 s for 1,024 peers on two cores.
TARGETS = {8: (5.0, 20.0), 32: (20.0, 50.0)}
SIMULATED_P99_MS = 1000.0
PER_PEER_SAMPLES = 64  # results.json lists each peer's figures up to this many peers


def _save(tok: Any, target: str, group: Any) -> Any:
    # One line for the writer and every peer: a save is known across ranks by its object's type and call site.
    import safeio

    return safeio.save_pretrained(tok, target, group=group, timeout=SAVE_TIMEOUT)


def _target(root: str, rep: int) -> str:
    return os.path.join(root, f"checkpoint-{rep}", "tokenizer")


# -- real ranks ------------------------------------------------------------------------------------


def _store_keys(store: Any) -> tuple[int, list[str] | None]:
    count = int(store.num_keys())
    keys = None
    with contextlib.suppress(Exception):
        keys = sorted(store.list_keys())
    return count, keys


def _rank(rank: int, world: int, reps: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from safeio.testing.hf_objects import fast_tokenizer

    tok = fast_tokenizer()
    store = c10d._get_default_store()
    spans: list[list[float]] = []
    keys: list[tuple[int, list[str] | None]] = []
    for rep in range(WARMUP + reps):
        dist.barrier()  # every rank has returned from the previous save
        if rank == 0:
            keys.append(_store_keys(store))
        cpu, start = time.thread_time(), time.monotonic()
        _save(tok, _target(root, rep), None)
        spans.append([start, time.monotonic(), time.thread_time() - cpu])
    dist.barrier()
    if rank == 0:
        keys.append(_store_keys(store))
    return {"spans": spans[WARMUP:], "keys": keys[WARMUP:]}


def _real(world: int, reps: int, disk: str) -> dict[str, Any]:
    from safeio.testing.ranks import run_ranks

    with scratch(disk) as root:
        values = [r.value for r in run_ranks(_rank, world, reps, root, timeout=BARRIER_TIMEOUT)]
    return {
        "writer": [s[1] for s in values[0]["spans"]],
        "starts": {r: [s[0] for s in v["spans"]] for r, v in enumerate(values)},
        "peers": {r: [s[1] for s in v["spans"]] for r, v in enumerate(values) if r != 0},
        "cpu": {r: [s[2] for s in v["spans"]] for r, v in enumerate(values) if r != 0},
        "keys": values[0]["keys"],
    }


# -- simulated peers -------------------------------------------------------------------------------


class _PerThreadCounters:
    """Stands in for ``safeio._coordination.calls._counters`` in a worker process: each peer thread
    numbers its saves as a process of its own would (the module's dict is per process)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _counts(self) -> dict[Any, int]:
        counts = getattr(self._local, "counts", None)
        if counts is None:
            counts = self._local.counts = {}
        return counts

    def get(self, key: Any, default: Any = None) -> Any:
        return self._counts().get(key, default)

    def __setitem__(self, key: Any, value: int) -> None:
        self._counts()[key] = value


def _instrument_visibility() -> threading.local:
    """Count and time each peer's looks at the target (on entry, and after the outcome until the new
    version is visible): per thread, ``probe.reads`` = [looks, wall s, CPU s]."""
    from safeio._saves.visibility import DirectoryVisibility

    probe = threading.local()

    def timed(method: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return method(self, *args, **kwargs)
            finally:
                reads = getattr(probe, "reads", None)
                if reads is not None:
                    reads[0] += 1
                    reads[1] += time.perf_counter() - wall
                    reads[2] += time.thread_time() - cpu

        return wrapper

    # Whichever of these the engine has: a full read (manifest and files) or a check of one version.
    for name in ("note_entry", "landed", "shows_version"):
        if hasattr(DirectoryVisibility, name):
            setattr(DirectoryVisibility, name, timed(getattr(DirectoryVisibility, name)))
    return probe


def _client(port: int) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=BARRIER_TIMEOUT))


def _barrier(control: Any, number: int, parties: int) -> None:
    """A bounded barrier of ``parties`` processes through the control store (not the measured one)."""
    key = f"barrier/{number}"
    if int(control.add(key, 1)) == parties:
        control.set(key + "/go", b"1")
    control.wait([key + "/go"], timedelta(seconds=BARRIER_TIMEOUT))


def _writer_main(
    world: int, port: int, control_port: int, parties: int, root: str, reps: int, out: Any
) -> None:
    try:
        import safeio
        from safeio.testing.hf_objects import fast_tokenizer

        tok = fast_tokenizer()
        store, control = _client(port), _client(control_port)
        group = safeio.Group(0, world, store=store)
        spans: list[list[float]] = []
        keys: list[tuple[int, list[str] | None]] = []
        for rep in range(WARMUP + reps):
            _barrier(control, rep + 1, parties)
            keys.append(_store_keys(store))
            start = time.monotonic()
            _save(tok, _target(root, rep), group)
            spans.append([start, time.monotonic()])
        _barrier(control, WARMUP + reps + 1, parties)
        keys.append(_store_keys(store))
        out.put(("writer", 0, {"spans": spans[WARMUP:], "keys": keys[WARMUP:]}, None))
    except BaseException as exc:
        out.put(("writer", 0, None, f"{type(exc).__name__}: {exc}"))


def _peers_main(
    index: int,
    ranks: list[int],
    world: int,
    port: int,
    control_port: int,
    parties: int,
    root: str,
    reps: int,
    out: Any,
) -> None:
    errors: list[str] = []
    spans: dict[int, list[list[float]]] = {r: [] for r in ranks}
    try:
        import safeio
        from safeio._coordination import calls
        from safeio.testing.hf_objects import fast_tokenizer

        calls._counters = _PerThreadCounters()  # type: ignore[assignment]
        probe = _instrument_visibility()
        tok = fast_tokenizer()
        control = _client(control_port)
        number = [0]

        def cross_process() -> None:  # run by one thread once all of this process's peers have arrived
            number[0] += 1
            _barrier(control, number[0], parties)

        arrive = threading.Barrier(len(ranks), action=cross_process, timeout=BARRIER_TIMEOUT)

        def peer(rank: int) -> None:
            try:
                group = safeio.Group(rank, world, store=_client(port))
                for rep in range(WARMUP + reps):
                    arrive.wait()
                    probe.reads = [0, 0.0, 0.0]
                    cpu, start = time.thread_time(), time.monotonic()
                    _save(tok, _target(root, rep), group)
                    end = time.monotonic()
                    spans[rank].append([start, end, time.thread_time() - cpu, *probe.reads])
                arrive.wait()
            except threading.BrokenBarrierError:
                pass  # another peer's failure, reported by that peer
            except BaseException as exc:
                errors.append(f"rank {rank}: {type(exc).__name__}: {exc}")
                arrive.abort()

        threads = [threading.Thread(target=peer, args=(r,), name=f"peer-{r}", daemon=True) for r in ranks]
        for t in threads:
            t.start()
        deadline = time.monotonic() + BARRIER_TIMEOUT * 2
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0.0))
        if any(t.is_alive() for t in threads):
            errors.append(f"worker {index}: peers still running after {BARRIER_TIMEOUT * 2:.0f} s")
    except BaseException as exc:
        errors.append(f"worker {index}: {type(exc).__name__}: {exc}")
    value = {r: s[WARMUP:] for r, s in spans.items()}
    out.put(("peers", index, value, "; ".join(errors[:5]) or None))


def _simulated(peers: int, workers: int, reps: int, disk: str) -> dict[str, Any]:
    import torch.distributed as dist

    from safeio.testing.ranks import PRELOAD

    ctx: Any = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    timeout = timedelta(seconds=BARRIER_TIMEOUT)
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timeout, wait_for_workers=False, use_libuv=True
    )
    control = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout, wait_for_workers=False)
    world, parties = peers + 1, workers + 1
    share = [list(range(1 + i, world, workers)) for i in range(workers)]  # ranks dealt round-robin
    results = ctx.Queue()
    with scratch(disk) as root:
        procs = [
            ctx.Process(
                target=_writer_main,
                args=(world, server.port, control.port, parties, root, reps, results),
                name="peers-writer",
            )
        ]
        procs += [
            ctx.Process(
                target=_peers_main,
                args=(i, share[i], world, server.port, control.port, parties, root, reps, results),
                name=f"peers-worker-{i}",
            )
            for i in range(workers)
        ]
        for p in procs:
            p.start()
        collected: dict[tuple[str, int], Any] = {}
        failures: list[str] = []
        deadline = time.monotonic() + BARRIER_TIMEOUT * 3
        try:
            while len(collected) < len(procs) and time.monotonic() < deadline:
                try:
                    kind, index, value, error = results.get(timeout=1.0)
                except queue.Empty:
                    if all(not p.is_alive() for p in procs) and results.empty():
                        break
                    continue
                collected[kind, index] = value
                if error:
                    failures.append(error)
        finally:
            for p in procs:
                p.join(max(0.0, min(10.0, deadline - time.monotonic())))
                if p.is_alive():
                    p.kill()
                    p.join(5)
            results.close()
    missing = len(procs) - len(collected)
    if failures or missing:
        raise RuntimeError(
            f"simulated peers failed ({missing} processes never reported): {'; '.join(failures)}"
        )
    writer = collected["writer", 0]
    spans: dict[int, list[list[float]]] = {}
    for i in range(workers):
        spans.update(collected["peers", i])
    return {
        "writer": [s[1] for s in writer["spans"]],
        "starts": {0: [s[0] for s in writer["spans"]]} | {r: [s[0] for s in v] for r, v in spans.items()},
        "peers": {r: [s[1] for s in v] for r, v in spans.items()},
        "cpu": {r: [s[2] for s in v] for r, v in spans.items()},
        "reads": {r: [s[3:6] for s in v] for r, v in spans.items()},
        "keys": writer["keys"],
        "libuv": bool(getattr(server, "libuvBackend", False)),
    }


# -- figures ---------------------------------------------------------------------------------------


def _pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1), linearly interpolated between order statistics."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _latencies(data: dict[str, Any]) -> tuple[list[float], dict[int, list[float]]]:
    """Per save: writer return -> last peer return (ms); per peer: writer return -> its return (ms)."""
    writer = data["writer"]
    per_peer = {
        r: [(end - w) * 1e3 for end, w in zip(ends, writer, strict=True)] for r, ends in data["peers"].items()
    }
    last = [max(per_peer[r][i] for r in per_peer) for i in range(len(writer))]
    return last, per_peer


_KEY = re.compile(r"safeio/[0-9a-f]{20}/(?:last|[0-9a-f]{12}/[0-9]+(?P<suffix>/phase|/acks)?)$")


def _kind(key: str) -> str:
    match = _KEY.search(key)
    if match is None:
        return "other"
    if key.endswith("/last"):
        return "<target>/last"
    return {None: "<call> (outcome)", "/phase": "<call>/phase", "/acks": "<call>/acks"}[match["suffix"]]


def _key_changes(keys: list[tuple[int, list[str] | None]]) -> tuple[list[float], dict[str, int], list[str]]:
    """Per save: keys after minus before; which kinds of key were added or removed; an example of each."""
    deltas = [float(after[0] - before[0]) for before, after in itertools.pairwise(keys)]
    kinds: dict[str, int] = {}
    examples: list[str] = []
    for (_, before), (_, after) in itertools.pairwise(keys):
        if before is None or after is None:
            continue
        for sign, changed in (("+", set(after) - set(before)), ("-", set(before) - set(after))):
            for key in sorted(changed):
                label = f"{sign} {_kind(key)}"
                kinds[label] = kinds.get(label, 0) + 1
                if len(examples) < 4 and not any(e.startswith(label) for e in examples):
                    examples.append(f"{label}: {key}")
    return deltas, kinds, examples


def _cost_row(label: str, data: dict[str, Any], saves: int) -> list[str]:
    cpu = data["cpu"]
    per_save = [sum(values[i] for values in cpu.values()) * 1e3 for i in range(saves)]
    cells = [
        label,
        f"{_pct([v * 1e3 for vs in cpu.values() for v in vs], 0.5):.2f}",
        f"{_pct(per_save, 0.5):.1f}",
        f"{_pct(per_save, 0.5) / (os.cpu_count() or 1):.1f}",
    ]
    reads = [r for rs in data.get("reads", {}).values() for r in rs]
    if not reads:
        return [*cells, "not measured", "not measured"]
    counts = [r[0] for r in reads]
    return [
        *cells,
        f"{_pct(counts, 0.5):.0f} / {max(counts):.0f}",
        f"{_pct([r[1] * 1e3 for r in reads], 0.5):.2f} / {_pct([r[2] * 1e3 for r in reads], 0.5):.2f}",
    ]


def _who(n: int, simulated: bool) -> str:
    return f"{n:,} simulated peers" if simulated else f"{n} ranks"


def run(quick: bool = False, disk: str = "/tmp") -> Result:
    worlds = [4] if quick else [8, 32]
    reps = 12 if quick else 100
    peers, workers, sim_reps = (64, 2, 6) if quick else (1024, 8, 40)
    about = __doc__.split("\n\n", 1)[1].strip()
    result = Result(
        NAME,
        "7. Peer release latency: writer return to last peer return",
        about,
        params={
            "worlds": worlds,
            "reps": reps,
            "simulated_peers": peers,
            "simulated_workers": workers,
            "simulated_reps": sim_reps,
            "warmup": WARMUP,
            "disk": disk,
            "save": "safeio.save_pretrained(fast_tokenizer(), <root>/checkpoint-N/tokenizer), defaults",
        },
    )
    runs: dict[str, dict[str, Any]] = {}
    for world in worlds:
        runs[_who(world, False)] = _real(world, reps, disk)
    runs[_who(peers, True)] = sim = _simulated(peers, workers, sim_reps, disk)
    result.params["libuv"] = sim["libuv"]
    _report(result, runs, worlds, peers)
    return result


def _report(result: Result, runs: dict[str, dict[str, Any]], worlds: list[int], peers: int) -> None:
    summary, cost_rows = [], []
    plot: dict[str, list[float]] = {"p50": [], "p99": [], "max": []}
    xs: list[int] = []
    key_rows = []
    leftovers: dict[str, str] = {}  # kind -> an example key
    for label, data in runs.items():
        simulated = label.endswith("simulated peers")
        n_peers = len(data["peers"])
        last, per_peer = _latencies(data)
        pooled = [v for values in per_peer.values() for v in values]
        stats = {r: [round(_pct(vs, q), 3) for q in (0.5, 0.99, 1.0)] for r, vs in per_peer.items()}
        result.samples[label] = {"last_peer_ms": [round(v, 3) for v in last]}
        if len(stats) <= PER_PEER_SAMPLES:  # each peer (by rank): its p50 / p99 / max over the saves
            result.samples[label]["per_peer_p50_p99_max_ms"] = {str(r): v for r, v in stats.items()}
        else:  # too many to list: the deciles across peers of each peer's p50, p99 and max
            result.samples[label]["per_peer_deciles_ms"] = {
                name: [round(_pct([v[i] for v in stats.values()], d / 10), 3) for d in range(11)]
                for i, name in enumerate(("p50", "p99", "max"))
            }
        p50, p99, worst = _pct(last, 0.5), _pct(last, 0.99), max(last)
        world = n_peers + 1
        if simulated:
            limits: tuple[float | None, float | None] = (None, SIMULATED_P99_MS)
        else:
            limits = TARGETS.get(world, (None, None))
        for name, value, limit in (("p50", p50, limits[0]), ("p99", p99, limits[1])):
            spread = Spread.of(last) if name == "p50" else Spread(p99, p99, p99, len(last))
            result.rows.append(
                Row(
                    f"7. {label}: writer return -> last peer return, {name}",
                    f"over {len(last)} saves "
                    f"({'median [min-max]' if name == 'p50' else f'max {worst:.1f} ms'})",
                    f"≤ {limit:g} ms" if limit is not None else "informational",
                    spread,
                    "ms",
                    None if limit is None else value <= limit,
                )
            )
        entry = [
            max(data["starts"][r][i] for r in data["starts"])
            - min(data["starts"][r][i] for r in data["starts"])
            for i in range(len(last))
        ]
        medians = [_pct(vs, 0.5) for vs in per_peer.values()]
        nineties = [_pct(vs, 0.99) for vs in per_peer.values()]
        summary.append(
            [
                label,
                str(len(last)),
                f"{p50:.1f} / {_pct(last, 0.9):.1f} / {p99:.1f} / {worst:.1f}",
                f"{_pct(pooled, 0.5):.1f} / {_pct(pooled, 0.99):.1f} / {min(pooled):.1f} / {max(pooled):.1f}",
                f"{min(medians):.1f} / {_pct(medians, 0.5):.1f} / {max(medians):.1f}",
                f"{min(nineties):.1f} / {_pct(nineties, 0.5):.1f} / {max(nineties):.1f}",
                f"{_pct(entry, 0.5) * 1e3:.1f} / {max(entry) * 1e3:.1f}",
            ]
        )
        xs.append(n_peers)
        plot["p50"].append(p50)
        plot["p99"].append(p99)
        plot["max"].append(worst)
        cost_rows.append(_cost_row(label, data, len(last)))
        deltas, kinds, examples = _key_changes(data["keys"])
        first = data["keys"][0][0] if data["keys"] else 0
        final = data["keys"][-1][0] if data["keys"] else 0
        key_rows.append(
            [
                label,
                f"{first} -> {final}",
                f"{min(deltas):+.0f} .. {max(deltas):+.0f}" if deltas else "n/a",
                ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())) or "none",
            ]
        )
        result.samples[label]["store_keys"] = [k[0] for k in data["keys"]]
        for example in examples:
            leftovers.setdefault(example.split(": ", 1)[0], example)
        result.rows.append(
            Row(
                f"7. {label}: store keys after a save minus before",
                f"{'its own TCPStore' if simulated else 'the default group store'}: num_keys() once every "
                f"peer has returned, per save; {first} before the first measured save, {final} after "
                "the last",
                "0 after every save",
                Spread.of(deltas),
                "keys",
                bool(deltas) and all(d == 0 for d in deltas),
            )
        )
    result.tables.append(
        {
            "title": "Release latency in ms: per save (last peer) and per peer",
            "header": [
                "set-up",
                "saves",
                "last peer: p50 / p90 / p99 / max",
                "every peer, pooled: p50 / p99 / min / max",
                "per-peer median: min / median / max across peers",
                "per-peer p99: min / median / max across peers",
                "entry spread (first to last rank starting the save): p50 / max",
            ],
            "rows": summary,
        }
    )
    result.tables.append(
        {
            "title": "Where the peers' time goes, per save (CPU: each peer thread's own, time.thread_time)",
            "header": [
                "set-up",
                "CPU per peer save: median (ms)",
                "CPU of all peers per save: median (ms)",
                f"the same / {os.cpu_count()} cores (ms)",
                "looks at the target per peer save: median / max",
                "time in those looks per peer save: median wall / CPU (ms)",
            ],
            "rows": cost_rows,
        }
    )
    result.tables.append(
        {
            "title": "Store keys (TCPStore.num_keys and list_keys, measured between saves)",
            "header": [
                "set-up",
                "before first -> after last",
                "per-save change",
                "keys added (+) / removed (-)",
            ],
            "rows": key_rows,
        }
    )
    result.notes.append(
        "Keys the saves left in the store, by kind (an example of each): "
        + ("; ".join(leftovers[k] for k in sorted(leftovers)) if leftovers else "none")
        + ". What a save puts in the store: the outcome (<call>), the writer's progress record "
        "(<call>/phase, never written once the outcome is), the peers' acknowledgements (<call>/acks) and "
        "the target's last-save record for timeout messages (<target>/last, written before the outcome); "
        "the last peer to acknowledge deletes all four, so a key left here is one that outlived its save."
    )
    result.notes.append(
        "A peer can return before its writer does (negative latencies): after publishing the outcome the "
        "writer still stops its watchdog and returns through its own frames. The entry spread is how far apart "
        "the ranks started the save after the barrier; with many peers on two cores some peers are still "
        "entering when the writer has already returned, which the figure includes."
    )
    result.notes.append(
        "Real ranks share the default process group's store with torch.distributed (its own keys are "
        "counted too); simulated peers use a store of their own, so its count is safeio's alone. Each "
        "simulated peer, once the outcome is in, looks at the target on the filesystem until it sees the "
        "new version (safeio's visibility check, DirectoryVisibility; its calls are counted and timed per "
        f"peer, the 'looks' above): {peers:,} peers look at one directory per save on the same disk, and "
        "that CPU and I/O are inside the figure."
    )
    result.plots.append(
        {
            "title": "7. peer release latency (writer return -> last peer)",
            "kind": "lines",
            "xlabel": "peers (non-writers)",
            "ylabel": "ms",
            "logx": True,
            "logy": True,
            "series": {name: {"x": xs, "y": ys, "lo": ys, "hi": ys} for name, ys in plot.items()},
        }
    )
