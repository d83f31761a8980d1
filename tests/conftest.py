from __future__ import annotations

import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from safeio.testing._cleanup import remove_scratch

# Other projects' tests, kept as their authors wrote them: tests/test_upstream_suites.py runs them in
# subprocesses of their own (with their own configuration), never in this session.
collect_ignore = ["upstream"]


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every rank (and a non-root uid) can traverse: pytest's tmp_path base is 0700."""
    path = Path(tempfile.mkdtemp(prefix="safeio-test-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        remove_scratch(path)  # at any depth: shutil.rmtree recursed (RecursionError in teardown)


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """A moto S3 server on 127.0.0.1 with a fresh bucket (``BUCKET`` in the returned dict, with the
    ``FSSPEC_S3_*`` variables a child process needs); stopped afterwards."""
    import fsspec
    import s3fs
    from moto import server as moto_server

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        options = {"endpoint_url": endpoint, "key": "x", "secret": "x"}
        monkeypatch.setitem(fsspec.config.conf, "s3", options)
        s3fs.S3FileSystem.clear_instance_cache()
        # moto keeps its buckets process-wide, across servers: a fresh name per test.
        bucket = f"ckpt-{secrets.token_hex(4)}"
        s3fs.S3FileSystem(**options).mkdir(bucket)
        yield {
            "BUCKET": bucket,
            "FSSPEC_S3_ENDPOINT_URL": endpoint,
            "FSSPEC_S3_KEY": "x",
            "FSSPEC_S3_SECRET": "x",
        }
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()
