"""The `safeio` logger: DEBUG for a save's lifecycle, WARNING for fallbacks, with rank and paths."""

from __future__ import annotations

import errno
import logging
import re
from pathlib import Path
from typing import Any

import pytest

import safeio
import safeio._promotion.capabilities
import safeio._promotion.exchange
import safeio._storage.fsops


def _save(target: Path, content: str) -> None:
    with safeio.replicated(target, group=safeio.Group()) as stage:
        Path(stage.path, "tokenizer_config.json").write_text(content)


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "safeio" and r.levelno == level]


def test_a_save_logs_its_lifecycle_at_debug(shared_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="safeio")
    target = shared_dir / "tok"
    _save(target, "v1")
    debug = _messages(caplog, logging.DEBUG)
    assert any(
        re.fullmatch(rf"rank 0 \([^)]*\): stage {shared_dir}/\.tok\.safeio-stage-\S+ created for {target}", m)
        for m in debug
    ), debug
    assert any(m.endswith(f": {target} is new: promoted without the lock") for m in debug), debug
    caplog.clear()
    _save(target, "v2")  # replacing it takes the lock
    debug = _messages(caplog, logging.DEBUG)
    assert any(
        re.fullmatch(rf"rank 0 \([^)]*\): lock {shared_dir}/\.tok\.safeio\.lock held for [\d.]+ ms", m)
        for m in debug
    ), debug
    assert any(m.startswith("rank 0 (") and m.endswith(f": promoted {target} (mode replace)") for m in debug)
    assert not _messages(caplog, logging.WARNING)  # a healthy save warns about nothing


def test_refused_rename_exchange_is_a_warning(
    shared_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")  # as NFS and FUSE answer RENAME_EXCHANGE

    monkeypatch.setattr(safeio._promotion.exchange, "renameat2", refuse)
    monkeypatch.setattr(safeio._promotion.capabilities, "_no_exchange", set())
    monkeypatch.delenv("SAFEIO_NO_EXCHANGE", raising=False)
    target = shared_dir / "tok"
    _save(target, "v1")
    caplog.set_level(logging.DEBUG, logger="safeio")
    _save(target, "v2")
    [warning] = _messages(caplog, logging.WARNING)
    assert re.match(
        rf"rank 0 \(\S+ pid \d+\): the filesystem of {re.escape(str(target))} refuses RENAME_EXCHANGE",
        warning,
    )
    assert (target / "tokenizer_config.json").read_text() == "v2"  # the fallback still replaced it


def test_a_leftover_kept_alive_by_open_files_is_a_warning(
    shared_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_remove = safeio._storage.fsops.remove_directory_at

    def silly_renamed(dir_fd: int, name: str, *, expected: tuple[int, int] | None = None) -> None:
        if ".safeio-old-" in name:  # NFS: an open .nfsXXXX file keeps it non-empty
            raise OSError(errno.ENOTEMPTY, "Directory not empty", name)
        real_remove(dir_fd, name, expected=expected)

    monkeypatch.setenv("SAFEIO_NO_EXCHANGE", "1")
    monkeypatch.setattr(safeio._storage.fsops, "remove_directory_at", silly_renamed)
    target = shared_dir / "tok"
    _save(target, "v1")
    caplog.set_level(logging.DEBUG, logger="safeio")
    _save(target, "v2")
    [warning] = _messages(caplog, logging.WARNING)
    assert re.match(
        rf"rank \S+ \(\S+ pid \d+\): could not remove replaced version {shared_dir}/\.tok\.safeio-old-\S+ yet",
        warning,
    )
    assert "silly-renamed" in warning and "safeio gc" in warning
    assert (target / "tokenizer_config.json").read_text() == "v2"
