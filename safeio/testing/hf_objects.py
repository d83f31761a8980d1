"""Small Hugging Face objects built in code (no model hub is needed): for tests, demos and benchmarks."""

from __future__ import annotations

import io
import os
import tempfile
from typing import Any

TEXTS = ["hello world", "shared nfs checkpoint race", "one writer atomic rename", "every rank waits"]


def fast_tokenizer(version: int = 1, words: int = 0) -> Any:
    """A word-level fast tokenizer; ``version`` changes its vocabulary and chat template.

    ``words`` adds that many generated words: 40,000 make a ``tokenizer.json`` of about 1 MB, the size
    of real ones, which keeps files open long enough for the NFS interlock to show.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    extra = [f"version{version} word{i}" for i in range(version * 3)]
    generated = [f"word{i:05d}" for i in range(words)]
    extra += [" ".join(generated[i : i + 1000]) for i in range(0, words, 1000)]
    tk.train_from_iterator(
        TEXTS + extra,
        trainers.WordLevelTrainer(vocab_size=words + 1000, special_tokens=["<unk>", "<pad>", "<s>", "</s>"]),
    )
    make: Any = PreTrainedTokenizerFast  # transformers' constructors are untyped
    return make(
        tokenizer_object=tk,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=f"{{{{ messages }}}} v{version}",
    )


def slow_tokenizer(workdir: str | None = None) -> Any:
    """A sentencepiece (slow) tokenizer; its ``spiece.model`` lives in ``workdir``."""
    import sentencepiece as spm
    from transformers import BertGenerationTokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS * 20),
        model_writer=model,
        vocab_size=40,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    directory = workdir or tempfile.mkdtemp(prefix="safeio-spm-")
    path = os.path.join(directory, "spiece.model")
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return BertGenerationTokenizer(vocab_file=path)


def image_processor() -> Any:
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8})


def processor() -> Any:
    from transformers import CLIPProcessor

    make: Any = CLIPProcessor  # transformers' constructors are untyped
    return make(image_processor=image_processor(), tokenizer=fast_tokenizer())


def feature_extractor() -> Any:
    from transformers import Wav2Vec2FeatureExtractor

    make: Any = Wav2Vec2FeatureExtractor
    return make(feature_size=1, sampling_rate=16000, padding_value=0.0)


def config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def generation_config() -> Any:
    from transformers import GenerationConfig

    make: Any = GenerationConfig
    return make(max_new_tokens=7, do_sample=False)


def tiny_model(seed: int = 0) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(config())


def tiny_lm_dataset(size: int = 8, length: int = 8) -> Any:
    """A torch Dataset of ``size`` token sequences (``input_ids`` = ``labels``) for ``tiny_model`` and a
    Trainer."""
    import torch

    class TinyLM(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return size

        def __getitem__(self, i: int) -> dict[str, Any]:
            ids = torch.tensor([(i + j) % 60 + 4 for j in range(length)])
            return {"input_ids": ids, "labels": ids}

    return TinyLM()
