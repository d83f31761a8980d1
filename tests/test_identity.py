"""Issue 14: a rank returns from its save only when the files its own call writes are at the target.

Real gloo ranks, real saves of real transformers objects, under `safeio.patch_save_pretrained()` as users
run them: saves guarded by "rank 0 only" (HF Trainer's ``save_model``, accelerate's ``is_main_process``)
mixed with unguarded ones into one directory, in several orders and numbers, nested, from threads; on
local disk and on two NFS-like clients with separate caches.

How an early return is caught: right after its tokenizer save returns, a peer checks the tokenizer's
files are at the target and loads it. To make the old failure certain rather than a race, rank 0 holds
its own tokenizer save back until a peer reports it returned — bounded by ``HOLD`` seconds, because with a
sound identity no peer returns before rank 0 has saved, and then the hold simply runs out. Run against
the per-process call counter (commit ac2f261), the mixed shapes here fail: the peer returned with only
``config.json`` at the target and could not load the tokenizer it had just "saved".
"""

from __future__ import annotations

import contextlib
import os
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import safeio
from safeio.testing import hf_objects
from safeio.testing.nfslike import Mount
from safeio.testing.ranks import run_ranks
from tests._bounds import PATIENT, RUN
from tests.test_nfs_proof import _enter_client_b

HOLD = 1.0  # how long rank 0 holds its tokenizer save back, waiting for a peer that returned early
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _store() -> Any:
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def _hold_for_early_peers(rank: int, label: str = "") -> None:
    """Rank 0, before its tokenizer save: give a peer that (wrongly) already returned time to say so."""
    if rank != 0:
        return
    with contextlib.suppress(Exception):  # a timeout is the expected outcome: no peer returned early
        _store().wait([f"peer-returned{label}"], timedelta(seconds=HOLD))


def _check_returned(rank: int, target: str, label: str = "") -> dict[str, Any]:
    """A peer, right after its tokenizer save returned: are that save's files there, and do they load?"""
    from transformers import AutoTokenizer

    present = [name for name in TOKENIZER_FILES if os.path.exists(os.path.join(target, name))]
    if rank != 0:
        with contextlib.suppress(Exception):  # rank 0 (the store's host) finished: nothing is held back
            _store().set(f"peer-returned{label}", str(rank))
    try:
        AutoTokenizer.from_pretrained(target)("hello world")
        loaded = True
    except Exception as exc:  # the failure the issue reports: "Couldn't instantiate the backend tokenizer"
        loaded = f"{type(exc).__name__}: {exc}"
    return {"present": present, "loaded": loaded}


def _save_config(target: str) -> None:
    hf_objects.config().save_pretrained(target)


def _save_tokenizer(target: str) -> None:
    hf_objects.fast_tokenizer().save_pretrained(target)


