"""One vocabulary of states for ``safeio ls``, ``verify`` and ``gc`` (issue 36): the same entry gets the
same word from each command, in JSON as a word of the fixed set (``state``) beside its prose (``detail``)
and what fixes it (``fix``); docs/cli.md's table is the code's; ``ls`` aligns its columns."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import safeio
from safeio._storage.names import host_tag
from safeio.cli._states import ABOUT, State
from tests._bounds import PATIENT
from tests._cli_docs import docs_table

OTHER = 65534


def test_the_docs_table_of_states_is_the_codes_vocabulary() -> None:
    documented = {row[0].strip("`"): (row[1], row[2]) for row in docs_table("## States")}
    in_code = {
        state.value: (about.meaning, about.fix.format(root="ROOT") if about.fix else "—")
        for state, about in ABOUT.items()
    }
    assert documented == in_code
    assert set(ABOUT) == set(State)  # every word has its meaning


def cli_json(*args: str) -> tuple[int, dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "safeio", *args, "--json"], capture_output=True, text=True, timeout=PATIENT
    )
    return done.returncode, json.loads(done.stdout)


def cli_text(*args: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "safeio", *args], capture_output=True, text=True, timeout=PATIENT
    )
    return done.returncode, done.stdout + done.stderr


def _die_inside_a_save(root: str, step: int) -> None:
    ckpts = safeio.Checkpoints(root, keep=None)
    with ckpts.save(step) as ckpt:
        Path(ckpt.path, "w.bin").write_bytes(b"half")
        os._exit(9)  # killed in the body: its stage stays behind, its process is gone


@contextlib.contextmanager
def every_kind_of_entry(root: Path) -> Iterator[dict[str, str]]:
    """A Checkpoints root holding one entry in each state a root can hold; yields name -> expected state
    while a save of step 9 is in progress in this process."""
    ckpts = safeio.Checkpoints(root, keep=None)
    for step in (1, 2):
        with ckpts.save(step) as ckpt:
            Path(ckpt.path, "w.bin").write_bytes(b"x" * 1000)
    Path(ckpts.path_of("step_1"), "w.bin").write_bytes(b"short")
    (root / "step_3").mkdir()  # written without safeio, killed midway
    trainer = root / "checkpoint-4"
    trainer.mkdir()
    (trainer / "trainer_state.json").write_text('{"global_step": 4}')
    (trainer / "model.safetensors").write_bytes(b"w")
    child = multiprocessing.get_context("fork").Process(target=_die_inside_a_save, args=(str(root), 5))
    child.start()
    child.join(PATIENT)
    assert child.exitcode == 9
    (dead,) = [n for n in os.listdir(root) if n.startswith(".step_5.safeio-stage-")]
    far = f".step_6.safeio-stage-{host_tag('another-host')}-4242-0badc0de"
    (root / far).mkdir()
    expected = {
        "step_1": "damaged",
        "step_2": "committed",
        "step_3": "written-without-safeio-incomplete",
        "checkpoint-4": "written-without-safeio-complete",
        dead: "stale",
        far: "other-host",
    }
    if os.geteuid() == 0:  # only root can make another user's step
        theirs = root / "step_7"
        theirs.mkdir()
        os.chown(theirs, OTHER, OTHER)
        expected["step_7"] = "another-users"
    live = ckpts.save(9)
    live.__enter__()  # a save in progress (this process is alive)
    try:
        (stage,) = [n for n in os.listdir(root) if n.startswith(".step_9.safeio-stage-")]
        expected[stage] = "in-progress"
        yield expected
    finally:
        live.__exit__(None, None, None)


def test_ls_verify_and_gc_give_each_entry_the_same_word(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    words = {state.value for state in State}
    with every_kind_of_entry(root) as expected:
        code, listed = cli_json("ls", str(root))
        assert code == 0, listed
        by_ls = {row["name"]: row for row in listed["checkpoints"]}
        assert {name: row["state"] for name, row in by_ls.items()} == expected
        for row in by_ls.values():  # a word of the set, the prose apart, and a fix for each problem
            assert row["state"] in words and row["detail"], row
            assert (row["fix"] is not None) == (ABOUT[State(row["state"])].fix is not None), row
        assert by_ls["step_1"]["detail"].startswith("size mismatch: w.bin")
        stale = next(n for n, s in expected.items() if s == "stale")
        assert by_ls[stale]["fix"].startswith(f"`safeio gc {root}`")

        code, verified = cli_json("verify", str(root))
        assert code == 1
        by_verify = {row["name"]: row["state"] for row in verified["checkpoints"]}
        assert by_verify == expected, by_verify
        problems = sorted(p.split(":")[0] for p in verified["problems"])
        assert problems == ["step_1", "step_3"], verified["problems"]

        code, collected = cli_json("gc", "--dry-run", str(root))
        assert code == 0, collected
        by_gc = {Path(e["path"]).name: e["state"] for e in [*collected["actions"], *collected["kept"]]}
        stages = {name: state for name, state in expected.items() if name.startswith(".")}
        assert {n: s for n, s in by_gc.items() if n in stages} == stages, by_gc
        for entry in [*collected["actions"], *collected["kept"]]:
            assert entry["state"] in words and entry["detail"], entry

        # The text says the same words, and each problem with the command that fixes it.
        code, text = cli_text("verify", str(root))
        assert "  step_1: damaged: size mismatch: w.bin" in text, text
        assert f"  note: {stale}: stale: " in text and f"fix stale ({stale}): `safeio gc {root}`" in text, (
            text
        )
        far = next(n for n, s in expected.items() if s == "other-host")
        assert f"fix other-host ({far}): `safeio gc {root} --older-than 1d`" in text, text


def test_ls_aligns_its_columns_with_long_names_and_states(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    pattern = "checkpoint-of-a-run-with-a-rather-long-name-{step}"
    ckpts = safeio.Checkpoints(root, keep=None, name=pattern)
    with ckpts.save(1) as ckpt:
        Path(ckpt.path, "w.bin").write_bytes(b"x" * 3000)
    (root / pattern.format(step=22)).mkdir()  # the longest state word
    (root / pattern.format(step=333)).mkdir()
    Path(root / pattern.format(step=333), "w.bin").write_bytes(b"y" * 2_000_000)
    code, text = cli_text("ls", "--name", pattern, str(root))
    assert code == 0, text
    header, *lines = text.splitlines()
    rows = [line for line in lines if not line.startswith("fix ")]
    assert len(rows) == 3, text
    # Every cell starts where its header does (SIZE is right-aligned: it ends where the header ends).
    name_at, detail_at, size_end = header.index("NAME"), header.index("DETAIL"), header.index("SIZE") + 4
    words = {state.value for state in State}
    for line in rows:
        state = line.split()[0]
        assert state in words, line
        assert line[len(state)] == " " and line[size_end - 1] != " " and line[size_end] == " ", (header, line)
        assert line[name_at:].startswith(pattern[:20]) and line[name_at - 1] == " ", (header, line)
        assert line[detail_at - 1] == " " and line[detail_at] != " ", (header, line)
    assert re.search(r"written-without-safeio-incomplete +0 B +checkpoint-of-a-run", text), text


@pytest.mark.parametrize("command", ["ls", "verify"])
def test_a_damaged_step_is_damaged_in_ls_as_in_verify(tmp_path: Path, command: str) -> None:
    """ls called a damaged step "partial" where verify said "damaged"."""
    root = tmp_path / "ckpts"
    ckpts = safeio.Checkpoints(root, keep=None)
    with ckpts.save(1) as ckpt:
        Path(ckpt.path, "w.bin").write_bytes(b"x" * 100)
    (root / "step_1" / "w.bin").write_bytes(b"torn")
    _code, report = cli_json(command, str(root))
    (row,) = report["checkpoints"]
    assert row["state"] == "damaged" and "size mismatch: w.bin" in row["detail"], row
