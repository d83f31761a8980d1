"""Hypothesis against what a shared directory may hold (issue 13): manifests, merge intents, lock markers
and safeio-looking names with any content and of any file type, planted beside a real checkpoint.

For each example: ``safeio.verify``/``is_complete``, ``safeio verify``, ``safeio gc --dry-run`` (which
must change nothing) and ``safeio gc``, then a merge save of the checkpoint, which must either succeed
or raise a `safeio.SafeIOError`. Always: no traceback, no hang (every example runs under an alarm), and
no change to a sentinel tree outside the share that the planted links and names point at.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import safeio
from safeio._storage.manifest import MANIFEST_NAME, MERGE_INTENT_NAME
from safeio._storage.names import KINDS, host_tag, lock_name
from safeio.testing.nfslike import Mount, fuse_unavailable_reason
from safeio.testing.pytest_plugin import skip_or_fail
from tests import _hostile_cases as hostile

EXAMPLE_SECONDS = 30

# Names an attacker would try, and anything else hypothesis thinks of.
HOSTILE_NAMES = st.one_of(
    st.sampled_from(
        [
            "..",
            ".",
            "",
            "../escaped",
            "../../outside/id_rsa",
            "/etc/passwd",
            "a/../../b",
            "a//b",
            "a/./b",
            "a\0b",
            "ckpt",
            "a.txt",
            "sub/b.txt",
            "sub",
            "n" * 300,
            MANIFEST_NAME,
            "sub/../../../outside",
        ]
    ),
    st.text(max_size=40),
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | HOSTILE_NAMES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(HOSTILE_NAMES, inner, max_size=4),
    max_leaves=20,
)
MANIFEST_LIKE = st.fixed_dictionaries(
    {
        "files": st.dictionaries(
            HOSTILE_NAMES,
            st.fixed_dictionaries({"size": JSON}, optional={"sha256": JSON, "xxh3_128": JSON}) | JSON,
            max_size=4,
        )
    },
    optional={"call": JSON, "writer": JSON, "calls": JSON | st.lists(st.dictionaries(HOSTILE_NAMES, JSON))},
)
INTENT_LIKE = st.fixed_dictionaries(
    {"target_name": HOSTILE_NAMES | JSON, "files": st.lists(HOSTILE_NAMES, max_size=4) | JSON}
)
# A stage's manifest carrying a merge's intent (format 2), as recovery reads it from a stage.
STAGE_MANIFEST_LIKE = st.fixed_dictionaries({"files": st.just({}) | JSON, "merge_intent": INTENT_LIKE | JSON})
MARKER_LIKE = st.one_of(
    st.binary(max_size=64),
    st.builds(
        lambda pid, host: f"filelock/4\npid={pid}\nhost={host}\n".encode(),
        st.integers(-5, 2**40),
        HOSTILE_NAMES,
    ),
)


def _content(structured: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        structured.map(lambda value: json.dumps(value).encode()),
        st.binary(max_size=64),
        st.integers(1, 100_000).map(lambda depth: b"[" * depth + b"]" * depth),
    )


# What sits under a name: (kind, payload). Links point into the sentinel tree or at devices.
PLANTED = st.one_of(
    st.tuples(st.just("file"), st.binary(max_size=8)),
    st.tuples(st.just("fifo"), st.none()),
    st.tuples(st.just("dir"), st.none()),
    st.tuples(
        st.just("link"), st.sampled_from(["OUTSIDE/id_rsa", "OUTSIDE/dir", "/dev/zero", "/", "missing"])
    ),
)


@st.composite
def sibling_names(draw: st.DrawFn) -> str:
    base = draw(
        st.sampled_from(["ckpt", "other", "n" * 200])
        # no lone surrogates: a name a file system call can be given
        | st.text(
            st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)), min_size=1, max_size=20
        )
    )
    kind = draw(st.sampled_from(KINDS))
    host = draw(st.sampled_from([host_tag(), "00000000", "ffffffff"]))
    pid = draw(st.sampled_from([0, 1, os.getpid(), 999_999_999, 2**32]) | st.integers(0, 2**22))
    start = draw(st.sampled_from(["", "-zzzz", "-0"]))
    return f".{base}.safeio-{kind}-{host}-{pid}{start}-{draw(st.sampled_from(['deadbeef', '00000000']))}"[
        :255
    ]


@st.composite
def shares(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "manifest": draw(st.none() | _content(MANIFEST_LIKE) | st.sampled_from([b"FIFO", b"LINK"])),
        "stages": draw(
            st.lists(
                st.tuples(
                    sibling_names(),
                    st.none() | _content(INTENT_LIKE),
                    st.none() | _content(STAGE_MANIFEST_LIKE),
                    st.lists(st.tuples(HOSTILE_NAMES, PLANTED), max_size=3),
                ),
                max_size=3,
            )
        ),
        "others": draw(st.lists(st.tuples(sibling_names(), PLANTED), max_size=3)),
        "markers": draw(
            st.lists(st.tuples(st.sampled_from(["ckpt", "x"]), MARKER_LIKE | st.just(b"FIFO")), max_size=2)
        ),
        "in_target": draw(st.lists(st.tuples(HOSTILE_NAMES, PLANTED), max_size=3)),
    }


def _plant(directory: Path, name: str, planted: tuple[str, Any], outside: Path) -> None:
    try:
        size = len(name.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:
        return  # a lone surrogate: not a name a file system call can be given
    if not name or "\0" in name or "/" in name or name in (".", "..") or size > 255:
        return  # not a name a directory can hold
    path = directory / name
    if os.path.lexists(path):
        return
    kind, payload = planted
    if kind == "file":
        path.write_bytes(payload)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    else:
        os.symlink(str(payload).replace("OUTSIDE", str(outside)), path)


def _write(directory: Path, name: str, content: bytes, outside: Path) -> None:
    if content == b"FIFO":
        _plant(directory, name, ("fifo", None), outside)
    elif content == b"LINK":
        _plant(directory, name, ("link", "OUTSIDE/id_rsa"), outside)
    else:
        _plant(directory, name, ("file", content), outside)


def _build(share: Path, outside: Path, drawn: dict[str, Any]) -> Path:
    target = share / "ckpt"
    hostile.save(target, {"a.txt": "old a", "sub/b.txt": "old b"}, mode="merge")
    if drawn["manifest"] is not None:
        (target / MANIFEST_NAME).unlink()
        _write(target, MANIFEST_NAME, drawn["manifest"], outside)
    for name, planted in drawn["in_target"]:
        _plant(target, name, planted, outside)
    for name, intent, stage_manifest, contents in drawn["stages"]:
        stage = share / name
        if os.path.lexists(stage):
            continue
        stage.mkdir()
        if intent is not None:
            _write(stage, MERGE_INTENT_NAME, intent, outside)
        if stage_manifest is not None:
            _write(stage, MANIFEST_NAME, stage_manifest, outside)
        for inner, planted in contents:
            _plant(stage, inner, planted, outside)
    for name, planted in drawn["others"]:
        _plant(share, name, planted, outside)
    for target_name, content in drawn["markers"]:
        lock = share / lock_name(target_name)
        if os.path.lexists(lock):
            lock.unlink()
        _write(share, lock.name, content, outside)
    return target


def _exercise(case_dir: Path, share: Path, outside: Path, drawn: dict[str, Any]) -> None:
    target = _build(share, outside, drawn)
    watched = hostile.tree_state(case_dir, skip=share)
    with hostile.alarm(EXAMPLE_SECONDS):
        assert isinstance(safeio.verify(target), list)
        assert isinstance(safeio.is_complete(target), bool)
        code, _ = hostile.cli("verify", str(target))
        assert code in (0, 1)
        before = hostile.tree_state(share)
        code, text = hostile.cli("gc", "--dry-run", str(share))
        assert code in (0, 1), text
        assert hostile.tree_state(share) == before, "gc --dry-run changed the share"
        code, text = hostile.cli("gc", str(share))
        assert code in (0, 1), text
        try:
            hostile.save(target, {"a.txt": "new a"}, mode="merge", timeout=5)
        except safeio.SafeIOError:
            pass  # refused with a clear error: allowed (a link planted where a file goes, say)
        else:
            assert (target / "a.txt").read_text() == "new a"
            assert safeio.verify(target) == []
    assert hostile.tree_state(case_dir, skip=share) == watched, "something outside the share changed"


class Places:
    """A fresh share and sentinel tree per example, under one base directory."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.counter = itertools.count()

    def fresh(self) -> tuple[Path, Path, Path]:
        case_dir = self.base / f"example-{next(self.counter)}"
        case_dir.mkdir()
        share, outside = case_dir / "share", case_dir / "outside"
        share.mkdir()
        hostile.make_outside(outside)
        return case_dir, share, outside


@pytest.fixture(scope="module")
def local_places() -> Iterator[Places]:
    base = Path(tempfile.mkdtemp(prefix="hostile-fuzz-"))
    yield Places(base)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def nfslike_places() -> Iterator[Places]:
    reason = fuse_unavailable_reason()
    if reason is not None:
        skip_or_fail(reason)
    root = Path(tempfile.mkdtemp(prefix="hostile-fuzz-nfslike-"))
    (root / "backing").mkdir()
    with Mount(root / "backing", root / "mnt", state_dir=root / "state") as mounted:
        yield Places(mounted.path)
    shutil.rmtree(root, ignore_errors=True)


FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@FUZZ
@given(drawn=shares())
def test_planted_metadata_on_local_disk(local_places: Places, drawn: dict[str, Any]) -> None:
    _exercise(*local_places.fresh(), drawn)


@settings(FUZZ, max_examples=8)
@given(drawn=shares())
def test_planted_metadata_on_the_nfslike_mount(nfslike_places: Places, drawn: dict[str, Any]) -> None:
    _exercise(*nfslike_places.fresh(), drawn)
