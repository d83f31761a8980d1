"""accelerate through ``safeio.integrations.accelerate``: real Accelerators on gloo ranks, the NFS-like
mount; every rank's files committed once, ``scaler.pt`` written once, ``total_limit`` after the commit,
resume from the newest committed checkpoint, and a rank killed mid-save leaving the previous one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import safeio
from safeio.cli import main
from safeio.testing.nfslike import Mount
from safeio.testing.ranks import run_ranks
from tests._bounds import PATIENT, RUN
from tests.test_checkpoints import _every_rank_past_dcp

pytest.importorskip("accelerate")


def _setup(root: str) -> Any:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=root, automatic_checkpoint_naming=True, total_limit=2
        ),
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.scaler = torch.amp.GradScaler("cpu")  # what mixed precision adds: scaler.pt on every rank
    accelerator._dataloaders.append(_StatefulLoader())  # as prepare() registers a stateful DataLoader
    return accelerator, model, optimizer


class _StatefulLoader:
    """What accelerate reads of a prepared ``use_stateful_dataloader`` loader (torchdata's
    StatefulDataLoader is not installed here): its dataset and its state, saved as dl_state_dict.bin."""

    use_stateful_dataloader = True
    dataset: list[int] = []

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def _train(model: Any, optimizer: Any) -> None:
    import torch

    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _loop(rank: int, world: int, root: str, steps: int, die: tuple[int, int] | None) -> dict[str, Any]:
    import torch

    from safeio.integrations import accelerate as safe_accelerate

    accelerator, model, optimizer = _setup(root)
    ckpts = safe_accelerate.checkpoints_for(accelerator, timeout=PATIENT)
    # Only the save a rank dies in waits out its report, briefly (that wait's length is the subject).
    dying = safe_accelerate.checkpoints_for(accelerator, timeout=4) if die else ckpts
    resumed = safe_accelerate.load_state(accelerator, ckpts)
    start = resumed.step + 1 if resumed else 0
    weights: dict[int, Any] = {}
    if die is not None and rank == die[0]:

        def killed(models: Any, weights: Any, output_dir: str) -> None:
            if accelerator.save_iteration == die[1]:
                os._exit(9)  # a rank killed inside save_state

        accelerator.register_save_state_pre_hook(killed)
    outcome = None
    for step in range(start, start + steps):
        _train(model, optimizer)
        weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            now = dying if die is not None and accelerator.save_iteration == die[1] else ckpts
            saved = safe_accelerate.save_state(accelerator, now)
        except safeio.CheckpointError as exc:
            outcome = str(exc)
            break
        assert saved.step == step
    found = ckpts.latest()
    if outcome is not None:  # a rank died: the job ends here (its restart is the next run_ranks)
        _every_rank_past_dcp(rank, world, "end", dead=(die[0],) if die else ())
        return {
            "resumed": resumed.step if resumed else None,
            "latest": found.step if found else None,
            "error": outcome,
        }
    # Every rank loads the newest committed checkpoint back and finds what it saved there.
    accelerator2, model2, _ = _setup(root)
    loaded = safe_accelerate.load_state(accelerator2, safe_accelerate.checkpoints_for(accelerator2))
    same = (
        loaded is not None
        and loaded.step in weights
        and all(torch.equal(model2.state_dict()[k], v) for k, v in weights[loaded.step].items())
    )
    _every_rank_past_dcp(rank, world, "end", dead=(die[0],) if die else ())
    return {
        "resumed": resumed.step if resumed else None,
        "latest": found.step if found else None,
        "same": same,
        "error": outcome,
    }


def test_save_state_commits_once_and_resumes(nfslike_mount: Mount) -> None:
    root = str(nfslike_mount.path / "project")
    results = run_ranks(_loop, 2, root, 3, None, timeout=RUN)
    for r in results:
        assert r.value == {"resumed": None, "latest": 2, "same": True, "error": None}, r
    ckpts = Path(root, "checkpoints")
    # accelerate's own layout, nothing else: its load_state() and total_limit rotation take a number from
    # every name there (a `latest` made a later run without safeio raise IndexError).
    assert sorted(os.listdir(ckpts)) == ["checkpoint_1", "checkpoint_2"]
    files = sorted(os.listdir(ckpts / "checkpoint_2"))
    assert {"random_states_0.pkl", "random_states_1.pkl", "scaler.pt", "model.safetensors"} <= set(files), (
        files
    )
    assert safeio.verify(ckpts / "checkpoint_2") == []
    assert nfslike_mount.hazards() == []  # scaler.pt and dl_state_dict.bin written once
    # A second job resumes from the newest committed checkpoint and numbers on from it.
    results = run_ranks(_loop, 2, root, 1, None, timeout=RUN)
    assert [r.value["resumed"] for r in results] == [2, 2] and [r.value["latest"] for r in results] == [3, 3]


def test_a_rank_killed_in_save_state_leaves_the_previous_checkpoint(shared_dir: Path) -> None:
    root = str(shared_dir / "project")
    results = run_ranks(_loop, 2, root, 3, (1, 2), timeout=RUN, check=False)
    assert results[1].error is not None  # rank 1 died in checkpoint_2's save_state
    survivor = results[0].value
    assert results[0].error is None, results[0].traceback
    assert "rank 1 never reported" in survivor["error"], survivor
    assert survivor["latest"] == 1
    assert sorted(n for n in os.listdir(Path(root, "checkpoints")) if not n.startswith(".")) == [
        "checkpoint_0",
        "checkpoint_1",
    ]
    # The restarted job resumes from checkpoint_1, loads exactly it, and saves checkpoint_2 anew.
    results = run_ranks(_loop, 2, root, 1, None, timeout=RUN)
    for r in results:
        assert r.value == {"resumed": 1, "latest": 2, "same": True, "error": None}, r


def _retention(rank: int, world: int, root: str) -> dict[str, Any]:
    """Four saves into each of three roots: a user's ``Checkpoints`` without ``keep`` under the script's
    ``total_limit`` (None, then 2), and one with ``keep=1`` under ``total_limit=None``."""
    from safeio.integrations import accelerate as safe_accelerate

    accelerator, model, optimizer = _setup(root)
    config = accelerator.project_configuration
    left: dict[str, Any] = {}
    for case, limit, keep in (("keep all", None, None), ("total_limit 2", 2, None), ("keep 1", None, 1)):
        config.total_limit = limit
        where = os.path.join(root, case.replace(" ", "_"))
        ckpts = safeio.Checkpoints(where, keep=keep) if keep else safeio.Checkpoints(where)
        for step in range(4):
            _train(model, optimizer)
            safe_accelerate.save_state(accelerator, ckpts, step=step)
        left[case] = (ckpts.steps(), ckpts.keep)
    _every_rank_past_dcp(rank, world, "end")
    return left


def test_save_state_keeps_the_scripts_retention_unless_keep_was_given(shared_dir: Path) -> None:
    """A ``safeio.Checkpoints(root)`` passed as ``ckpts=`` used to retire at its default keep=3 whatever
    the script's ``total_limit`` said (main: [1, 2, 3] kept of a keep-all script's four)."""
    results = run_ranks(_retention, 2, str(shared_dir / "project"), timeout=RUN)
    for r in results:
        assert r.value == {
            "keep all": ([0, 1, 2, 3], 3),  # total_limit=None: every checkpoint stays; ckpts as given
            "total_limit 2": ([2, 3], 3),
            "keep 1": ([3], 1),  # the user's own keep wins over the script's
        }, r


def _resume_over_plain(rank: int, world: int, root: str, phase: str) -> dict[str, Any]:
    """``plain``: accelerate's own save_state (automatic naming, no safeio) writes checkpoint_0 and 1, then
    rank 1 is killed as checkpoint_2's save starts (rank 0 finishes its part: its files, its random
    states). ``resume``: safeio's load_state over that directory; the safeio WARNINGs it logged."""
    import logging

    import torch

    from safeio.integrations import accelerate as safe_accelerate

    accelerator, model, optimizer = _setup(root)
    accelerator.project_configuration.total_limit = None
    if phase == "plain":
        if rank == 1:

            def killed(models: Any, weights: Any, output_dir: str) -> None:
                if accelerator.save_iteration == 2:
                    os._exit(9)

            accelerator.register_save_state_pre_hook(killed)
        saved = {}
        for step in range(3):
            _train(model, optimizer)
            saved[step] = {k: v.tolist() for k, v in model.state_dict().items()}
            accelerator.save_state()
        return {"saved": saved}  # no collective after: rank 1 is gone
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("safeio").addHandler(Collect(logging.WARNING))
    found = safe_accelerate.load_state(accelerator)
    _every_rank_past_dcp(rank, world, "end")
    return {
        "found": (found.step, os.path.basename(found.path), found.committed) if found else None,
        "weights": {k: torch.Tensor.tolist(v) for k, v in model.state_dict().items()},
        "iteration": accelerator.project_configuration.iteration,
        "warnings": warnings,
    }


