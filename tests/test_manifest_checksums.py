"""Manifest checksums: format 2 records xxh3_128, format 1 (sha256) is still read and checked.

``fixtures/manifest-format-1/tokenizer`` is a directory a durable ``safeio.replicated`` save of the
code before format 2 promoted (commit a8c39e9), its manifest as that code wrote it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import xxhash

import safeio
from safeio._storage import manifest
from safeio._storage.metadata import Damaged
from safeio.cli import main
from safeio.testing.nfslike import Mount


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
    code = main([*args, "--json"])
    return code, json.loads(capsys.readouterr().out)


FORMAT_1 = Path(__file__).parent / "fixtures" / "manifest-format-1" / "tokenizer"


def format_1_copy(tmp_path: Path) -> Path:
    target = tmp_path / "tokenizer"
    shutil.copytree(FORMAT_1, target)
    return target


def save(target: Path, files: dict[str, bytes], **options: object) -> None:
    with safeio.replicated(target, **options) as stage:  # type: ignore[arg-type]
        for rel, data in files.items():
            Path(stage.path, rel).parent.mkdir(parents=True, exist_ok=True)
            Path(stage.path, rel).write_bytes(data)


def entries(target: Path) -> dict[str, dict[str, object]]:
    files: dict[str, dict[str, object]] = json.loads((target / manifest.MANIFEST_NAME).read_bytes())["files"]
    return files


def flip_one_byte(path: Path) -> None:
    """Same size, other bytes: only a checksum sees it."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_durable_save_records_xxh3_128_in_a_format_2_manifest(tmp_path: Path) -> None:
    files = {"tokenizer.json": b'{"vocab": [1, 2, 3]}', "sub/config.json": b"{}", "empty": b""}
    save(tmp_path / "t", files, durable=True)
    record = json.loads((tmp_path / "t" / manifest.MANIFEST_NAME).read_bytes())
    assert record["format"] == 2
    assert record["files"] == {
        rel: {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()} for rel, data in files.items()
    }
    assert safeio.verify(tmp_path / "t") == []


def test_the_old_sha256_manifest_is_verified_and_its_damage_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = format_1_copy(tmp_path)
    record = json.loads((target / manifest.MANIFEST_NAME).read_bytes())
    assert record["format"] == 1 and all(set(e) == {"size", "sha256"} for e in record["files"].values())
    code, report = run_json(capsys, "verify", str(target))
    assert code == 0 and report["checksums"] == ["sha256"] and report["files"] == 3

    flip_one_byte(target / "sub" / "special_tokens_map.json")
    assert safeio.verify(target) == ["sha256 mismatch: sub/special_tokens_map.json"]
    assert safeio.verify(target, check_hashes=False) == []  # the size alone cannot tell


