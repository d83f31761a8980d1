"""Runs accelerate's own checkpoint program, as installed, offline: ``python _offline_accelerate.py ARGS``.

The program is ``accelerate/test_utils/scripts/external_deps/test_checkpointing.py`` from the installed
wheel (GLUE MRPC and bert-base-cased from the hub; ``accelerator.save_state(output_dir/epoch_<N>)`` each
epoch; ``--resume_from_checkpoint`` loads one and asserts that the accuracy and learning rates match the
``state_<N>.json`` saved beside it). It runs unmodified from site-packages; there is no hub here, so this
runner first stands in for what it fetches, with the same calls and columns:

- ``datasets.load_dataset("nyu-mll/glue", "mrpc")``: a small synthetic ``DatasetDict`` (idx, sentence1,
  sentence2, label);
- ``evaluate.load("glue", "mrpc")``: a local metric with ``add_batch``/``compute`` (accuracy, F1);
- the model: ``build_model(dir)`` saves a tiny BERT and a word-level tokenizer built in code to a local
  directory, passed as ``--model_name_or_path``.

It also says, on each rank, when the program calls ``accelerator.end_training()`` (``ENDING``) and when
the program has returned (``RETURNED``; a resume returns before calling end_training); it changes
nothing the program does. After either, only torch's teardown is left: end_training destroys the process
group, then the training function returns and frees the DDP model that still holds it, and that is where
gloo's teardown race hangs (docs/troubleshooting.md, "A job that does not exit"); no checkpoint work is
left there.
"""

from __future__ import annotations

import importlib.util
import os
import random
import runpy
import sys
from typing import Any

PROGRAM = "accelerate.test_utils.scripts.external_deps.test_checkpointing"
ENDING = "[runner] end_training() called on rank"
RETURNED = "[runner] the program returned on rank"
_WORDS = "the a model saves its checkpoint on shared storage every rank waits for one writer to commit"


def program_path() -> str:
    """Where the installed wheel keeps the program."""
    spec = importlib.util.find_spec(PROGRAM)
    assert spec is not None and spec.origin is not None, f"{PROGRAM} is not installed"
    return spec.origin


def build_model(directory: str) -> None:
    """A tiny ``BertForSequenceClassification`` and its word-level tokenizer, saved to ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[UNK]", "[PAD]", "[CLS]", "[SEP]"]
    tk.train_from_iterator([_WORDS], trainers.WordLevelTrainer(special_tokens=specials))
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tk.token_to_id("[CLS]")), ("[SEP]", tk.token_to_id("[SEP]"))],
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        model_max_length=64,
    )
    config = BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
        num_labels=2,
    )
    BertForSequenceClassification(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _mrpc(train_rows: int = 64, validation_rows: int = 32) -> Any:
    """GLUE MRPC's columns with synthetic sentences: a pair is a paraphrase when it has the same words."""
    from datasets import Dataset, DatasetDict

    rng = random.Random(0)

    def split(rows: int) -> Any:
        columns: dict[str, list[Any]] = {"idx": [], "sentence1": [], "sentence2": [], "label": []}
        for i in range(rows):
            first = rng.sample(_WORDS.split(), 6)
            label = i % 2
            second = list(first) if label else rng.sample(_WORDS.split(), 6)
            rng.shuffle(second)
            columns["idx"].append(i)
            columns["sentence1"].append(" ".join(first))
            columns["sentence2"].append(" ".join(second))
            columns["label"].append(label)
        return Dataset.from_dict(columns)

    return DatasetDict(train=split(train_rows), validation=split(validation_rows))


class _Metric:
    """What the program uses of evaluate's glue/mrpc metric: ``add_batch`` and ``compute``."""

    def __init__(self) -> None:
        self.pairs: list[tuple[int, int]] = []

    def add_batch(self, *, predictions: Any, references: Any) -> None:
        self.pairs += [(int(p), int(r)) for p, r in zip(predictions, references, strict=True)]

    def compute(self) -> dict[str, float]:
        pairs, self.pairs = self.pairs, []
        tp = sum(1 for p, r in pairs if p == r == 1)
        predicted, actual = sum(p for p, _ in pairs), sum(r for _, r in pairs)
        return {
            "accuracy": sum(p == r for p, r in pairs) / max(len(pairs), 1),
            "f1": 2 * tp / (predicted + actual) if predicted + actual else 0.0,
        }


def _load_dataset(path: str, name: str | None = None, **_: Any) -> Any:
    assert (path, name) == ("nyu-mll/glue", "mrpc"), f"offline: no dataset {path} {name}"
    return _mrpc()


def _load_metric(path: str, config_name: str | None = None, **_: Any) -> _Metric:
    assert (path, config_name) == ("glue", "mrpc"), f"offline: no metric {path} {config_name}"
    return _Metric()


def main() -> None:
    import datasets
    import evaluate

    # The program does `from datasets import load_dataset` and `evaluate.load(...)` when it runs: both
    # find these.
    datasets.load_dataset = _load_dataset
    evaluate.load = _load_metric
    _announce_end_training()
    script = program_path()
    sys.argv = [script, *sys.argv[1:]]
    runpy.run_path(script, run_name="__main__")
    print(f"{RETURNED} {os.environ.get('RANK', '0')}", flush=True)


def _announce_end_training() -> None:
    from accelerate import Accelerator

    end_training = Accelerator.end_training

    def announced(self: Any) -> None:
        print(f"{ENDING} {os.environ.get('RANK', '0')}", flush=True)
        end_training(self)

    Accelerator.end_training = announced  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
