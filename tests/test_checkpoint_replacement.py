"""A step saved again, a root kept free of safeio's own files, an agreed judgement of a step written
without safeio (issue 32): what the framework integrations need from ``Checkpoints`` to keep their
framework's semantics.

Real gloo ranks on local disk (where ``renameat2`` exchanges the old version for the new) and on the
NFS-like mount (which refuses the exchange, as NFS does: the old version is renamed aside first).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import safeio
from safeio.testing.nfslike import Mount
from safeio.testing.ranks import run_ranks
from tests._bounds import PATIENT, RUN


@pytest.fixture(params=["local", "nfslike"])
def root(request: pytest.FixtureRequest, shared_dir: Path) -> str:
    if request.param == "local":
        return str(shared_dir / "run")
    mount: Mount = request.getfixturevalue("nfslike_mount")
    return str(mount.path / "run")


def _save(ckpts: safeio.Checkpoints, step: int, content: bytes) -> None:
    with ckpts.save(step) as ckpt:
        Path(ckpt.path, f"shard_{ckpts.group().rank}.bin").write_bytes(content)  # every rank's own file
        safeio.torch_save({"step": step}, os.path.join(ckpt.path, "state.pt"))  # once, by the writer


def _rollback(rank: int, world: int, root: str, pointer: bool) -> dict[str, Any]:
    ckpts = safeio.Checkpoints(root, keep=None, timeout=PATIENT, **({} if pointer else {"pointer": False}))
    for step in (10, 20, 30):
        _save(ckpts, step, b"first")
    ckpts.at(10)  # a loss spike: the job resumes from 10 and trains through 20 again
    seen: dict[str, Any] = {}
    with ckpts.save(20) as ckpt:
        Path(ckpt.path, f"shard_{rank}.bin").write_bytes(b"second")
        if rank == 0:  # while the new version is written, the old one is whole under its name
            seen["old while saving"] = (
                safeio.verify(os.path.join(root, "step_20")),
                Path(root, "step_20", "shard_1.bin").read_bytes(),
            )
    ckpts.wait()
    latest = ckpts.latest()
    seen["latest"] = latest.step if latest is not None else None
    seen["steps"] = ckpts.steps()
    return seen


def test_a_committed_step_saved_again_replaces_it_whole_and_becomes_the_latest(root: str) -> None:
    """A rollback (resume from 10, train through 20 again) or a re-run into the same root: before, the
    save of 20 raised TargetExistsError on the writer (and CheckpointError on the others) after the
    steps in between were computed. Now the new version is committed in place of the old one, which
    stays whole until then, and commit order makes it the latest (30 stays the highest number)."""
    results = run_ranks(_rollback, 2, root, True, timeout=RUN)
    seen = results[0].value
    assert seen["old while saving"] == ([], b"first")
    assert [r.value["latest"] for r in results] == [20, 20]
    assert [r.value["steps"] for r in results] == [[10, 20, 30], [10, 20, 30]]
    assert safeio.verify(Path(root, "step_20")) == []
    assert {Path(root, "step_20", f"shard_{r}.bin").read_bytes() for r in (0, 1)} == {b"second"}
    # The old version went, after the commit: nothing of it is left beside the steps.
    assert sorted(os.listdir(root)) == [
        ".checkpoints.safeio.sequence",
        "latest",
        "step_10",
        "step_20",
        "step_30",
    ]
    assert Path(root, "latest").read_text() == "step_20"


def test_a_root_without_pointer_files_holds_the_steps_alone(root: str, capsys: Any) -> None:
    """``pointer=False`` (the integrations' roots: the Trainer's output_dir, a script's accelerate
    directories): no ``latest``, no sequence record, no lock file — the root's listing is the steps —
    and commit order still decides the latest after a rollback (read from the markers)."""
    results = run_ranks(_rollback, 2, root, False, timeout=RUN)
    assert [(r.value["latest"], r.value["steps"]) for r in results] == [(20, [10, 20, 30])] * 2
    assert sorted(os.listdir(root)) == ["step_10", "step_20", "step_30"]
    # `safeio verify` still knows it for a root of checkpoints (by its steps' markers) and checks each.
    from safeio.cli import main

    assert main(["verify", root]) == 0
    assert "3 committed checkpoint(s)" in capsys.readouterr().out
    # The next commit is numbered after the highest a marker holds: the latest stays a commit-order fact.
    ckpts = safeio.Checkpoints(root, keep=2, pointer=False)
    _save(ckpts, 5, b"third")
    ckpts.wait()
    latest = ckpts.latest()
    assert latest is not None and latest.step == 5
    assert sorted(os.listdir(root)) == ["step_20", "step_5"]  # keep=2 by commit order: 20 (again), then 5
    # A root that has the pointer files (safeio's own, written by a Checkpoints with pointers) keeps them.
    _save(safeio.Checkpoints(root, keep=None), 6, b"fourth")
    _save(ckpts, 7, b"fifth")
    assert Path(root, "latest").read_text() == "step_7"


def test_an_object_store_refuses_a_committed_step_saved_again(s3: dict[str, str]) -> None:
    """No rename on an object store: the new version would be written over the old one in place, torn
    before its marker commits anything. Refused before the body, saying why."""
    ckpts = safeio.Checkpoints(f"s3://{s3['BUCKET']}/run", keep=None)
    with ckpts.save(1) as ckpt:
        safeio.torch_save({"step": 1}, f"{ckpt.path}/state.pt")
    with pytest.raises(safeio.TargetExistsError, match="cannot be replaced whole"), ckpts.save(1):
        raise AssertionError("the body never runs")
    assert ckpts.steps() == [1]


def _judged(rank: int, world: int, root: str) -> Any:
    ckpts = safeio.Checkpoints(root, keep=None, timeout=PATIENT)
    found = ckpts.at(3, unmarked=lambda path: rank == 0)  # the ranks' views of the directory differ
    return (found.step, found.committed)


def test_at_judges_a_step_written_without_safeio_once_for_every_rank(shared_dir: Path) -> None:
    """``at(step, unmarked=...)``: a step directory written without safeio is judged by the writer and
    every rank gets its answer. (The accelerate patch judged it on each rank alone: a rank whose view of
    the shared directory lagged refused what the others loaded.)"""
    root = shared_dir / "run"
    (root / "step_3").mkdir(parents=True)
    (root / "step_3" / "weights.bin").write_bytes(b"plain")
    results = run_ranks(_judged, 2, str(root), timeout=RUN)
    assert [r.value for r in results] == [(3, False), (3, False)]


def test_the_commit_locks_the_root_directory_itself(shared_dir: Path) -> None:
    """On a local disk the root's commit lock is a flock on the root directory (no lock file in a
    framework's own directory): a rival job holding it makes the commit wait, and time out."""
    import fcntl

    root = shared_dir / "run"
    ckpts = safeio.Checkpoints(root, keep=None, timeout=1, pointer=False)
    _save(ckpts, 1, b"first")
    rival = os.open(root, os.O_RDONLY | os.O_DIRECTORY)  # another open file description: another job
    try:
        fcntl.flock(rival, fcntl.LOCK_EX)
        with pytest.raises(safeio.LockTimeout), ckpts.save(2) as ckpt:
            Path(ckpt.path, "shard_0.bin").write_bytes(b"second")
    finally:
        os.close(rival)
    assert ckpts.committed() == [(1, "step_1")]
    _save(ckpts, 2, b"second")  # released: committed
    assert sorted(os.listdir(root)) == ["step_1", "step_2"]


