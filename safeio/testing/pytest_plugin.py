"""safeio's pytest plugin (registered through the pytest11 entry point).

NFS-like filesystem fixtures (options through ``@pytest.mark.fuse_opts(**options)``, the keyword
arguments of `safeio.testing.nfslike.mount`):

- ``nfslike_mount``: one mount of a fresh backing directory;
- ``nfslike_clients``: two mounts of one backing directory, i.e. two NFS clients with separate
  dentry and attribute caches.

Both skip with the precise reason where FUSE is unavailable, except under ``SAFEIO_REQUIRE_FUSE=1``
(CI), where that is a test failure. Their directories live under /tmp with mode 0755 (pytest's
tmp_path base is 0700), so processes of other uids can reach the mount; the backing root is 0755
and owned by the test's user.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from safeio.testing._cleanup import remove_scratch
from safeio.testing.nfslike import Mount, fuse_unavailable_reason

__all__ = [
    "REQUIRE_FUSE_ENV",
    "fuse_unavailable_reason",
    "nfslike_clients",
    "nfslike_mount",
    "require_fuse",
    "skip_or_fail",
]

REQUIRE_FUSE_ENV = "SAFEIO_REQUIRE_FUSE"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fuse_opts(**options): options for the nfslike mount fixtures")


def skip_or_fail(reason: str) -> None:
    """Skip for `reason`, or fail when FUSE is required (``SAFEIO_REQUIRE_FUSE=1``)."""
    if os.environ.get(REQUIRE_FUSE_ENV) == "1":
        pytest.fail(f"FUSE is required ({REQUIRE_FUSE_ENV}=1) but unavailable: {reason}", pytrace=False)
    pytest.skip(f"FUSE unavailable: {reason}")


def require_fuse() -> None:
    """Skip (or fail, see `skip_or_fail`) the calling test unless the NFS-like fs can mount here."""
    reason = fuse_unavailable_reason()
    if reason is not None:
        skip_or_fail(reason)


def _fuse_opts(request: pytest.FixtureRequest) -> dict[str, Any]:
    marker = request.node.get_closest_marker("fuse_opts")
    if marker is None:
        return {}
    if marker.args:
        raise TypeError(
            "@pytest.mark.fuse_opts takes keyword arguments only, e.g. fuse_opts(silly_rename=True)"
        )
    return dict(marker.kwargs)


def _shared_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="nfslike-", dir="/tmp"))
    root.chmod(0o755)
    return root


@pytest.fixture
def nfslike_mount(request: pytest.FixtureRequest) -> Iterator[Mount]:
    """One NFS-like mount of a fresh backing directory (``.path``, ``.backing``)."""
    require_fuse()
    root = _shared_root()
    try:
        (root / "backing").mkdir(mode=0o755)
        with Mount(
            root / "backing", root / "mnt", state_dir=root / "state", **_fuse_opts(request)
        ) as mounted:
            yield mounted
    finally:
        remove_scratch(root)  # at any depth (shutil.rmtree recursed: RecursionError in teardown)


@pytest.fixture
def nfslike_clients(request: pytest.FixtureRequest) -> Iterator[tuple[Mount, Mount]]:
    """Two NFS-like mounts (two clients) of one backing directory, with the same options."""
    require_fuse()
    root = _shared_root()
    options = _fuse_opts(request)
    try:
        (root / "backing").mkdir(mode=0o755)
        with (
            Mount(root / "backing", root / "a", state_dir=root / "state-a", **options) as a,
            Mount(root / "backing", root / "b", state_dir=root / "state-b", **options) as b,
        ):
            yield a, b
    finally:
        remove_scratch(root)  # at any depth (shutil.rmtree recursed: RecursionError in teardown)
