from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every rank (and a non-root uid) can traverse: pytest's tmp_path base is 0700."""
    path = Path(tempfile.mkdtemp(prefix="safeio-test-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        import shutil

        for root, dirs, _files in os.walk(path):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o755)
        shutil.rmtree(path, ignore_errors=True)