def _shape(rank: int, world: int, target: str, shape: str, clients: tuple[str, str] | None) -> dict[str, Any]:
    if clients is not None and rank % 2 == 1:
        _enter_client_b(*clients)  # odd ranks are the second NFS client, with its own caches
    with safeio.patch_save_pretrained(timeout=PATIENT):
        if shape == "guarded-then-every-rank":  # the ending of HF's and accelerate's example scripts
            if rank == 0:
                hf_objects.config().save_pretrained(target)
            _hold_for_early_peers(rank)
            hf_objects.fast_tokenizer().save_pretrained(target)
            return _check_returned(rank, target)
        if shape == "every-rank-then-guarded":
            hf_objects.fast_tokenizer().save_pretrained(target)
            seen = _check_returned(rank, target)
            if rank == 0:
                hf_objects.config().save_pretrained(target)
            return seen
        if shape == "several-guarded-in-a-loop":  # rank 0 saves three times more, every rank twice
            for step in range(2):
                if rank == 0:
                    for _ in range(3):
                        hf_objects.generation_config().save_pretrained(target)
                    hf_objects.config().save_pretrained(target)
                if step == 1:
                    _hold_for_early_peers(rank)
                hf_objects.fast_tokenizer(version=step + 1).save_pretrained(target)
            return _check_returned(rank, target)
        if shape == "one-helper-for-everything":  # guarded and unguarded saves through one line
            if rank == 0:
                _save_any(hf_objects.config(), target)
            _hold_for_early_peers(rank)
            _save_any(hf_objects.fast_tokenizer(), target)
            return _check_returned(rank, target)
        if shape == "nested":  # a processor saves its tokenizer inside its own save
            if rank == 0:
                hf_objects.config().save_pretrained(target)
            _hold_for_early_peers(rank)
            hf_objects.processor().save_pretrained(target)
            seen = _check_returned(rank, target)
            seen["processor"] = os.path.exists(os.path.join(target, "processor_config.json"))
            return seen
        if shape == "threads":  # a background thread saves the config on rank 0 only, meanwhile
            background = threading.Thread(
                target=lambda: rank == 0 and _save_config(target), name="checkpoint-writer"
            )
            background.start()
            _hold_for_early_peers(rank)
            _save_tokenizer(target)
            seen = _check_returned(rank, target)
            background.join(timeout=PATIENT)
            return seen
    raise ValueError(shape)


def _save_any(obj: Any, target: str) -> None:
    obj.save_pretrained(target)


SHAPES = [
    "guarded-then-every-rank",
    "every-rank-then-guarded",
    "several-guarded-in-a-loop",
    "one-helper-for-everything",
    "nested",
    "threads",
]


def _assert_every_rank_saw_its_save(results: list[Any]) -> None:
    for r in results:
        assert r.value["present"] == list(TOKENIZER_FILES), r
        assert r.value["loaded"] is True, r
        assert r.value.get("processor", True), r


@pytest.mark.parametrize("shape", SHAPES)
def test_shapes_on_local_disk(shared_dir: Path, shape: str) -> None:
    target = str(shared_dir / "out")
    _assert_every_rank_saw_its_save(run_ranks(_shape, 2, target, shape, None, timeout=RUN))


@pytest.mark.fuse_opts(attr_timeout=2.0, entry_timeout=2.0, negative_timeout=2.0)
@pytest.mark.parametrize("shape", SHAPES)
def test_shapes_on_two_nfs_clients(nfslike_clients: tuple[Mount, Mount], shape: str) -> None:
    a, b = nfslike_clients
    target = str(a.path / "out")
    # Rank 1 is the second client: it sees the writer's directory through its own stale caches.
    results = run_ranks(_shape, 2, target, shape, (str(a.path), str(b.path)), timeout=RUN)
    _assert_every_rank_saw_its_save(results)


def _peer_waits_for_a_save_nobody_makes(rank: int, world: int, target: str) -> dict[str, str]:
    with safeio.patch_save_pretrained(timeout=4):
        if rank == 0:
            config = hf_objects.config()
            config.save_pretrained(target)  # rank 0 never saves the tokenizer
            # Stay (bounded) until the peer has timed out: rank 0 hosts the store the peer asks.
            _store().wait(["peer-done"], timedelta(seconds=PATIENT))
            return {"config": type(config).__qualname__}
        tokenizer = hf_objects.fast_tokenizer()
        try:
            tokenizer.save_pretrained(target)
            message = "returned"
        except safeio.PeerTimeout as exc:
            message = str(exc)
        _store().set("peer-done", "1")
        return {"message": message, "tokenizer": type(tokenizer).__qualname__}


def test_a_save_nobody_makes_times_out_saying_what_it_waited_for(shared_dir: Path) -> None:
    target = str(shared_dir / "out")
    writer, peer = run_ranks(_peer_waits_for_a_save_nobody_makes, 2, target, timeout=RUN)
    message = peer.value["message"]
    # Which save it waited for (the object's type and the line) ...
    assert peer.value["tokenizer"] in message and "_peer_waits_for_a_save_nobody_makes" in message, message
    # ... and what the writer last published for the target: its config save, which succeeded.
    assert f"{writer.value['config']} from" in message and "succeeded" in message, message


