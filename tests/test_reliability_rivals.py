"""Rival writers: two independent jobs (two process groups, each with its own store and writer) promote
the same target concurrently, many times. The promotion lock (``lock="auto"``: flock on local disk,
filelock's SoftFileLease on the NFS-like mount) serialises them: no save fails, no ``LockTimeout`` below
the configured timeout, and the target always ends as one complete version. Without the lock, on a
filesystem without ``RENAME_EXCHANGE``, the same rivals collide. A lock holder killed while holding
the lock is recovered from (flock: the kernel drops it; lease: it expires), where filelock's strict
soft lock stays blocked.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import safeio
from safeio._storage.locking import lock_path_for, make_lock
from safeio.testing.nfslike import Mount
from safeio.testing.ranks import RankResult, run_ranks
from tests._bounds import PATIENT
from tests._reliability import SCALE, SEED, record, scaled

SAVES = scaled(8)  # per job
JOB_TIMEOUT = 5.0  # far above a promotion's lock hold (milliseconds); bounds the known peer timeout
FILES = ("config.json", "tokenizer.json", "vocab.txt")


def _write(stage_path: str, token: str) -> None:
    for name in FILES:
        with open(os.path.join(stage_path, name), "w", encoding="utf-8") as f:
            f.write(token * 200)


def _rival_job(rank: int, world: int, target: str, job: str, saves: int) -> dict[str, Any]:
    import torch.distributed as dist

    errors: list[str] = []
    superseded = 0
    for i in range(saves):
        try:
            with safeio.replicated(target, timeout=JOB_TIMEOUT) as stage:
                if stage.is_writer:
                    _write(stage.path, f"{job}-{i:04d};")
        except safeio.PeerTimeout as exc:
            # Known limit (see the report): a peer checks that *its* save is visible (NFS client caches)
            # by the manifest's call id; when the rival job has already replaced the target, it never
            # is, and the peer times out although its writer succeeded. Counted, not hidden.
            if exc.phase == "done" and "does not see that version" in str(exc):
                superseded += 1
            else:
                errors.append(f"PeerTimeout: {exc}")
        except safeio.SafeIOError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    # Keep rank 0 (the TCPStore's host) alive until its peer has read every outcome: a peer that lost
    # the store would fall back to the manifest, where the rival's save hides its own (same limit).
    dist.barrier()
    return {"errors": errors, "superseded": superseded}


def _one_version(target: str) -> str:
    assert safeio.verify(target) == [], safeio.verify(target)
    contents = {Path(target, name).read_text() for name in FILES}
    assert len(contents) == 1, f"the target mixes saves: {sorted(c[:12] for c in contents)}"
    return contents.pop()[:10]


def _rivals(parent: Path) -> dict[str, Any]:
    target = str(parent / "tok")
    results: dict[str, list[RankResult]] = {}

    def job(name: str) -> None:
        results[name] = run_ranks(_rival_job, 2, target, name, SAVES, timeout=240, check=False)

    threads = [threading.Thread(target=job, args=(name,)) for name in ("jobA", "jobB")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    errors = [
        e for rs in results.values() for r in rs for e in ([repr(r.error)] if r.error else r.value["errors"])
    ]
    assert errors == [], errors  # no LockTimeout, no failed save
    superseded = sum(r.value["superseded"] for rs in results.values() for r in rs)
    final = _one_version(target)
    leftovers = [n for n in os.listdir(parent) if ".safeio-" in n and not n.endswith(".safeio.lock")]
    assert leftovers == [], leftovers
    return {
        "jobs": 2,
        "ranks_per_job": 2,
        "saves": 2 * SAVES,
        "failed": 0,
        "lock_timeouts": 0,
        "peer_timeouts_superseded": superseded,
        "final": final,
    }


def test_rival_jobs_local(shared_dir: Path) -> None:
    figures = _rivals(shared_dir)
    print(f"seed {SEED}, scale {SCALE}: {figures}")
    record("rivals-local", {"filesystem": "local (flock)", **figures})


def test_rival_jobs_nfslike(nfslike_mount: Mount) -> None:
    figures = _rivals(nfslike_mount.path)
    print(f"seed {SEED}, scale {SCALE}: {figures}")
    record("rivals-nfslike", {"filesystem": "nfslike (SoftFileLease)", **figures})


def _unlocked_rival(target: str, job: str, saves: int, together: Any, results: Any) -> None:
    os.environ["SAFEIO_NO_EXCHANGE"] = "1"  # as on NFS: the rename-aside fallback
    errors, done = [], 0
    while done < saves:
        # Both rivals start each save together, so that their promotions overlap: left to run freely on
        # a loaded machine, the scheduler ran them one after the other. The barrier is broken by the
        # first collision (or a rival's end).
        try:
            together.wait(timeout=PATIENT)
        except threading.BrokenBarrierError:
            break
        done += 1
        try:
            with safeio.replicated(target, timeout=60, lock=False) as stage:
                _write(stage.path, f"{job}-{done:04d};")
        except safeio.SafeIOError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            together.abort()  # proven: stop both rivals
    together.abort()  # the other rival must not wait for a save this one will not make
    results.put((done, errors))


@pytest.mark.fuse_opts(latency=0.005)
def test_without_the_lock_rivals_collide(nfslike_mount: Mount) -> None:
    """The baseline for the tests above: the same rivals with ``lock=False`` fail saves. On the NFS-like
    mount with 5 ms per operation (a server's round trip), so that one rival's window between renaming
    the old version aside and its stage in is wide enough for the other's to fall into it whatever the
    load: on local disk, under 8 CPU burners and a second suite, 6,000 unlocked saves never collided."""
    target = str(nfslike_mount.path / "tok")
    ctx = mp.get_context("fork")
    results, together = ctx.Queue(), ctx.Barrier(2)
    limit = 500  # saves per rival at most; they collide within a few
    procs = [
        ctx.Process(target=_unlocked_rival, args=(target, job, limit, together, results))
        for job in ("A", "B")
    ]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=PATIENT) for _ in procs]
    for proc in procs:
        proc.join(30)
    saves = sum(done for done, _ in outcomes)
    errors = [e for _, errs in outcomes for e in errs]
    print(f"without the lock: {len(errors)} failed of {saves} saves, e.g. {errors[:2]}")
    record("rivals-unlocked", {"saves": saves, "failed": len(errors)})
    assert errors, "two unlocked rivals never collided: the baseline proves nothing"


def _hold_lock(path: str, kind: str, ready: Any) -> None:
    lock = make_lock(path, kind, 10)  # type: ignore[arg-type]
    assert lock is not None
    lock.acquire()
    ready.set()
    threading.Event().wait(120)  # holds the lock until killed


def _kill_holder(parent: str, kind: str) -> None:
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(lock_path_for(parent, "tok"), kind, ready))
    holder.start()
    assert ready.wait(PATIENT), "the lock holder never got the lock"
    os.kill(holder.pid or 0, signal.SIGKILL)
    holder.join(30)


def _timed_save(target: str, lock: Any, timeout: float) -> float:
    start = time.monotonic()
    with safeio.replicated(target, timeout=timeout, lock=lock) as stage:
        _write(stage.path, "after-the-crash;")
    return time.monotonic() - start


def test_a_crashed_flock_holder_is_recovered_from(shared_dir: Path) -> None:
    _timed_save(str(shared_dir / "tok"), "auto", 30)  # a first save takes no lock; a replacement does
    _kill_holder(str(shared_dir), "flock")
    took = _timed_save(str(shared_dir / "tok"), "auto", 30)
    assert took < 10 and _one_version(str(shared_dir / "tok")).startswith("after")


def test_a_crashed_lease_holder_is_recovered_from(
    nfslike_mount: Mount, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = str(nfslike_mount.path)
    # SAFEIO_LEASE_SECONDS is read at import; this process imported safeio long ago.
    monkeypatch.setenv("SAFEIO_LEASE_SECONDS", "1.0")
    _timed_save(os.path.join(parent, "tok"), "auto", 30)  # a first save takes no lock; a replacement does
    _kill_holder(parent, "strict")
    # Baseline: filelock's fail-closed strict soft lock stays held by the dead process.
    with pytest.raises(safeio.LockTimeout):
        _timed_save(os.path.join(parent, "tok"), "strict", 2)
    os.unlink(lock_path_for(parent, "tok"))  # the manual break a strict lock needs
    _kill_holder(parent, "lease")
    took = _timed_save(os.path.join(parent, "tok"), "auto", 30)  # auto = lease on this mount
    print(f"the next writer got the expired lease after {took:.1f} s")
    assert took < 15 and _one_version(os.path.join(parent, "tok")).startswith("after")
    record("stale-lease", {"lease_seconds": 1.0, "recovered_after_seconds": round(took, 2)})
