"""What ``safeio ls``/``verify`` judge without trusting it (issue 34): accelerate's archives from their last
64 KiB, JSON within a memory bound. The hostile cases (``tests/_hostile_cases_round3.py``) plant the bombs;
these pin the judgements themselves on real data: a real archive cut anywhere is never whole, a real
Trainer's state of 100,000 log entries still parses."""

from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path

import pytest

from safeio._storage.metadata import PARSE_BUDGET, Damaged, parse_json
from safeio.integrations._accelerate_files import archive_is_whole


def _whole(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        return archive_is_whole(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _torch_archive() -> bytes:
    torch = pytest.importorskip("torch")
    buffer = io.BytesIO()
    torch.save({"rng": torch.zeros(4, dtype=torch.uint8), "step": 3, "names": ["a"] * 10}, buffer)
    return buffer.getvalue()


def test_a_torch_archive_is_whole_and_every_cut_of_it_is_not(tmp_path: Path) -> None:
    data = _torch_archive()
    path = tmp_path / "random_states_0.pkl"
    path.write_bytes(data)
    assert _whole(path)
    # A rank killed at any byte of its end records, or anywhere before them.
    cuts = set(range(max(0, len(data) - 256), len(data))) | set(range(0, len(data), max(1, len(data) // 64)))
    for size in sorted(cuts):
        path.write_bytes(data[:size])
        assert not _whole(path), size


def test_plain_zips_with_and_without_a_comment_are_whole(tmp_path: Path) -> None:
    for comment in (b"", b"PK\x05\x06 looks like an end record"):
        path = tmp_path / "plain.zip"
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("x", "y" * 1000)
            archive.comment = comment
        assert _whole(path), comment
        path.write_bytes(path.read_bytes() + b"trailing")
        assert not _whole(path), comment


def test_a_trainer_state_of_100000_log_entries_parses_and_nested_lists_do_not() -> None:
    entries = [
        {"epoch": i / 1000.123, "grad_norm": 1.234567 + i, "learning_rate": 5e-05, "loss": 2.3 + i, "step": i}
        for i in range(100_000)
    ]
    state = (
        json.dumps({"global_step": 100_000, "log_history": entries}, indent=2, sort_keys=True) + "\n"
    ).encode()
    parsed = parse_json(state, "trainer_state.json", 256 << 20)
    assert isinstance(parsed, dict) and parsed["global_step"] == 100_000
    bomb = b'{"global_step": 1, "log_history": [' + b"[]," * (len(state) // 3) + b"[]]}"
    refused = parse_json(bomb, "trainer_state.json", 256 << 20)
    assert isinstance(refused, Damaged) and f"within {PARSE_BUDGET} bytes" in refused.reason, refused
