"""Hostile and damaged shares (issue 13): every case of `tests/_hostile_cases.py`, as root and as an
unprivileged uid, on local disk and on the NFS-like mount.

Each (identity, filesystem) pair runs all its cases in one forked child (the four children at once:
105 s one after the other in a quiet suite, 38 s side by side), which drops to uid/gid 65534
with no supplementary groups for the unprivileged runs (what ``setpriv --reuid=65534 --regid=65534
--clear-groups`` does; a fork rather than a new interpreter because the interpreter and the checkout may
sit under a directory uid 65534 cannot read). Each case is then one test here, failing with the case's
own traceback. Every case inside the child is bounded by its own progress (`tests._stall`), and the child
by the time since a case last ended: load makes them slower, never fail.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from safeio.testing._cleanup import remove_scratch
from safeio.testing.nfslike import Mount, fuse_unavailable_reason
from safeio.testing.pytest_plugin import skip_or_fail
from tests import _hostile_cases as hostile
from tests import (
    _hostile_cases_round2,  # noqa: F401 - registers issue 25's cases into hostile.CASES
    _hostile_cases_round3,  # noqa: F401 - and issue 34's
    _hostile_cases_round4,  # noqa: F401 - and the audit of calls by name's
)

NOBODY = 65534
# The child reports each case as it ends; it has hung when no case ended for this long (each case is
# bounded in the child by its own progress, and by CASE_CEILING at most). Not the child's total wall
# time: under load the whole run takes many minutes (issue 37).
SILENCE_SECONDS = hostile.CASE_CEILING + 60
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


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


@dataclass
class _Child:
    """One (identity, filesystem) pair's forked child, running all its cases, as the parent reads it."""

    pid: int
    read: int
    names: list[str]
    data: bytes = b""
    last: float = field(default_factory=time.monotonic)  # when a case last ended (or the child started)


def _start(identity: str, base: Path, shared: Path | None) -> _Child:
    """Fork the child of one pair; it runs every case applicable to ``identity`` and writes one line per
    case as it ends. Forked from the main thread, before any reading: the four children run at once."""
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
            for n in names:  # one line per case as it ends: the parent's bound is on silence
                result = hostile.run_case(n, cases, privileged=privileged, shared=shared)
                _write_all(write, json.dumps({n: result}).encode() + b"\n")
        except BaseException:  # the parent reports it
            import traceback

            _write_all(
                write, json.dumps({"_child": {"ok": False, "detail": traceback.format_exc()}}).encode()
            )
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    return _Child(pid, read, names)


def _collect(children: dict[tuple[str, str], _Child]) -> dict[tuple[str, str], dict[str, dict[str, Any]]]:
    """Read every child until it ends, or until it has been silent (no case ended) for SILENCE_SECONDS:
    then it is killed and its remaining cases fail as silent. Each child's silence is its own."""
    running = dict(children)
    try:
        while running:
            by_fd = {child.read: key for key, child in running.items()}
            ready, _, _ = select.select(list(by_fd), [], [], 1.0)
            for fd in ready:
                key = by_fd[fd]
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    _end(running.pop(key))
                    continue
                running[key].data += chunk
                running[key].last = time.monotonic()
            for key, child in list(running.items()):
                if time.monotonic() - child.last > SILENCE_SECONDS:
                    os.kill(child.pid, 9)
                    _end(running.pop(key))
    finally:
        for child in running.values():  # only when the parent itself was interrupted
            os.kill(child.pid, 9)
            _end(child)
    return {key: _results(child) for key, child in children.items()}


def _end(child: _Child) -> None:
    os.close(child.read)
    os.waitpid(child.pid, 0)


def _results(child: _Child) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for line in child.data.splitlines():
        if line.strip():
            results.update(json.loads(line))
    silent = f"the child ended, or was killed after {SILENCE_SECONDS} s without a case ending, before it"
    for n in child.names:
        results.setdefault(n, {"ok": False, "detail": silent})
    return results


@pytest.fixture(scope="module")
def results() -> Iterator[dict[tuple[str, str], dict[str, dict[str, Any]]]]:
    """Every case's outcome per (identity, filesystem), computed for all four pairs at once on first use:
    their children run side by side (the two cores are shared; each case is bounded by its progress)."""
    roots: list[Path] = []
    mounts: list[Mount] = []

    def prepare(identity: str, filesystem: str) -> tuple[Path, Path | None]:
        root = Path(tempfile.mkdtemp(prefix=f"hostile-{identity}-{filesystem}-", dir="/tmp"))
        roots.append(root)
        base = root / "local"
        (base / "cases").mkdir(parents=True)
        shared = None
        if filesystem == "nfslike":
            (root / "backing").mkdir()
            mounted = Mount(root / "backing", root / "mnt", state_dir=root / "state")
            mounts.append(mounted.start())
            shared = mounted.path / "cases"
            shared.mkdir()
        for path in [root, base, base / "cases", *([shared] if shared else [])]:
            path.chmod(0o777 if path != root else 0o755)
            if identity == "nobody" and path != root:
                os.chown(path, NOBODY, NOBODY)
        return base, shared

    class Lazy(dict[tuple[str, str], dict[str, dict[str, Any]]]):
        def __missing__(self, key: tuple[str, str]) -> dict[str, dict[str, Any]]:
            fuse_missing = fuse_unavailable_reason()
            if key[1] == "nfslike" and fuse_missing is not None:
                skip_or_fail(fuse_missing)
            pairs = [(i, f) for i in IDENTITIES for f in FILESYSTEMS if f == "local" or fuse_missing is None]
            places = {pair: prepare(*pair) for pair in pairs}
            children = {pair: _start(pair[0], *places[pair]) for pair in pairs}
            self.update(_collect(children))
            return self[key]

    try:
        yield Lazy()
    finally:
        for mounted in mounts:
            mounted.stop()
        for root in roots:
            remove_scratch(root)  # a failed case may leave a tree past the recursion limit


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
