"""Another project's own test suite, run twice in subprocesses (plain, and with safeio's drop-ins first on
the path), compared test by test against the differences the docs list.

Used by tests/test_upstream_suites.py (python-atomicwrites' tests, kept in tests/upstream from its source
distribution on the package index) and scripts/upstream_suites.py (those, and, as release checks from
copies the caller has outside this repository, Lightning's checkpoint tests, transformers' Trainer
checkpoint tests and accelerate's state tests: none of them is kept here, see docs/development.md).

"The drop-ins" are a directory put first on the path (atomicwrites, Lightning), or variables set in the
run's environment (``SAFEIO_PATCH=1`` for transformers and accelerate: the start-up hook patches every
process of the run, as it patches a user's job).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UPSTREAM = REPO / "tests" / "upstream"
DROPINS = REPO / "tests" / "_dropins"

# Outcomes in which a test exercised nothing and proved nothing; a suite whose plain run has one of the
# "broken" kind did not run as its authors meant it here (a missing dependency, a changed upstream).
BROKEN = frozenset({"failed", "error", "xpassed"})
# The name tests/_upstream_outcomes.py is loaded under in the runs.
_PLUGIN = "safeio_upstream_outcomes"


@dataclass(frozen=True)
class Suite:
    """One suite: where its tests live, its files (or ``file::Class`` selections), the drop-ins (a
    directory first on the path, and variables), what to probe."""

    name: str
    root: Path
    files: tuple[str, ...]
    dropins: Path | None
    probes: tuple[str, ...]
    docs: Path  # the page listing the documented differences
    ini: str = "[pytest]\n"  # the copy's own pytest.ini: it makes the copy the rootdir
    dropin_env: Mapping[str, str] = field(default_factory=dict)  # set in the drop-in run only
    # What the copy holds (paths under root): default, the top directories of the files.
    copy: tuple[str, ...] = ()
    # Prepares a workdir shared by both runs (stand-ins for what the tests download) and returns the
    # variables both runs get.
    prepare: Callable[[Path], dict[str, str]] | None = None
    # A file's tests selected by a pytest -k expression (parameterized names cannot be listed ahead).
    keywords: Mapping[str, str] = field(default_factory=dict)


ATOMICWRITES = Suite(
    name="atomicwrites",
    root=UPSTREAM / "atomicwrites",
    files=("test_atomicwrites.py",),
    dropins=DROPINS / "atomicwrites",
    probes=("atomicwrites",),
    docs=REPO / "docs" / "getting-started.md",
)

# Lightning's [tool.pytest.ini_options] (its pyproject.toml), less what does not apply to a copy of its
# tests alone: --doctest-modules (no sources), --color=yes (the output is parsed).
LIGHTNING_INI = """[pytest]
norecursedirs = .git .github dist build docs
addopts = --strict-markers --disable-pytest-warnings
markers =
    cloud: Run the cloud tests for example
filterwarnings =
    error::FutureWarning
    ignore::FutureWarning:onnxscript
    ignore:You are using `torch.load` with `weights_only=False`.*:FutureWarning
    ignore::FutureWarning:torch.distributed.algorithms.ddp_comm_hooks
    ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated.*:FutureWarning
xfail_strict = true
"""


def lightning(checkout: Path) -> Suite:
    """Lightning's checkpoint tests from ``checkout`` (a clone of Lightning-AI/pytorch-lightning at the
    installed version's tag), plain and with every ``ModelCheckpoint`` a ``SafeModelCheckpoint`` and
    ``SafeCheckpointIO`` the strategies' default (tests/_dropins/lightning, tests/_lightning_dropins.py).
    ``test_legacy_checkpoints.py`` is not run: it needs Lightning's downloaded legacy checkpoints."""
    root = checkout / "tests"
    if not (root / "tests_pytorch" / "checkpointing").is_dir():
        raise FileNotFoundError(
            f"{checkout} is not a Lightning checkout (no tests/tests_pytorch/checkpointing)"
        )
    return Suite(
        name="lightning",
        root=root,
        files=(
            "tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py",
            "tests_pytorch/checkpointing/test_model_checkpoint.py",
            "tests_pytorch/checkpointing/test_torch_saving.py",
            "tests_pytorch/checkpointing/test_trainer_checkpoint.py",
        ),
        dropins=DROPINS / "lightning",
        probes=(
            "lightning.pytorch.callbacks:ModelCheckpoint",
            "lightning.pytorch.strategies.strategy:TorchCheckpointIO",
        ),
        docs=REPO / "docs" / "frameworks" / "lightning.md",
        ini=LIGHTNING_INI,
    )


# For a copy of transformers' Trainer tests alone: its conftest.py (at its root, not copied) registers
# report options these runs do not use; its markers are not needed without --strict-markers.
TRANSFORMERS_INI = """[pytest]
addopts = --disable-pytest-warnings
"""