def test_a_changed_file_is_found_by_its_xxh3_128(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "t"
    save(target, {"tokenizer.json": b'{"vocab": [1, 2, 3]}' * 100}, durable=True)
    code, report = run_json(capsys, "verify", str(target))
    assert code == 0 and report["checksums"] == ["xxh3_128"]
    flip_one_byte(target / "tokenizer.json")
    assert safeio.verify(target) == ["xxh3_128 mismatch: tokenizer.json"]


def test_a_merge_into_an_old_directory_keeps_its_sha256_entries_and_checks_both(tmp_path: Path) -> None:
    target = format_1_copy(tmp_path)
    save(target, {"added_tokens.json": b'{"<x>": 7}'}, mode="merge", durable=True)
    found = entries(target)
    assert set(found["tokenizer.json"]) == {"size", "sha256"}  # not re-read: another save's file
    assert set(found["added_tokens.json"]) == {"size", "xxh3_128"}
    assert safeio.verify(target) == []
    flip_one_byte(target / "tokenizer.json")
    flip_one_byte(target / "added_tokens.json")
    assert safeio.verify(target) == [
        "xxh3_128 mismatch: added_tokens.json",
        "sha256 mismatch: tokenizer.json",
    ]


@pytest.mark.parametrize(
    ("digest", "value"),
    [
        ("xxh3_128", "0" * 31),  # too short
        ("xxh3_128", "0" * 64),  # a sha256's length
        ("xxh3_128", "A" * 32),  # not lowercase hex
        ("xxh3_128", 12345),
        ("xxh3_128", None),
        ("sha256", "g" * 64),
        ("sha256", "0" * 32),
    ],
)
def test_a_crafted_checksum_makes_the_manifest_damaged(tmp_path: Path, digest: str, value: object) -> None:
    target = tmp_path / "t"
    save(target, {"a": b"1"}, durable=True)
    path = target / manifest.MANIFEST_NAME
    record = json.loads(path.read_bytes())
    record["files"]["a"] = {"size": 1, digest: value}
    path.write_text(json.dumps(record))
    damaged = manifest.load(str(target))
    assert (
        isinstance(damaged, Damaged)
        and damaged.reason == f"the manifest entry of 'a' has an invalid {digest}"
    )
    # never complete (replaced by the next save), and its file is never read on its word
    assert not safeio.is_complete(target)
    assert safeio.verify(target) == [f"no readable {manifest.MANIFEST_NAME} in {target}"]


def test_sha256_of_the_old_manifest_is_what_hashlib_computes(tmp_path: Path) -> None:
    # The fixture is what the old code wrote, not a hand-made imitation: its digests are the files'.
    for rel, entry in entries(FORMAT_1).items():
        assert entry["sha256"] == hashlib.sha256((FORMAT_1 / rel).read_bytes()).hexdigest()


def test_a_durable_save_opens_each_staged_file_once_after_its_body(nfslike_mount: Mount) -> None:
    """Checksum and fsync share one open and one read per file (they were two opens); the fsyncs are
    the files', the manifest's, the stage's and the parent's after the rename, each once."""
    files = {
        "tokenizer.json": os.urandom(300_000),
        "tokenizer_config.json": b"{}",
        "sub/vocab.txt": b"a\nb\n",
    }
    with safeio.replicated(nfslike_mount.path / "tok", durable=True) as stage:
        for rel, data in files.items():
            Path(stage.path, rel).parent.mkdir(parents=True, exist_ok=True)
            Path(stage.path, rel).write_bytes(data)
        nfslike_mount.reset_ops()  # what the body did is not safeio's
    counts = nfslike_mount.ops().of(os.getpid())
    assert counts.get("open_read", 0) == len(files), counts
    assert counts.get("fsync", 0) == len(files) + 1, counts  # + the manifest
    # the subdirectory, the stage (its entries and the manifest's), the parent (the rename)
    assert counts.get("fsyncdir", 0) == 3, counts
    assert safeio.verify(nfslike_mount.path / "tok") == []


def test_a_durable_merge_records_its_intent_in_the_manifest_one_fsync_fewer(nfslike_mount: Mount) -> None:
    """A merge into an existing directory fsyncs each file, the manifest (which carries the merge's intent:
    there is no intent file to create, fsync and remove), the stage and the target, each once."""
    target = nfslike_mount.path / "checkpoint-1"
    target.mkdir()
    (target / "config.json").write_text("{}")  # the model's file, saved first (the Trainer's order)
    files = {"tokenizer.json": os.urandom(300_000), "tokenizer_config.json": b"{}"}
    with safeio.replicated(target, mode="merge", durable=True) as stage:
        for rel, data in files.items():
            Path(stage.path, rel).write_bytes(data)
        nfslike_mount.reset_ops()
    counts = nfslike_mount.ops().of(os.getpid())
    assert counts.get("fsync", 0) == len(files) + 1, counts  # + the manifest (there were + 2: the intent)
    assert counts.get("fsyncdir", 0) == 2, counts  # the stage, the target
    assert counts.get("open_create", 0) == 2, counts  # the manifest and the lock's (and no intent)
    record = json.loads((target / manifest.MANIFEST_NAME).read_bytes())
    assert record[manifest.MERGE_INTENT_KEY] == {
        "target_name": "checkpoint-1",
        "files": [*sorted(files), manifest.MANIFEST_NAME],
    }
    assert safeio.verify(target) == [] and os.listdir(nfslike_mount.path) == ["checkpoint-1"]


def test_a_merge_without_a_manifest_still_writes_its_intent_file(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint-1"
    target.mkdir()
    (target / "config.json").write_text("{}")
    seen: list[bool] = []
    from safeio._promotion import merge

    original = merge.roll_forward

    def watching(stage_fd: int, *args: Any, **kwargs: Any) -> None:
        seen.append(os.path.exists(f"/proc/self/fd/{stage_fd}/{manifest.MERGE_INTENT_NAME}"))
        original(stage_fd, *args, **kwargs)

    merge.roll_forward = watching  # type: ignore[assignment]
    try:
        save(target, {"tokenizer.json": b"{}"}, mode="merge", manifest=False)
    finally:
        merge.roll_forward = original  # type: ignore[assignment]
    assert seen == [True]
    assert sorted(os.listdir(target)) == ["config.json", "tokenizer.json"]
    assert [n for n in os.listdir(tmp_path) if "stage" in n] == []


def test_a_manifest_nested_too_deep_is_damaged_and_brackets_in_strings_do_not_count(tmp_path: Path) -> None:
    # The depth bound is checked on the text before parsing (a crafted manifest must not reach the parser's
    # recursion limit); a save's recorded result may hold any string, brackets and escaped quotes included.
    target = tmp_path / "t"
    save(target, {"a.bin": b"x"})
    written = json.loads((target / manifest.MANIFEST_NAME).read_bytes())
    written["result"] = ['"[{' * 100 + '\\"', {"nested": [[["]]]]"]]]}]
    (target / manifest.MANIFEST_NAME).write_text(json.dumps(written))
    assert not isinstance(manifest.load(str(target)), Damaged)
    assert safeio.verify(target) == []

    written["result"] = json.loads("[" * 70 + "]" * 70)
    (target / manifest.MANIFEST_NAME).write_text(json.dumps(written))
    found = manifest.load(str(target))
    assert isinstance(found, Damaged) and "nests deeper than 64 levels" in found.reason, found
    (target / manifest.MANIFEST_NAME).write_bytes(b'{"files": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    found = manifest.load(str(target))
    assert isinstance(found, Damaged) and "nests deeper" in found.reason, found