def test_a_save_adopts_the_files_of_the_directory_it_saves_into(shared_dir: Path, monkeypatch: Any) -> None:
    """``save(step, adopt=True)`` (the accelerate patch's ``save_state(dir)``): what the directory holds
    stays in the committed step — nested files, links as links — under what the save wrote, which wins;
    an earlier safeio marker there is not kept. Copied where the filesystem refuses hard links."""
    import errno

    root = shared_dir / "run"
    step = root / "step_3"
    (step / "tokenizer").mkdir(parents=True)
    (step / "tokenizer" / "vocab.txt").write_text("the script's")
    (step / "optimizer.bin").write_bytes(b"stale")
    (step / "link").symlink_to("tokenizer/vocab.txt")
    (step / ".safeio-manifest.json").write_text('{"format": 2, "files": {}}')  # an earlier save's marker
    real_link = os.link

    def refused(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EXDEV, "no hard links here")

    monkeypatch.setattr(os, "link", refused)
    ckpts = safeio.Checkpoints(root, keep=None, pointer=False)
    with ckpts.save(3, adopt=True) as ckpt:
        Path(ckpt.path, "optimizer.bin").write_bytes(b"new")
    monkeypatch.setattr(os, "link", real_link)
    ckpts.wait()
    assert safeio.verify(step) == [] and ckpts.committed() == [(3, "step_3")]
    assert (step / "optimizer.bin").read_bytes() == b"new"
    assert (step / "tokenizer" / "vocab.txt").read_text() == "the script's"
    assert os.readlink(step / "link") == "tokenizer/vocab.txt"
    assert sorted(os.listdir(root)) == ["step_3"]
    # Without adopt, a directory safeio did not write is refused, untouched.
    (root / "step_4").mkdir()
    (root / "step_4" / "notes.txt").write_text("mine")
    with pytest.raises(safeio.InvalidTargetError, match="step_4 exists"), ckpts.save(4):
        pass
    assert os.listdir(root / "step_4") == ["notes.txt"]