# The save/resume tests of transformers' test_trainer_callback.py (its other tests build no checkpoint).
_CALLBACK_TESTS = (
    "tests/trainer/test_trainer_callback.py::TrainerCallbackTest::test_event_flow",
    "tests/trainer/test_trainer_callback.py::TrainerCallbackTest::test_no_duplicate_save_on_epoch_strategy",
    "tests/trainer/test_trainer_callback.py::StatefulCallbackTest",
)


def transformers_trainer(checkout: Path) -> Suite:
    """transformers' Trainer checkpoint tests from ``checkout`` (a transformers source tree at the
    installed version's tag: ``tests/trainer/test_trainer_checkpointing.py``, ``trainer_test_utils.py``,
    ``test_trainer_callback.py``), plain and under ``SAFEIO_PATCH=1``, offline: the hub ids they load
    are stood in for by tests/_offline_transformers.py."""
    trainer = checkout / "tests" / "trainer"
    for name in ("test_trainer_checkpointing.py", "trainer_test_utils.py", "test_trainer_callback.py"):
        if not (trainer / name).is_file():
            raise FileNotFoundError(f"{checkout} has no tests/trainer/{name}: not a transformers source tree")
    return Suite(
        name="transformers-trainer",
        root=checkout,
        files=("tests/trainer/test_trainer_checkpointing.py", *_CALLBACK_TESTS),
        dropins=None,
        dropin_env={"SAFEIO_PATCH": "1"},
        probes=(
            "transformers.trainer_utils:get_last_checkpoint",
            "transformers.trainer:Trainer._save_checkpoint",
        ),
        docs=REPO / "docs" / "frameworks" / "transformers.md",
        ini=TRANSFORMERS_INI,
        copy=(
            "tests/__init__.py",
            "tests/trainer/__init__.py",
            "tests/trainer/trainer_test_utils.py",
            "tests/trainer/test_trainer_checkpointing.py",
            "tests/trainer/test_trainer_callback.py",
            "tests/fixtures/sample_text.txt",
        ),
        prepare=_hub_stand_ins,
    )


def _hub_stand_ins(workdir: Path) -> dict[str, str]:
    from tests._offline_transformers import build_hub_cache, hub_environment

    home = workdir / "hf-home"
    if not home.is_dir():
        build_hub_cache(os.fspath(home))
    return {**hub_environment(os.fspath(home)), "CUDA_VISIBLE_DEVICES": ""}