# ---- real frameworks, launched the way their users launch them ------------------------------------


class _Tiny:
    """Eight token sequences, enough for a step or two of a tiny causal LM."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        ids = torch.tensor([(i + j) % 60 + 4 for j in range(8)])
        return {"input_ids": ids, "labels": ids}


def _trainer_ending(rank: int, world: int, out: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=out,
        max_steps=1,
        save_strategy="no",
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        ddp_backend="gloo",
    )
    tokenizer = hf_objects.fast_tokenizer()
    final = os.path.join(out, "final")
    with safeio.patch_save_pretrained(timeout=PATIENT):
        trainer = Trainer(
            model=hf_objects.tiny_model(), args=args, train_dataset=_Tiny(), processing_class=tokenizer
        )
        trainer.train()
        trainer.save_model(final)  # rank-0-guarded inside: config, generation config, weights, tokenizer
        _hold_for_early_peers(rank)
        tokenizer.save_pretrained(final)  # unguarded: every rank, as the example scripts end
        seen = _check_returned(rank, final)
    AutoModelForCausalLM.from_pretrained(final)
    return seen


def test_trainer_save_model_then_every_rank_tokenizer_save(shared_dir: Path) -> None:
    results = run_ranks(_trainer_ending, 2, str(shared_dir / "run"), timeout=RUN)
    _assert_every_rank_saw_its_save(results)


def _accelerate_loop(rank: int, world: int, out: str) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    accelerator = Accelerator(cpu=True)
    model = hf_objects.tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    tokenizer = hf_objects.fast_tokenizer()
    seen: dict[str, Any] = {}
    with safeio.patch_save_pretrained(timeout=PATIENT):
        for step in range(2):
            checkpoint = os.path.join(out, f"step_{step}")
            accelerator.save_state(checkpoint)
            if accelerator.is_main_process:  # what the examples guard
                accelerator.unwrap_model(model).config.save_pretrained(checkpoint)
            tokenizer.save_pretrained(checkpoint)  # and what they do not
            seen[f"step_{step}"] = _check_returned(rank, checkpoint, f"step{step}")
        # The standard final save of accelerate's examples.
        accelerator.wait_for_everyone()
        final = os.path.join(out, "final")
        accelerator.unwrap_model(model).save_pretrained(
            final, is_main_process=accelerator.is_main_process, save_function=accelerator.save
        )
        _hold_for_early_peers(rank, "final")
        tokenizer.save_pretrained(final)
        seen["final"] = _check_returned(rank, final, "final")
    accelerator.wait_for_everyone()
    AutoModelForCausalLM.from_pretrained(final)
    return seen


def test_accelerate_save_state_loops_and_final_save(shared_dir: Path) -> None:
    results = run_ranks(_accelerate_loop, 4, str(shared_dir / "run"), timeout=RUN)
    for r in results:
        for where, seen in r.value.items():
            assert seen["present"] == list(TOKENIZER_FILES), (r.rank, where, seen)
            assert seen["loaded"] is True, (r.rank, where, seen)


def test_the_manifest_remembers_the_recent_saves_it_holds(shared_dir: Path) -> None:
    """A peer whose store has gone finds its save in the manifest although later saves came after it."""
    import json

    from safeio._storage.manifest import CALLS_RECORDED, MANIFEST_NAME

    target = shared_dir / "out"
    for i in range(CALLS_RECORDED + 5):
        with safeio.replicated(target, mode="merge") as stage:
            Path(stage.path, f"f{i % 3}").write_text(str(i))
    record = json.loads((target / MANIFEST_NAME).read_text())
    assert len(record["calls"]) == CALLS_RECORDED
    assert record["calls"][-1]["call"] == record["call"]
    assert len({c["call"] for c in record["calls"]}) == CALLS_RECORDED
