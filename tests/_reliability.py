"""Shared pieces of the reliability suite (tests/test_reliability_*.py).

- ``SCALE`` (``SAFEIO_RELIABILITY_SCALE``, default 1) multiplies iteration counts and durations; the
  default run meets the issue's minimums, ``scripts/reliability_report.py`` runs larger scales.
- ``SEED`` (``SAFEIO_RELIABILITY_SEED``) seeds every random choice; tests print it.
- ``record(name, data)`` writes a test's figures as JSON into ``SAFEIO_RELIABILITY_OUT`` when set.
- Two versions A and B of a tokenizer plus a tiny model that differ in *every* file, so that after a
  crash each file can be attributed to one version by its bytes.
"""

from __future__ import annotations

import json
import os
import tempfile
from functools import cache
from typing import Any

from safeio._storage import manifest

SCALE = float(os.environ.get("SAFEIO_RELIABILITY_SCALE", "1"))
SEED = int(os.environ.get("SAFEIO_RELIABILITY_SEED", "20261202"))
OUT_ENV = "SAFEIO_RELIABILITY_OUT"


def scaled(count: float) -> int:
    return max(1, round(count * SCALE))


def record(name: str, data: dict[str, Any]) -> None:
    """Write a test's figures where the report script collects them (nothing when not asked)."""
    out = os.environ.get(OUT_ENV)
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w", encoding="utf-8") as f:
        json.dump({"scale": SCALE, "seed": SEED, **data}, f, indent=2, sort_keys=True)


@cache
def objects(version: int) -> tuple[Any, Any]:
    """A tokenizer and a tiny model of ``version``: every file they save differs between versions."""
    from transformers.utils import logging as hf_logging

    from safeio.testing import hf_objects

    hf_logging.disable_progress_bar()  # noise, and a lock shared with forked children (see below)
    tok = hf_objects.fast_tokenizer(version)
    tok.model_max_length = 1000 + version  # tokenizer_config.json would be identical otherwise
    model = hf_objects.tiny_model(seed=version)
    # Same architecture, so config.json and generation_config.json would be identical without these.
    model.config.reliability_version = version
    model.generation_config.max_new_tokens = 10 + version
    return tok, model


def in_forked_child() -> None:
    """Call first in a forked child that may be killed: tqdm's progress bars (model saves) take a
    multiprocessing lock shared across fork; a child killed holding it would hang this process."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def write_version(version: int, directory: str) -> None:
    """What the writer's body does: the tokenizer and the model saved side by side."""
    tok, model = objects(version)
    tok.save_pretrained(directory)
    model.save_pretrained(directory)


def read_files(directory: str) -> dict[str, bytes]:
    """Every content file under ``directory`` (safeio's bookkeeping excluded), by relative path."""
    found: dict[str, bytes] = {}
    for rel in manifest.content_files(directory):
        with open(os.path.join(directory, *rel.split("/")), "rb") as f:
            found[rel] = f.read()
    return found


@cache
def expected_files(version: int) -> dict[str, bytes]:
    directory = tempfile.mkdtemp(prefix="safeio-reliability-expected-")
    write_version(version, directory)
    files = read_files(directory)
    import shutil

    shutil.rmtree(directory)
    return files


def check_all_differ() -> None:
    """The premise of "every file belongs to one version": A and B share no file's bytes."""
    a, b = expected_files(1), expected_files(2)
    assert set(a) == set(b), (sorted(a), sorted(b))
    same = [rel for rel in a if a[rel] == b[rel]]
    assert not same, f"versions 1 and 2 must differ in every file; identical: {same}"


def version_of_each_file(directory: str) -> dict[str, int | None]:
    """For each content file, the version whose bytes it has (None: neither — a torn file)."""
    a, b = expected_files(1), expected_files(2)
    out: dict[str, int | None] = {}
    for rel, data in read_files(directory).items():
        out[rel] = 1 if a.get(rel) == data else 2 if b.get(rel) == data else None
    return out


def whole_version(directory: str) -> int | None:
    """The version ``directory`` holds completely (every file, no extra), else None."""
    versions = version_of_each_file(directory)
    if set(versions) != set(expected_files(1)):
        return None
    found = set(versions.values())
    return found.pop() if len(found) == 1 and None not in found else None
