"""Full disks and error propagation at scale.

- ENOSPC at many points of a tokenizer + model save (the NFS-like mount's byte budget: Python, Rust
  and safetensors writes all hit it): a clear ``PromotionError`` (errno ENOSPC), the old version
  intact and loadable, no stage left. The unguarded ``save_pretrained`` over the same old version, with
  the same budget, loses it — the failure safeio prevents.
- With 8 gloo ranks, a writer failure of each kind (body error, ENOSPC, EIO on fsync, a file or a
  foreign symlink where the target should be, ``mode="error"``, a lock held by a rival past the
  timeout) reaches every rank as ``RemoteWriterError``, told by the writer long before the peers' own
  (generous) timeout; a writer killed outright makes every peer raise ``PeerTimeout`` at its timeout. No
  rank hangs. How fast each peer learned is recorded for the reliability report; the test asserts only
  what load cannot change (issue 37: a 5 s bound failed on a loaded machine).
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import safeio
from safeio._storage.locking import lock_path_for, make_lock
from safeio.testing.nfslike import Mount
from safeio.testing.ranks import run_ranks
from tests._bounds import PATIENT, RUN
from tests._reliability import SCALE, SEED, record, scaled, whole_version, write_version

pytest.importorskip("transformers")

WORLD = 8
# The peers' timeout where the writer's failure is the subject: a peer that was not told would wait it
# out, so being told is the outcome RemoteWriterError, and "fast" is "far sooner than this".
TOLD_WITHIN = PATIENT
KILLED_TIMEOUT = 4.0  # a dead writer publishes nothing: peers learn it at their timeout (the subject)
WRITER_LOCK_TIMEOUT = 2.0  # the writer's wait for the rival's lock (its LockTimeout is the subject)


def _stage_dirs(parent: Path) -> list[str]:
    return [n for n in os.listdir(parent) if ".safeio-" in n and not n.endswith(".safeio.lock")]


def _loadable(target: Path, version: int) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    assert whole_version(str(target)) == version
    assert safeio.verify(target) == []
    assert AutoTokenizer.from_pretrained(target)("hello world")["input_ids"]
    LlamaForCausalLM.from_pretrained(target)


def test_enospc_at_every_point_of_a_save(nfslike_mount: Mount) -> None:
    parent = nfslike_mount.path
    target = parent / "ckpt"
    write_version(1, str(parent / "size-probe"))
    size = sum(f.stat().st_size for f in (parent / "size-probe").iterdir())
    with safeio.replicated(target, timeout=30) as stage:
        write_version(1, stage.path)
    budgets = sorted({int(size * i / scaled(8)) for i in range(scaled(8))})
    failures: dict[str, int] = {}
    for budget in budgets:
        nfslike_mount.set_faults(enospc_after=budget)
        try:
            with pytest.raises(safeio.PromotionError) as info, safeio.replicated(target, timeout=30) as stage:
                write_version(2, stage.path)
        finally:
            nfslike_mount.set_faults(enospc_after=None)
        assert info.value.errno == errno.ENOSPC and "No space left" in str(info.value), info.value
        failures[str(budget)] = info.value.errno
        _loadable(target, 1)
        assert _stage_dirs(parent) == [], _stage_dirs(parent)
    # Baseline: the unguarded save, same budget, over the same old version.
    lost = 0
    for budget in budgets[1:]:
        plain = parent / f"plain-{budget}"
        write_version(1, str(plain))
        nfslike_mount.set_faults(enospc_after=budget)
        try:
            write_version(2, str(plain))
        except Exception:
            pass  # Rust tokenizers raise a bare Exception; transformers sometimes only logs
        finally:
            nfslike_mount.set_faults(enospc_after=None)
        lost += whole_version(str(plain)) is None
    print(f"seed {SEED}, scale {SCALE}: {len(budgets)} ENOSPC points, old version kept every time; "
          f"unguarded lost the old version {lost}/{len(budgets) - 1} times")  # fmt: skip
    record("enospc", {"faults": len(budgets), "old_version_kept": len(budgets), "unguarded_lost": lost,
                      "unguarded_tries": len(budgets) - 1})  # fmt: skip
    assert lost > 0, "the unguarded save never lost the old version: the baseline proves nothing"


# -- propagation at 8 ranks ------------------------------------------------------------------------


def _case_body(target: str, label: str, stage_path: str) -> None:
    if label == "body raises":
        raise ValueError("tokenizer exploded")
    if label == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    # enough bytes to cross the ENOSPC budget, and a file the EIO fault matches on fsync
    with open(os.path.join(stage_path, "weights.bin"), "wb") as f:
        f.write(b"\0" * 65536)


def _propagation(rank: int, world: int, cases: list[tuple[str, str, dict[str, Any]]]) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for label, target, case_options in cases:
        options = dict(case_options)
        writer_timeout = options.pop("writer_timeout", None)
        if rank == 0 and writer_timeout is not None:
            options["timeout"] = writer_timeout
        dist.barrier()  # every rank starts the case together; its clock starts here
        start = time.monotonic()
        try:
            with safeio.replicated(target, **options) as stage:
                if stage.is_writer:
                    _case_body(target, label, stage.path)
            outcome = "saved"
        except safeio.RemoteWriterError as exc:
            outcome = f"RemoteWriterError({exc.error_type})"
        except (safeio.SafeIOError, ValueError) as exc:
            outcome = type(exc).__name__
        out[label] = (outcome, round(time.monotonic() - start, 2))
    return out


@pytest.mark.fuse_opts(eio_on_fsync="eio/.*safeio-stage*/weights.bin")
def test_every_writer_failure_reaches_all_8_ranks(
    shared_dir: Path, nfslike_clients: tuple[Mount, Mount]
) -> None:
    full, other = nfslike_clients
    (shared_dir / "file").write_text("precious")
    (shared_dir / "link").symlink_to(shared_dir / "file")
    (shared_dir / "exists").mkdir()
    with safeio.replicated(shared_dir / "locked") as stage:  # only replacing a target takes the lock
        Path(stage.path, "old").write_text("old")
    (other.path / "eio").mkdir()
    timeout = {"timeout": TOLD_WITHIN}
    cases = [
        ("body raises", str(shared_dir / "body"), timeout),
        ("ENOSPC", str(full.path / "full"), timeout),
        ("EIO on fsync", str(other.path / "eio" / "tok"), timeout),
        ("target is a file", str(shared_dir / "file"), timeout),
        ("target is a foreign symlink", str(shared_dir / "link"), timeout),
        ("mode=error, target exists", str(shared_dir / "exists"), {**timeout, "mode": "error"}),
        # The writer gives up on the lock after 2 s; its peers wait longer than that, however late
        # load makes the writer start (with one timeout for all, peers timed out first under load).
        (
            "lock held past the timeout",
            str(shared_dir / "locked"),
            {**timeout, "writer_timeout": WRITER_LOCK_TIMEOUT},
        ),
        ("killed", str(shared_dir / "killed"), {"timeout": KILLED_TIMEOUT}),
    ]
    rival = make_lock(lock_path_for(str(shared_dir), "locked"), "flock", 5)
    assert rival is not None
    rival.acquire()  # a rival job holding the promotion lock throughout
    full.set_faults(enospc_after=30000)  # only the ENOSPC case writes through this client
    try:
        results = run_ranks(_propagation, WORLD, cases, timeout=RUN, check=False)
    finally:
        rival.release()
        full.set_faults(enospc_after=None)
    expected = {
        "body raises": "ValueError",
        "ENOSPC": "PromotionError",
        "EIO on fsync": "PromotionError",
        "target is a file": "InvalidTargetError",
        "target is a foreign symlink": "InvalidTargetError",
        "mode=error, target exists": "TargetExistsError",
        "lock held past the timeout": "LockTimeout",
    }
    # The killed writer reports nothing (rank 0 died); every peer reported every case.
    assert results[0].error is not None, results[0]
    worst: dict[str, float] = {}
    for r in results[1:]:
        assert r.ok, r
        for label, want in expected.items():
            outcome, took = r.value[label]
            # Told by the writer (a peer not told would raise PeerTimeout after TOLD_WITHIN).
            assert outcome == f"RemoteWriterError({want})", (r.rank, label, outcome)
            assert took < TOLD_WITHIN / 5, f"rank {r.rank} learned of {label!r} after {took} s"
            worst[label] = max(worst.get(label, 0.0), took)
        outcome, took = r.value["killed"]
        # The timeout is the subject: never before it; after it, by what load adds to a wake-up.
        assert outcome == "PeerTimeout" and KILLED_TIMEOUT <= took < KILLED_TIMEOUT + 60, (
            r.rank,
            outcome,
            took,
        )
        worst["killed"] = max(worst.get("killed", 0.0), took)
    assert (shared_dir / "file").read_text() == "precious" and os.path.islink(shared_dir / "link")
    print(f"slowest peer per case (s): {worst}")
    record("propagation", {"ranks": WORLD, "cases": len(cases), "slowest_peer_seconds": worst})