def accelerate_state(checkout: Path) -> Suite:
    """accelerate's state tests from ``checkout`` (its source distribution, which ships ``tests/``, or a
    checkout at the installed version's tag): ``test_state_checkpointing.py`` and the save and load tests
    of ``test_accelerator.py``, plain and under ``SAFEIO_PATCH=1``."""
    tests = checkout / "tests"
    for name in ("test_state_checkpointing.py", "test_accelerator.py"):
        if not (tests / name).is_file():
            raise FileNotFoundError(f"{checkout} has no tests/{name}: not an accelerate source tree")
    return Suite(
        name="accelerate",
        root=checkout,
        files=("tests/test_state_checkpointing.py", "tests/test_accelerator.py"),
        keywords={
            "tests/test_accelerator.py": (
                "save_load_model or save_model or save_sharded_model or get_state_dict_from_offload"
            )
        },
        dropins=None,
        dropin_env={"SAFEIO_PATCH": "1"},
        probes=("accelerate.accelerator:Accelerator.save_state",),
        docs=REPO / "docs" / "frameworks" / "accelerate.md",
        copy=("tests/test_state_checkpointing.py", "tests/test_accelerator.py"),
        prepare=lambda _workdir: {"CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "1"},
    )


@dataclass
class Run:
    """One run's outcomes by node id, the failures' messages, the probes, and how long it took."""

    outcomes: dict[str, str]
    messages: dict[str, str]
    probes: dict[str, str]
    seconds: float
    output: str = field(repr=False)


def run(
    suite: Suite,
    files: tuple[str, ...],
    workdir: Path,
    *,
    dropins: bool,
    timeout: float,
    pytest_args: tuple[str, ...] = (),
) -> Run:
    """``files`` of ``suite`` in a copy under ``workdir`` (its tests write beside themselves), bounded;
    ``pytest_args`` are added to the command line (``--durations=10``, ``-x``)."""
    copy = workdir / ("dropins" if dropins else "plain")
    # Only what the files need (and its conftest): the suite's list, or the files' top directories.
    wanted = suite.copy or tuple(sorted({file.split("/")[0] for file in files}))
    for rel in wanted:
        source = suite.root / rel
        if source.is_dir():
            shutil.copytree(source, copy / rel, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.exists():
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / rel)
    # The copy's own ini makes it the rootdir: no configuration or conftest from above is read.
    (copy / "pytest.ini").write_text(suite.ini, encoding="utf-8")
    result = copy / "outcomes.json"
    # The recording plugin under a name of its own: a suite's own ``tests`` package (transformers')
    # would hide this repository's.
    plugins = workdir / "plugins"
    plugins.mkdir(exist_ok=True)
    shutil.copy2(REPO / "tests" / "_upstream_outcomes.py", plugins / f"{_PLUGIN}.py")
    path = [os.fspath(plugins), os.fspath(copy), os.fspath(REPO)]
    if dropins and suite.dropins is not None:
        path.insert(0, os.fspath(suite.dropins))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("SAFEIO_PATCH", None)  # the plain run is plain whatever the caller's environment
    if suite.prepare is not None:
        env.update(suite.prepare(workdir))
    if dropins:
        env.update(suite.dropin_env)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", _PLUGIN]
    cmd += ["--outcomes-json", os.fspath(result), "-q", "-o", "console_output_style=classic"]
    for probe in suite.probes:
        cmd += ["--outcomes-probe", probe]
    selections = {suite.keywords[file] for file in files if file in suite.keywords}
    assert len(selections) <= 1 and (not selections or len(files) == 1), "-k selects one file's tests"
    for expression in selections:
        cmd += ["-k", expression]
    started = time.monotonic()
    # A session of its own: a bounded run that overstays takes its spawned ranks with it.
    proc = subprocess.Popen(
        [*cmd, *pytest_args, *files],
        cwd=copy,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(
            f"{suite.name} ({'drop-ins' if dropins else 'plain'}) ran over {timeout:.0f} s:\n"
            f"{out.decode(errors='replace')[-6000:]}"
        ) from None
    except BaseException:
        # pytest-timeout's or a ^C's exception: the run and its spawned ranks go too.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        raise
    seconds = time.monotonic() - started
    output = out.decode(errors="replace")
    # 0: all passed, 1: some failed; anything else (interrupted, usage, internal error) ran nothing sound.
    assert proc.returncode in (0, 1) and result.exists(), (
        f"{suite.name} ({'drop-ins' if dropins else 'plain'}): pytest exited {proc.returncode}:\n"
        f"{output[-6000:]}"
    )
    record = json.loads(result.read_text(encoding="utf-8"))
    return Run(record["outcomes"], record["messages"], record["probes"], seconds, output)


Difference = tuple[str, str]  # (plain outcome, drop-in outcome)


def selected(nodeid: str, files: tuple[str, ...]) -> bool:
    """Whether ``nodeid`` is one of the tests ``files`` (files, or ``file::Class[::test]``) select."""
    return any(nodeid == f or nodeid.startswith(f + "::") or nodeid.startswith(f + "[") for f in files)


def differences(plain: Run, dropins: Run) -> dict[str, Difference]:
    """Every test whose outcome is not the same in both runs (absent from one: "missing")."""
    found = {}
    for nodeid in sorted(plain.outcomes.keys() | dropins.outcomes.keys()):
        pair = (plain.outcomes.get(nodeid, "missing"), dropins.outcomes.get(nodeid, "missing"))
        if pair[0] != pair[1]:
            found[nodeid] = pair
    return found


_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*(\w+)\s*\|\s*(\w+)\s*\|\s*(.*?)\s*\|\s*$")


def documented(suite: Suite) -> dict[str, Difference]:
    """The differences the docs page lists for ``suite``: the table after the line
    ``<!-- upstream differences: NAME -->``, one row per test (node id, plain, with safeio, why)."""
    return {nodeid: (plain, ours) for nodeid, (plain, ours, _why) in reasons(suite).items()}


def reasons(suite: Suite) -> dict[str, tuple[str, str, str]]:
    """``documented``, with each difference's reason as the docs give it."""
    lines = suite.docs.read_text(encoding="utf-8").splitlines()
    marker = f"<!-- upstream differences: {suite.name} -->"
    assert marker in lines, f"{suite.docs} has no {marker!r} line above its table of differences"
    listed: dict[str, tuple[str, str, str]] = {}
    in_table = False
    for line in lines[lines.index(marker) + 1 :]:
        if line.startswith("|"):
            in_table = True
            if m := _ROW.match(line):
                nodeid, plain, ours, why = m.groups()
                assert why, f"{suite.docs}: the difference in {nodeid} says no why"
                listed[nodeid] = (plain, ours, why)
        elif in_table or line.strip():
            break  # the table ended, or there is none ("None." in its place)
    return listed


def compare(suite: Suite, files: tuple[str, ...], plain: Run, dropins: Run) -> list[str]:
    """What is wrong, one line each: an undocumented difference, a documented one that did not happen
    (in the files run), or a plain run that did not run the suite as its authors meant it."""
    problems = []
    for nodeid, outcome in sorted(plain.outcomes.items()):
        if outcome in BROKEN:
            problems.append(f"plain run: {nodeid} {outcome}: {plain.messages.get(nodeid, '')[-1500:]}")
    found = differences(plain, dropins)
    listed = {k: v for k, v in documented(suite).items() if selected(k, files)}
    for nodeid, pair in found.items():
        if listed.get(nodeid) != pair:
            message = dropins.messages.get(nodeid) or plain.messages.get(nodeid, "")
            problems.append(
                f"undocumented: {nodeid} plain {pair[0]}, with safeio {pair[1]}: {message[-1500:]}"
            )
    for nodeid, pair in listed.items():
        if nodeid not in found:
            problems.append(f"documented but not seen: {nodeid} ({pair[0]} -> {pair[1]})")
    return problems
