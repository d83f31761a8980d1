"""safeio.save_pretrained and patch_save_pretrained with real transformers objects (built offline)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

import safeio
from safeio.testing import hf_objects
from safeio.testing.ranks import run_ranks
from tests._bounds import PATIENT, RUN
from tests.test_ranks import _watch_writes

pytest.importorskip("transformers")


def test_fast_tokenizer_round_trip_and_return_value(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = hf_objects.fast_tokenizer()
    target = tmp_path / "ckpt" / "tokenizer"
    paths = safeio.save_pretrained(tok, target)
    assert isinstance(paths, tuple)
    assert sorted(os.path.basename(p) for p in paths) == [
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert all(p.startswith(str(target) + "/") and os.path.exists(p) for p in paths)
    loaded = AutoTokenizer.from_pretrained(target)
    assert loaded("hello world shared")["input_ids"] == tok("hello world shared")["input_ids"]
    assert loaded.all_special_tokens == tok.all_special_tokens
    assert loaded.chat_template == tok.chat_template
    assert safeio.verify(target) == []


def test_slow_tokenizer_round_trip(tmp_path: Path) -> None:
    from transformers import BertGenerationTokenizer

    tok = hf_objects.slow_tokenizer(str(tmp_path))
    target = tmp_path / "slow"
    safeio.save_pretrained(tok, target)
    assert (target / "spiece.model").exists()
    loaded = BertGenerationTokenizer.from_pretrained(target)
    assert loaded.tokenize("hello shared world") == tok.tokenize("hello shared world")


@pytest.mark.parametrize(
    "kind", ["image_processor", "feature_extractor", "config", "generation_config", "processor"]
)
def test_configs_and_processors_round_trip(tmp_path: Path, kind: str) -> None:
    obj = getattr(hf_objects, kind)()
    target = tmp_path / kind
    safeio.save_pretrained(obj, target)
    loaded = type(obj).from_pretrained(target)
    if kind == "processor":
        assert loaded.tokenizer("hello world")["input_ids"] == obj.tokenizer("hello world")["input_ids"]
        assert loaded.image_processor.to_dict() == obj.image_processor.to_dict()
    else:
        assert loaded.to_dict() == obj.to_dict()
    assert safeio.is_complete(target)


def test_model_round_trip(tmp_path: Path) -> None:
    import torch

    model = hf_objects.tiny_model()
    target = tmp_path / "model"
    safeio.save_pretrained(model, target)
    loaded = type(model).from_pretrained(target)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # safetensors writes weights 0600 through mkstemp; promoted files get the umask's mode.
    assert os.stat(target / "model.safetensors").st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_tokenizer_into_a_model_directory_keeps_the_model(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint-1"
    safeio.save_pretrained(hf_objects.tiny_model(), target)
    before = sorted(os.listdir(target))
    safeio.save_pretrained(hf_objects.fast_tokenizer(), target)  # default mode: merge
    after = sorted(os.listdir(target))
    assert set(before) <= set(after) and "tokenizer.json" in after
    assert type(hf_objects.tiny_model()).from_pretrained(target) is not None
    assert safeio.verify(target) == []  # the manifest lists the model's files and the tokenizer's


def test_sharded_replace_leaves_no_stale_weights_but_merge_would(tmp_path: Path) -> None:
    model = hf_objects.tiny_model()
    merged, replaced = tmp_path / "merged", tmp_path / "replaced"
    for target in (merged, replaced):
        safeio.save_pretrained(model, target)
        assert (target / "model.safetensors").exists()
    safeio.save_pretrained(model, merged, max_shard_size="20KB")
    safeio.save_pretrained(model, replaced, max_shard_size="20KB", mode="replace")
    # merge keeps files it did not write: the old unsharded weights survive beside the shards, and
    # from_pretrained would silently load them (FINDINGS.md). replace swaps the whole directory.
    assert (merged / "model.safetensors").exists() and (merged / "model.safetensors.index.json").exists()
    assert (
        not (replaced / "model.safetensors").exists() and (replaced / "model.safetensors.index.json").exists()
    )


def test_memory_url_target() -> None:
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    MemoryFileSystem.store.clear()
    paths = safeio.save_pretrained(hf_objects.fast_tokenizer(), "memory://bucket/tok")
    assert all(p.startswith("memory://bucket/tok/") for p in paths)
    assert safeio.is_complete("memory://bucket/tok")
    assert fsspec.filesystem("memory").cat_file("/bucket/tok/tokenizer.json")
    assert not os.path.exists("memory:")  # plain save_pretrained would have made a local folder


def test_unknown_kwargs_pass_through(tmp_path: Path) -> None:
    paths = safeio.save_pretrained(hf_objects.fast_tokenizer(), tmp_path / "t", filename_prefix="pre")
    assert any(os.path.basename(p).startswith("pre-") for p in paths)
    assert any(n.startswith("pre-") for n in os.listdir(tmp_path / "t"))


def test_bad_input_single_process(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("keep")
    with pytest.raises(safeio.InvalidTargetError, match="not a directory"):
        safeio.save_pretrained(hf_objects.config(), tmp_path / "afile")
    assert (tmp_path / "afile").read_text() == "keep"
    with pytest.raises(safeio.UnsupportedSaveError, match="no save_pretrained"):
        safeio.save_pretrained(object(), tmp_path / "x")
    with pytest.raises(safeio.UnsupportedSaveError, match="push_to_hub"):
        safeio.save_pretrained(hf_objects.config(), tmp_path / "x", push_to_hub=True)
    assert sorted(os.listdir(tmp_path)) == ["afile"]


# -- real ranks ------------------------------------------------------------------------------------


def _all_ranks_save(rank: int, world: int, target: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = hf_objects.fast_tokenizer()
    writes = _watch_writes(os.path.dirname(target))
    paths = safeio.save_pretrained(tok, target, timeout=PATIENT)
    loaded = AutoTokenizer.from_pretrained(target)
    return {"paths": paths, "writes": list(writes), "ids": loaded("hello world")["input_ids"]}


@pytest.mark.parametrize("world", [4, 8])
def test_every_rank_saves_one_writes(shared_dir: Path, world: int) -> None:
    target = str(shared_dir / "ckpt" / "tokenizer")
    results = run_ranks(_all_ranks_save, world, target)
    assert results[0].value["writes"]
    for r in results[1:]:
        assert r.value["writes"] == []  # non-writers never write under the target's parent
        assert r.value["paths"] == results[0].value["paths"]  # the same return value everywhere
        assert r.value["ids"] == results[0].value["ids"]


def _fake_rank(rank: int, port: int, target: str) -> Any:
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=PATIENT))
    tok = hf_objects.fast_tokenizer()
    calls: list[str] = []
    real = tok.save_pretrained

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append("save")
        return real(*args, **kwargs)

    tok.save_pretrained = counting
    store.add("entered", 1)
    paths = _group_save(tok, target, safeio.Group(rank, 32, store=store))
    return {"calls": calls, "paths": paths}


def _group_save(tok: Any, target: str, group: safeio.Group) -> Any:
    # Every "rank" saves from this one line, as real ranks running one program do: a save is known
    # across ranks by the object's type and the line that makes it.
    return safeio.save_pretrained(tok, target, group=group, timeout=PATIENT)


def test_large_world_fake_group(shared_dir: Path) -> None:
    """Ranks 1, 7 and 31 of a 32-rank group (a real TCPStore, a fake group): skip the write, still wait."""
    import multiprocessing as mp
    from datetime import timedelta

    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=PATIENT))
    target = str(shared_dir / "tok")
    ctx = mp.get_context("forkserver")
    with ctx.Pool(3) as pool:
        pending = [pool.apply_async(_fake_rank, (r, master.port, target)) for r in (1, 7, 31)]
        master.wait(["entered"], timedelta(seconds=PATIENT))
        while int(master.add("entered", 0)) < 3:
            master.wait(["entered"], timedelta(seconds=1))
        assert not any(p.ready() for p in pending)  # they are waiting for the writer
        paths = _group_save(hf_objects.fast_tokenizer(), target, safeio.Group(0, 32, store=master))
        results = [p.get(timeout=PATIENT) for p in pending]
    for result in results:
        assert result["calls"] == []
        assert result["paths"] == paths


def _patched_all_ranks(rank: int, world: int, target: str) -> int:
    tok = hf_objects.fast_tokenizer()
    with safeio.patch_save_pretrained(timeout=PATIENT):
        tok.save_pretrained(target)  # unmodified code, as in the hang
        hf_objects.processor().save_pretrained(target)  # nested: the processor saves its tokenizer
    return len(os.listdir(target))


def test_patch_every_rank_calls(shared_dir: Path) -> None:
    target = str(shared_dir / "tok")
    results = run_ranks(_patched_all_ranks, 4, target)
    assert len({r.value for r in results}) == 1
    assert "processor_config.json" in os.listdir(target)
    assert [n for n in os.listdir(shared_dir) if ".safeio-" in n and not n.endswith(".lock")] == []


def _patched_rank0_only(rank: int, world: int, target: str) -> float:
    import torch.distributed as dist

    took = 0.0
    with safeio.patch_save_pretrained(timeout=120):
        if rank == 0:  # accelerate's is_main_process guard
            start = time.monotonic()
            hf_objects.fast_tokenizer().save_pretrained(target)
            took = time.monotonic() - start
    dist.barrier()
    return took


def test_patch_rank0_only_returns_promptly(shared_dir: Path) -> None:
    target = str(shared_dir / "tok")
    results = run_ranks(_patched_rank0_only, 4, target, timeout=RUN)
    # A patch that waited for peers would wait out its 120 s timeout and fail the run (PeerTimeout).
    assert results[0].value < 100
    assert safeio.is_complete(target)


def test_patch_install_uninstall_restores_exactly() -> None:
    import transformers
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

    classes = [
        transformers.PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
        PretrainedConfig,
        PreTrainedModel,
    ]
    before = {c: c.__dict__.get("save_pretrained") for c in classes}
    hooks = {c: c.__dict__.get("__init_subclass__") for c in classes}
    patch = safeio.patch_save_pretrained().install()
    assert patch.install() is patch  # idempotent
    assert PreTrainedTokenizerFast.__dict__["save_pretrained"] is not before[PreTrainedTokenizerFast]
    assert PreTrainedModel.__dict__["save_pretrained"] is before[PreTrainedModel]  # never wraps models
    with safeio.patch_save_pretrained(include_models=True):  # nested, with models
        assert PreTrainedModel.__dict__["save_pretrained"] is not before[PreTrainedModel]
    assert PreTrainedModel.__dict__["save_pretrained"] is before[PreTrainedModel]
    patch.uninstall()
    patch.uninstall()
    assert {c: c.__dict__.get("save_pretrained") for c in classes} == before
    assert {c: c.__dict__.get("__init_subclass__") for c in classes} == hooks


def test_patch_covers_classes_defined_while_active(tmp_path: Path) -> None:
    from transformers import PretrainedConfig

    with safeio.patch_save_pretrained():

        class LateConfig(PretrainedConfig):
            model_type = "late"

            def save_pretrained(self, save_directory: Any, **kwargs: Any) -> Any:
                return super().save_pretrained(save_directory, **kwargs)

        LateConfig(x=1).save_pretrained(tmp_path / "late")
        assert hasattr(LateConfig.__dict__["save_pretrained"], "__safeio_original__")
    assert safeio.is_complete(tmp_path / "late")
    assert not hasattr(LateConfig.__dict__["save_pretrained"], "__safeio_original__")


def _bad_input_ranks(rank: int, world: int, shared: str) -> list[str]:
    import torch.distributed as dist

    if rank == 0:
        Path(shared, "afile").write_text("keep")
    dist.barrier()
    out = []
    for call in (
        lambda: safeio.save_pretrained(hf_objects.config(), os.path.join(shared, "afile"), timeout=PATIENT),
        lambda: safeio.save_pretrained(hf_objects.config(), os.path.join(shared, "x"), push_to_hub=True),
        lambda: safeio.save_pretrained(object(), os.path.join(shared, "y"), timeout=PATIENT),
    ):
        try:
            call()
        except safeio.SafeIOError as exc:
            out.append(type(exc).__name__)
    dist.barrier()  # rank 0 hosts the store: stay until every peer has read the published failures
    return out


def test_bad_input_on_every_rank(shared_dir: Path) -> None:
    results = run_ranks(_bad_input_ranks, 4, str(shared_dir))
    assert results[0].value == ["InvalidTargetError", "UnsupportedSaveError", "UnsupportedSaveError"]
    for r in results[1:]:
        assert r.value == ["RemoteWriterError", "UnsupportedSaveError", "UnsupportedSaveError"]
    assert sorted(os.listdir(shared_dir)) == [".afile.safeio.lock", "afile"] or sorted(
        os.listdir(shared_dir)
    ) == ["afile"]


def _model_every_rank(rank: int, world: int, target: str) -> list[str]:
    model = hf_objects.tiny_model(seed=rank)  # different weights per rank: only the writer's must land
    safeio.save_pretrained(model, target, timeout=PATIENT)
    return sorted(os.listdir(target))


def test_model_saved_on_every_rank_only_writer_promoted(shared_dir: Path) -> None:
    import torch

    target = str(shared_dir / "model")
    run_ranks(_model_every_rank, 2, target)
    loaded = type(hf_objects.tiny_model()).from_pretrained(target)
    expected = hf_objects.tiny_model(seed=0)
    for (name, a), (_, b) in zip(expected.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def _trainer_run(rank: int, world: int, output_dir: str) -> list[str]:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=2,
        save_steps=1,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_only_model=True,
        ddp_backend="gloo",
    )
    with safeio.patch_save_pretrained(timeout=PATIENT):
        trainer = Trainer(
            model=hf_objects.tiny_model(),
            args=args,
            train_dataset=hf_objects.tiny_lm_dataset(),
            processing_class=hf_objects.fast_tokenizer(),
        )
        trainer.train()
    return sorted(os.listdir(output_dir))


def test_trainer_with_the_patch_leaves_loadable_checkpoints(shared_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    output = str(shared_dir / "run")
    results = run_ranks(_trainer_run, 2, output, timeout=RUN)
    assert results[0].value == results[1].value
    assert {"checkpoint-1", "checkpoint-2"} <= set(results[0].value)
    for step in (1, 2):
        checkpoint = Path(output, f"checkpoint-{step}")
        AutoTokenizer.from_pretrained(checkpoint)("hello world")
        AutoModelForCausalLM.from_pretrained(checkpoint)
        assert (checkpoint / "model.safetensors").exists()  # the model was saved beside the tokenizer
        assert (checkpoint / ".safeio-manifest.json").exists()  # and the tokenizer went through safeio
    assert [n for n in os.listdir(output) if ".safeio-" in n and not n.endswith(".lock")] == []
