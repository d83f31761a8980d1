"""Offline stand-ins for the hub repositories transformers' own Trainer tests load, in a local hub cache.

transformers' ``tests/trainer/test_trainer_checkpointing.py`` (run by ``scripts/upstream_suites.py
--transformers-trainer``) loads a few processing classes by hub id. There is no hub here, so
``build_hub_cache(home)`` saves tiny ones built in code under those ids in the layout ``huggingface_hub``
reads (``<home>/hub/models--<org>--<name>/snapshots/<revision>``, ``refs/main``); run with
``HF_HOME=<home>`` and ``HF_HUB_OFFLINE=1`` (``hub_environment``), ``from_pretrained(id)`` finds them:

- ``bert-base-uncased``, ``google-bert/bert-base-uncased``: a word-piece BERT tokenizer (lower case,
  ``model_max_length`` 512, as the real one), with a tiny BERT configuration;
- ``facebook/wav2vec2-base-960h``: a ``Wav2Vec2FeatureExtractor`` with the real one's settings.

The repositories the tests reach only behind ``@slow``, ``@require_peft``, ``@require_torchvision``
(gpt2, a tiny Llama, CLIP) are not stood in for: those tests are skipped in both runs alike.
"""

from __future__ import annotations

import os

_REVISION = "0" * 40  # a commit hash's shape: huggingface_hub resolves refs/main to it
_WORDS = (
    "this is a test sentence the trainer saves its tokenizer with every checkpoint and loads it again "
    "on resume shared storage writer rank"
)


def hub_environment(home: str) -> dict[str, str]:
    """The variables that make transformers read the stand-ins and never try the network."""
    return {"HF_HOME": home, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def build_hub_cache(home: str) -> None:
    """Every stand-in, saved under ``home`` (``HF_HOME``)."""
    for repo in ("bert-base-uncased", "google-bert/bert-base-uncased"):
        _save(home, repo, _bert_tokenizer_files)
    _save(home, "facebook/wav2vec2-base-960h", _wav2vec2_feature_extractor_files)


def _save(home: str, repo: str, write: object) -> None:
    folder = os.path.join(home, "hub", "models--" + repo.replace("/", "--"))
    snapshot = os.path.join(folder, "snapshots", _REVISION)
    os.makedirs(snapshot, exist_ok=True)
    os.makedirs(os.path.join(folder, "refs"), exist_ok=True)
    with open(os.path.join(folder, "refs", "main"), "w", encoding="utf-8") as f:
        f.write(_REVISION)
    assert callable(write)
    write(snapshot)


def _bert_tokenizer_files(directory: str) -> None:
    from transformers import BertConfig, BertTokenizer

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(_WORDS.split()))]
    tokenizer = BertTokenizer(
        vocab={w: i for i, w in enumerate(words)}, do_lower_case=True, model_max_length=512
    )
    tokenizer.save_pretrained(directory)
    BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
    ).save_pretrained(directory)


def _wav2vec2_feature_extractor_files(directory: str) -> None:
    from transformers import Wav2Vec2FeatureExtractor

    Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True, return_attention_mask=False
    ).save_pretrained(directory)
