"""Hostile and damaged shares (issue 13): every case of `tests/_hostile_cases.py`, as root and as an
unprivileged uid, on local disk and on the NFS-like mount.

Each (identity, filesystem) pair runs all its cases in one forked child, which drops to uid/gid 65534
with no supplementary groups for the unprivileged runs (what ``setpriv --reuid=65534 --regid=65534
--clear-groups`` does; a fork rather than a new interpreter because the interpreter and the checkout may
sit under a directory uid 65534 cannot read). Each case is then one test here, failing with the case's
own traceback. The child is bounded in time as a whole, and every case inside it by an alarm.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from safeio.testing.nfslike import Mount, fuse_unavailable_reason
from safeio.testing.pytest_plugin import skip_or_fail
from tests import _hostile_cases as hostile
from tests import (
    _hostile_cases_round2,  # noqa: F401 - registers issue 25's cases into hostile.CASES
    _hostile_cases_round3,  # noqa: F401 - and issue 34's
)

NOBODY = 65534
CHILD_SECONDS = 600
IDENTITIES = ("root", "nobody")
FILESYSTEMS = ("local", "nfslike")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="switching to another uid needs root (CI runs as root)"
)


def _preload_lazy_modules() -> None:
    import filelock

    # filelock imports its soft-lock classes on first attribute access.
    for name in ("SoftFileLease", "StrictSoftFileLock", "SoftFileLock"):
        getattr(filelock, name)


def _run_all(identity: str, base: Path, shared: Path | None) -> dict[str, dict[str, Any]]:
    privileged = identity == "root"
    names = [n for n in hostile.CASES if hostile.applicable(n, privileged)]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            os.close(read)
            if not privileged:
                # What is imported lazily must be imported now: after the switch the checkout (and its
                # .venv) may be unreadable, e.g. a clone under a 0700 mktemp directory.
                _preload_lazy_modules()
                os.setgroups([])
                os.setresgid(NOBODY, NOBODY, NOBODY)
                os.setresuid(NOBODY, NOBODY, NOBODY)
            os.chdir(base)
            cases = base / "cases"
            results = {n: hostile.run_case(n, cases, privileged=privileged, shared=shared) for n in names}
            os.write(write, json.dumps(results).encode())
        except BaseException:  # the parent reports it
            import traceback

            os.write(write, json.dumps({"_child": {"ok": False, "detail": traceback.format_exc()}}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    data = b""
    deadline = time.monotonic() + CHILD_SECONDS
    import select

    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([read], [], [], 5)
            if ready:
                chunk = os.read(read, 1 << 20)
                if not chunk:
                    break
                data += chunk
        else:
            os.kill(pid, 9)
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    if not data:
        return {n: {"ok": False, "detail": f"the child ran out of its {CHILD_SECONDS} s"} for n in names}
    results: dict[str, dict[str, Any]] = json.loads(data)
    return results


@pytest.fixture(scope="module")
def results() -> Iterator[dict[tuple[str, str], dict[str, dict[str, Any]]]]:
    """Every case's outcome per (identity, filesystem), computed on first use."""
    cache: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    roots: list[Path] = []
    mounts: list[Mount] = []

    class Lazy(dict[tuple[str, str], dict[str, dict[str, Any]]]):
        def __missing__(self, key: tuple[str, str]) -> dict[str, dict[str, Any]]:
            identity, filesystem = key
            root = Path(tempfile.mkdtemp(prefix=f"hostile-{identity}-{filesystem}-", dir="/tmp"))
            roots.append(root)
            base = root / "local"
            (base / "cases").mkdir(parents=True)
            shared = None
            if filesystem == "nfslike":
                reason = fuse_unavailable_reason()
                if reason is not None:
                    skip_or_fail(reason)
                (root / "backing").mkdir()
                mounted = Mount(root / "backing", root / "mnt", state_dir=root / "state")
                mounts.append(mounted.start())
                shared = mounted.path / "cases"
                shared.mkdir()
            for path in [root, base, base / "cases", *([shared] if shared else [])]:
                path.chmod(0o777 if path != root else 0o755)
                if identity == "nobody" and path != root:
                    os.chown(path, NOBODY, NOBODY)
            self[key] = _run_all(identity, base, shared)
            return self[key]

    lazy = Lazy(cache)
    try:
        yield lazy
    finally:
        for mounted in mounts:
            mounted.stop()
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


# Cases that need root (a PID namespace) or that root's disregard of file modes defeats run only as
# the identity they can run as (see ROOT_ONLY and UNPRIVILEGED_ONLY).
@pytest.mark.parametrize(
    ("name", "identity", "filesystem"),
    [
        (name, identity, filesystem)
        for name in sorted(hostile.CASES)
        for identity in IDENTITIES
        for filesystem in FILESYSTEMS
        if hostile.applicable(name, identity == "root")
    ],
)
def test_hostile_case(name: str, identity: str, filesystem: str, results: Any) -> None:
    outcome = results[identity, filesystem]
    assert "_child" not in outcome, outcome["_child"]["detail"]
    assert outcome[name]["ok"], outcome[name]["detail"]


def test_every_numbered_case_of_issue_13_is_covered() -> None:
    numbers = {name.split("_")[0] for name in hostile.CASES if name.startswith("case")}
    assert numbers == {f"case{n}" for n in range(1, 9)}


def test_a_bad_environment_never_breaks_import_or_the_command() -> None:
    env = {
        **os.environ,
        "SAFEIO_VERSION_GRACE": "abc",
        "SAFEIO_LEASE_SECONDS": "abc",
        "SAFEIO_TIMEOUT": "nan",
    }
    env["SAFEIO_WARN_AFTER"] = "-3"
    for argv in (
        ["-c", "import safeio; print(safeio.__version__)"],
        ["-m", "safeio", "gc", "--dry-run", tempfile.gettempdir() + "/safeio-missing-dir"],
        ["-m", "safeio", "verify", tempfile.gettempdir() + "/safeio-missing-dir"],
        ["-m", "safeio", "--help"],
    ):
        done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=120)
        assert "Traceback" not in done.stderr + done.stdout, (argv, done.stderr)
        assert done.returncode in (0, 1, 2), (argv, done.returncode, done.stderr)
