"""``accelerator.save_state(dir)`` under ``SAFEIO_PATCH=accelerate`` works as accelerate does (issue 32 item
4), with the directory committed: 2 gloo ranks on the NFS-like mount.

accelerate writes into whatever directory it is given: an empty one the script made (a ``tempfile``
directory's name ends in a digit about one time in four, which makes it a "numbered" directory the patch
commits), one the script already wrote a tokenizer into, one it saved before. Before, the first two were
refused with ``InvalidTargetError`` and the third with ``TargetExistsError``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

import safeio
from safeio.testing import hf_objects
from safeio.testing.nfslike import Mount
from safeio.testing.ranks import run_ranks
from tests._bounds import RUN

pytest.importorskip("accelerate")


def _saves_into_the_scripts_directories(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator

    from safeio.integrations._accelerate_patch import patch_accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    made, tokenized = f"{root}/tmpk2f9", f"{root}/step_3"
    os.makedirs(made, exist_ok=True)  # every rank, as scripts do: an empty directory to save into
    if accelerator.is_main_process:
        hf_objects.fast_tokenizer().save_pretrained(tokenized)  # the script's tokenizer, beside the state
    accelerator.wait_for_everyone()
    seen: dict[str, Any] = {}
    with patch_accelerator():
        seen["saved"] = [accelerator.save_state(made), accelerator.save_state(tokenized)]
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        seen["saved again"] = accelerator.save_state(tokenized)  # the same step, after more training
        trained = {k: v.clone() for k, v in model.state_dict().items()}
        accelerator.load_state(made)
        seen["loaded the first"] = all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
        accelerator.load_state(tokenized)
        seen["loaded the second"] = all(torch.equal(model.state_dict()[k], v) for k, v in trained.items())
    return seen


def test_save_state_into_the_scripts_own_directories_works_and_commits_them(nfslike_mount: Mount) -> None:
    from transformers import AutoTokenizer

    root = nfslike_mount.path / "run"
    results = run_ranks(_saves_into_the_scripts_directories, 2, os.fspath(root), timeout=RUN)
    for result in results:
        seen = result.value
        assert seen["saved"] == [os.fspath(root / "tmpk2f9"), os.fspath(root / "step_3")], seen
        assert seen["saved again"] == os.fspath(root / "step_3") and seen["loaded the first"], seen
        assert seen["loaded the second"], seen
    for name in ("tmpk2f9", "step_3"):
        assert safeio.verify(root / name) == []  # committed: every rank's files listed by its marker
        assert {"model.safetensors", "random_states_0.pkl", "random_states_1.pkl"} <= set(
            os.listdir(root / name)
        )
    # The tokenizer the script wrote there stays, through both saves, and loads.
    assert (
        AutoTokenizer.from_pretrained(root / "step_3").get_vocab() == hf_objects.fast_tokenizer().get_vocab()
    )
    # Nothing of safeio's beside the script's directories: accelerate's own listing of the parent is as
    # it would be.
    assert sorted(os.listdir(root)) == ["step_3", "tmpk2f9"]
    assert nfslike_mount.hazards() == []