def test_load_state_uses_a_complete_checkpoint_written_without_safeio_and_skips_torn_ones(
    nfslike_mount: Mount, capsys: pytest.CaptureFixture[str]
) -> None:
    """main: load_state found no committed checkpoint and returned None without a word: the "resumed"
    job started again from step 0 over checkpoints of its own; ``safeio ls`` did not list accelerate's
    ``checkpoint_<N>`` at all."""
    root = str(nfslike_mount.path / "project")
    plain = run_ranks(_resume_over_plain, 2, root, "plain", timeout=RUN, check=False)
    assert plain[1].error is not None and plain[0].error is None, plain[0].traceback
    checkpoints = Path(root, "checkpoints")
    killed = checkpoints / "checkpoint_2"  # rank 1 died as it began: rank 0's files only
    assert (killed / "random_states_0.pkl").is_file() and not (killed / "random_states_1.pkl").exists()
    # What a process killed while writing optimizer.bin leaves: the first half, under its final name.
    cut = checkpoints / "checkpoint_1" / "optimizer.bin"
    os.truncate(cut, cut.stat().st_size // 2)
    capsys.readouterr()
    assert main(["ls", "--json", str(checkpoints)]) == 0
    rows = json.loads(capsys.readouterr().out)["checkpoints"]
    states = {row["name"]: (row["state"], row["detail"]) for row in rows}
    assert states == {
        "checkpoint_0": (
            "written-without-safeio-complete",
            "complete by accelerate's random_states_<rank>.pkl of 2 ranks",
        ),
        "checkpoint_1": (
            "written-without-safeio-incomplete",
            "no safeio marker, and no framework marker safeio knows",
        ),
        "checkpoint_2": (
            "written-without-safeio-incomplete",
            "accelerate's random states of 1 of the 2 ranks its other checkpoints have",
        ),
    }, states
    results = run_ranks(_resume_over_plain, 2, root, "resume", timeout=RUN)
    for r in results:
        assert r.value["found"] == (0, "checkpoint_0", False), r
        assert r.value["weights"] == plain[0].value["saved"][0], r
        assert r.value["iteration"] == 1, r
    said = results[0].value["warnings"]  # the writer resolves, and says why
    assert any("checkpoint_0, which safeio did not commit" in w for w in said), said
    for torn in (killed, cut.parent):
        assert any(f"skipping {torn}: written without safeio and incomplete" in w for w in said), said
