"""Object stores: a real S3-compatible server (moto) on loopback, reached through s3fs.

safeio resolves ``s3://`` URLs with ``fsspec.core.url_to_fs``, so the endpoint is configured the way a
user would: ``fsspec.config.conf["s3"]`` in this process, ``FSSPEC_S3_*`` variables in a child.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

import safeio
from safeio._storage.location import resolve
from safeio._storage.manifest import MANIFEST_NAME
from safeio.cli import main as safeio_cli
from tests._reliability import record


def _save(url: str, files: dict[str, bytes]) -> None:
    with safeio.replicated(url, timeout=60) as stage:
        for rel, data in files.items():
            with open(os.path.join(stage.path, rel), "wb") as f:
                f.write(data)


def _keys(fs: Any, prefix: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(key[len(prefix) + 1 :] for key in fs.find(prefix))


def test_commit_marker_last_and_old_keys_removed_after_it(
    s3: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{s3['BUCKET']}/tok"
    _save(url, {"a.json": b"a1", "b.json": b"b1", "c.json": b"c1"})
    fs = resolve(url).fs
    events: list[str] = []

    def watch(name: str) -> None:
        original = getattr(fs, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            keys = args[1] if name == "put_file" else args[0]
            keys = keys if isinstance(keys, list) else [keys]
            names = ",".join(sorted(str(k).rsplit("/", 1)[-1] for k in keys))
            events.append(f"{name} {names} complete={safeio.is_complete(url)}")
            return out

        monkeypatch.setattr(fs, name, call)

    for name in ("put_file", "pipe_file", "rm_file", "rm"):
        watch(name)
    _save(url, {"a.json": b"a2", "b.json": b"b2"})
    print("\n".join(events))
    assert events[0] == f"rm_file {MANIFEST_NAME} complete=False"  # the old marker goes first
    puts = [e for e in events if e.startswith("put_file")]
    assert sorted(puts) == ["put_file a.json complete=False", "put_file b.json complete=False"]
    marker = events.index(f"pipe_file {MANIFEST_NAME} complete=True")
    assert marker == 3, "the commit marker is written after every file"
    assert events[marker + 1 :] == ["rm c.json complete=True"], "old keys go only after the commit"
    assert _keys(fs, f"{s3['BUCKET']}/tok") == sorted([MANIFEST_NAME, "a.json", "b.json"])
    assert fs.cat_file(f"{s3['BUCKET']}/tok/a.json") == b"a2"
    assert safeio.verify(url) == []


_CHILD = textwrap.dedent(
    """
    import os, sys
    import safeio
    with safeio.replicated(sys.argv[1], timeout=60) as stage:
        for i in range(int(sys.argv[2])):
            with open(os.path.join(stage.path, f"shard-{i:03d}.bin"), "wb") as f:
                f.write(os.urandom(16384))
    """
)


def test_writer_killed_mid_upload_is_reported_and_repaired(s3: dict[str, str]) -> None:
    url = f"s3://{s3['BUCKET']}/model"
    old = {f"shard-{i:03d}.bin": b"old" * 10 for i in range(3)}
    _save(url, old)
    fs = resolve(url).fs
    env = {**os.environ, **s3}
    attempts, killed = 0, False
    files = 60
    while not killed:
        attempts += 1
        assert attempts <= 3, "the upload finished every time before it could be killed"
        child = subprocess.Popen([sys.executable, "-c", _CHILD, url, str(files)], env=env)
        # Bounded poll: the moment the old commit marker is down, the upload is under way.
        deadline = time.monotonic() + 60
        while safeio.is_complete(url) and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        # ...and once some new keys have landed, so the prefix is really half old, half new.
        while (
            len(_keys(fs, f"{s3['BUCKET']}/model")) < 8
            and child.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.005)
        uploaded = len(_keys(fs, f"{s3['BUCKET']}/model"))
        child.send_signal(signal.SIGKILL)
        killed = child.wait(30) == -signal.SIGKILL and not safeio.is_complete(url)
        files *= 2
    problems = safeio.verify(url)
    print(f"killed after {uploaded} keys; verify: {problems}")
    assert problems and "no commit marker" in problems[0], problems
    assert safeio_cli(["verify", url]) != 0  # the command a user runs reports it too
    assert not safeio.is_complete(url)
    new = {"shard-000.bin": b"new0", "shard-001.bin": b"new1"}
    _save(url, new)  # a later save repairs the prefix: its files, its marker, nothing else
    assert safeio.verify(url) == [] and safeio.is_complete(url)
    assert _keys(fs, f"{s3['BUCKET']}/model") == sorted([MANIFEST_NAME, *new])
    assert fs.cat_file(f"{s3['BUCKET']}/model/shard-001.bin") == b"new1"
    record("s3", {"kills_mid_upload": attempts, "keys_when_killed": uploaded, "repaired": True})
