"""Every exit code docs/cli.md lists, per command, happens as it says (issue 36): the page's table is the
code's (``safeio.cli._exit_codes``), ``--help`` lists each entry whole, and each (command, code) is run
on real files and directories, on the NFS-like mount for a failing or hung share (Ctrl-C is 130)."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import safeio
from safeio._storage.names import host_tag
from safeio.cli import main
from safeio.cli._exit_codes import CODES, COMMANDS, EVERY, HEADINGS, WIDTH, codes_of, entries, epilog
from safeio.testing.nfslike import Mount
from safeio.testing.pytest_plugin import require_fuse
from tests._bounds import PATIENT
from tests._cli_docs import docs_table

BOUND = PATIENT  # a command's bound where its outcome is asserted (issue 37: generous, never waited out)


# ---------------------------------------------------------------------------------------------------
# The table and --help


def test_the_docs_table_of_exit_codes_is_the_codes() -> None:
    documented = {}
    for row in docs_table("## Exit codes"):
        name = row[0].strip("`")
        documented[name] = {code: cell for code, cell in zip(HEADINGS, row[1:], strict=True) if cell != "—"}
    assert documented == CODES
    assert set(documented) == {*COMMANDS, EVERY}  # every command is listed (ls and autopatch were not)


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_lists_each_exit_code_entry_whole(
    capsys: pytest.CaptureFixture[str], command: str | None
) -> None:
    """Each entry on its own lines, wrapped at word boundaries under its code: joined back, the lines
    give the entry exactly (the block once broke entries mid-phrase, one entry running into the next)."""
    argv = [] if command is None else command.split()
    assert main([*argv, "--help"]) == 0
    out = capsys.readouterr().out
    block = out[out.index("exit codes:\n") :]
    assert block == epilog(command)
    found: list[tuple[int, str]] = []
    code = None
    for line in block.splitlines()[1:]:
        assert len(line) <= WIDTH, line
        if heading := re.fullmatch(r"  (\d+) +(\S.*)", line):
            code = int(heading[1])
            assert heading[2] == HEADINGS[code]
        elif line.startswith(" " * 9):  # a continuation: one space between it and the line before
            found[-1] = (found[-1][0], f"{found[-1][1]} {line.strip()}")
        else:
            assert line.startswith(" " * 7) and line[7] != " " and code is not None, line
            found.append((code, line.strip()))
    assert found == entries(command)
    # No option or hyphenated word was split at a line end.
    assert not any(line.rstrip().endswith("-") for line in block.splitlines())


# ---------------------------------------------------------------------------------------------------
# Every documented code, run


def run(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """The command's entry point in this process (the interpreter's start-up is the only difference from
    a user's run; it costs a second or two per run on a loaded machine): its code and output."""
    out = io.StringIO()
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(list(argv))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return code, out.getvalue()


# Tests run under a shell's background job may inherit SIGINT ignored, and Python keeps it ignored; a
# user's Ctrl-C never is. Restore it, then exec the command.
_WITH_SIGINT = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"


def started(argv: list[str], err: Path) -> subprocess.Popen[bytes]:
    with open(err, "w") as f:  # a file, not a pipe: children that outlive the command inherit it
        return subprocess.Popen(
            [sys.executable, "-c", _WITH_SIGINT, sys.executable, "-m", "safeio", *argv],
            stdout=subprocess.DEVNULL,
            stderr=f,
        )


def until(condition: Callable[[], bool], proc: subprocess.Popen[bytes], err: Path) -> None:
    """Wait for ``condition`` while ``proc`` runs (polling, bounded: a deadline, not synchronisation)."""
    deadline = time.monotonic() + BOUND
    while not condition():
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
        time.sleep(0.05)


def interrupted(
    proc: subprocess.Popen[bytes], err: Path, when: Callable[[], bool], then: Callable[[], None]
) -> tuple[int, str]:
    """Ctrl-C to ``proc`` once ``when()`` holds; ``then()`` right after (releasing a hung share)."""
    try:
        until(when, proc, err)
        proc.send_signal(signal.SIGINT)
        then()
        code = proc.wait(BOUND)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, err.read_text()


@pytest.fixture(scope="module")
def share() -> Iterator[Mount]:
    """One NFS-like mount for the module (a failing or hung share); each case uses its own directory."""
    require_fuse()
    root = Path(tempfile.mkdtemp(prefix="nfslike-exit-", dir="/tmp"))
    root.chmod(0o755)
    (root / "backing").mkdir()
    try:
        with Mount(root / "backing", root / "mnt", state_dir=root / "state", silly_rename=True) as mounted:
            yield mounted
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


class Case:
    """What one (command, code) case gets: a scratch directory, the share (asked for only when needed),
    and a place for the command's stderr."""

    def __init__(self, tmp: Path, request: pytest.FixtureRequest) -> None:
        self.tmp = tmp
        self._request = request

    @property
    def share(self) -> Mount:
        mount: Mount = self._request.getfixturevalue("share")
        return mount

    def on_share(self, name: str) -> Path:
        path = self.share.path / name
        path.mkdir()
        return path

    def hung(self, name: str, argv: list[str]) -> tuple[int, str]:
        """``argv`` stuck on the share (every operation under ``name`` hangs, as on an NFS server that
        stopped answering), then Ctrl-C."""
        mount = self.share
        mount.set_faults(hang=f"{name}*", hang_timeout=BOUND)
        proc = started(argv, self.tmp / "stderr.txt")
        try:
            return interrupted(
                proc,
                self.tmp / "stderr.txt",
                lambda: any(h["pid"] == proc.pid for h in mount.hung()),
                mount.release,
            )
        finally:
            mount.set_faults(hang=None)


def committed_root(root: Path) -> safeio.Checkpoints:
    ckpts = safeio.Checkpoints(root, keep=None)
    with ckpts.save(1) as ckpt:
        Path(ckpt.path, "w.bin").write_bytes(b"w" * 100)
    return ckpts


def saved(target: Path) -> Path:
    with safeio.replicated(target) as stage:
        Path(stage.path, "tokenizer.json").write_text("{}")
    return target


def missing_paths(c: Case, command: list[str]) -> list[tuple[int, str]]:
    """The situation every command reports alike: a path that names no directory (exit 2)."""
    (c.tmp / "file").write_text("x")
    return [run(*command, str(c.tmp / "missing")), run(*command, str(c.tmp / "file"))]


def expect_missing(outcomes: list[tuple[int, str]]) -> None:
    (code, out), (code2, out2) = outcomes
    assert code == 2 and "missing: no such file or directory" in out, out
    assert code2 == 2 and "file: not a directory" in out2, out2


# ---- doctor


def doctor_0(c: Case) -> None:
    code, out = run("doctor", str(c.tmp))
    assert code == 0 and "risks" in out, out


def doctor_1(c: Case) -> None:
    where = c.on_share("doctor1")
    c.share.set_faults(hang="*/rename-target", hang_timeout=0)  # the share fails that file at once (EIO)
    try:
        code, report = run("doctor", str(where), "--json")
    finally:
        c.share.set_faults(hang=None)
    probes = {p["name"]: p for p in json.loads(report[report.index("{") :])["probes"]}
    assert code == 1 and probes["rename_over"]["status"] == "fail", probes["rename_over"]
    assert os.listdir(where) == []


def doctor_2(c: Case) -> None:
    expect_missing(missing_paths(c, ["doctor"]))
    code, out = run("doctor", str(c.tmp), "--probe-timeout", "99")
    assert code == 2 and "--probe-timeout must be between" in out, out


def doctor_130(c: Case) -> None:
    where = c.on_share("doctor130")
    code, out = c.hung("doctor130", ["doctor", str(where)])
    assert code == 130 and "safeio doctor: interrupted" in out, out
    assert os.listdir(where) == []  # its scratch directory is gone


# ---- gc


def gc_0(c: Case) -> None:
    code, out = run("gc", str(c.tmp))
    assert code == 0 and "nothing to clean" in out, out


def gc_1(c: Case) -> None:
    """A dead writer's stage on the share, a file in it still open: NFS keeps it as .nfsXXXX, and the
    stage cannot go until the reader closes it."""
    where = c.on_share("gc1")
    stage = where / f".tok.safeio-stage-{host_tag()}-{dead_pid()}-0badc0de"
    stage.mkdir()
    (stage / "data.bin").write_bytes(b"d" * 100)
    with open(stage / "data.bin", "rb"):
        code, out = run("gc", str(where))
        assert code == 1 and f"{stage}: still in use" in out, out
    code, out = run("gc", str(where))
    assert code == 0 and not stage.exists(), out


def gc_2(c: Case) -> None:
    expect_missing(missing_paths(c, ["gc"]))
    code, out = run("gc", str(c.tmp), "--older-than", "soon")
    assert code == 2 and "not a duration" in out, out


def gc_130(c: Case) -> None:
    where = c.on_share("gc130")
    code, out = c.hung("gc130", ["gc", str(where)])
    assert code == 130 and "safeio gc: interrupted" in out, out


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---- verify


def verify_0(c: Case) -> None:
    code, out = run("verify", str(saved(c.tmp / "tok")))
    assert code == 0 and out.startswith("ok: "), out
    # A Trainer's checkpoint written without safeio, complete by its own marker: as in a root's verify.
    trainer = c.tmp / "checkpoint-4"
    trainer.mkdir()
    (trainer / "trainer_state.json").write_text('{"global_step": 4}')
    (trainer / "model.safetensors").write_bytes(b"w")
    code, out = run("verify", str(trainer))
    assert code == 0 and out.startswith(f"not checked: {trainer}: written-without-safeio-complete: "), out


def verify_1(c: Case) -> None:
    target = saved(c.tmp / "tok")
    (target / "tokenizer.json").write_text("{ }")
    code, out = run("verify", str(target))
    assert code == 1 and "FAILED" in out and "damaged" in out, out
    assert f"fix: save it again: the next safeio save of {target} replaces it" in out, out
    (c.tmp / "plain").mkdir()  # no marker of any kind
    code, out = run("verify", str(c.tmp / "plain"))
    assert code == 1 and "written-without-safeio-incomplete" in out, out
    # The filesystem failing under it is a problem found too (every command's 1), named with its path.
    where = c.on_share("verify1")
    saved(where / "tok")
    c.share.set_faults(hang="verify1/tok/tokenizer.json", hang_timeout=0)
    try:
        code, out = run("verify", str(where / "tok"))
    finally:
        c.share.set_faults(hang=None)
    assert code == 1 and "tokenizer.json" in out and "Traceback" not in out, out


def verify_2(c: Case) -> None:
    expect_missing(missing_paths(c, ["verify"]))  # "is not a directory" and 1, before
    code, out = run("verify", "memory://exit-codes/never")
    assert code == 2 and "memory://exit-codes/never: no such file or directory" in out, out
    code, out = run("verify", "")
    assert code == 2 and "empty" in out, out


def verify_130(c: Case) -> None:
    where = c.on_share("verify130")
    code, out = c.hung("verify130", ["verify", str(where)])
    assert code == 130 and "safeio verify: interrupted" in out, out


# ---- ls


def ls_0(c: Case) -> None:
    committed_root(c.tmp / "ckpts")
    code, out = run("ls", str(c.tmp / "ckpts"))
    assert code == 0 and "step_1 <- latest" in out, out


def ls_1(c: Case) -> None:
    root = c.tmp / "ckpts"
    committed_root(root)
    (root / "step_2").mkdir()
    (root / "latest").write_text("step_2")
    code, out = run("ls", str(root))
    assert code == 1 and "latest names 'step_2', which is not a committed checkpoint" in out, out
    where = c.on_share("ls1")
    c.share.set_faults(hang="ls1", hang_timeout=0)  # listing the root fails (EIO)
    try:
        code, out = run("ls", str(where))
    finally:
        c.share.set_faults(hang=None)
    assert code == 1 and "safeio ls: error: " in out and "Input/output error" in out, out
    assert "Traceback" not in out, out


def ls_2(c: Case) -> None:
    expect_missing(missing_paths(c, ["ls"]))


def ls_130(c: Case) -> None:
    where = c.on_share("ls130")
    code, out = c.hung("ls130", ["ls", str(where)])
    assert code == 130 and "safeio ls: interrupted" in out, out


# ---- demo

SMALL_DEMO = ["demo", "--ranks", "1", "--iterations", "1", "--local"]


def demo_1(c: Case) -> None:
    """The reader killed while the demo runs: the error names it, its pid and its signal."""
    work = c.tmp / "work"
    work.mkdir()
    err = c.tmp / "stderr.txt"
    proc = started(["demo", "--ranks", "1", "--iterations", "1000", "--local", "--tmpdir", str(work)], err)
    try:
        until(lambda: "reader: pid" in err.read_text(), proc, err)
        reader = int(re.findall(r"reader: pid (\d+)", err.read_text())[0])
        os.kill(reader, signal.SIGKILL)
        code = proc.wait(BOUND)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = err.read_text()
    assert code == 1 and f"the reader (pid {reader}) was killed by SIGKILL early" in out, out
    assert f"reader (pid {reader}, gone)" in out, out
    assert os.listdir(work) == []


def demo_2(c: Case) -> None:
    code, out = run("demo", "--tmpdir", str(c.tmp / "missing"))  # the same words as every path
    assert code == 2 and "missing: no such file or directory" in out, out
    code, out = run("demo", "--ranks", "65")
    assert code == 2 and "at most 64 ranks" in out, out


def demo_130(c: Case) -> None:
    work = c.tmp / "work"
    work.mkdir()
    err = c.tmp / "stderr.txt"
    proc = started([*SMALL_DEMO, "--tmpdir", str(work)], err)
    code, out = interrupted(proc, err, lambda: "starting 1 rank(s)" in err.read_text(), lambda: None)
    assert code == 130 and "interrupted" in out, out
    assert os.listdir(work) == []


# ---- audit report

_AUDITED_WRITER = """
import sys
from safeio._diagnostics.audit import audit
with audit(sys.argv[1], "record", sys.argv[2]):
    with open(sys.argv[1] + "/tokenizer_config.json", "w") as f:  # every rank truncates the same file
        f.write("{}")
"""


def audit_0(c: Case) -> None:
    code, out = run("audit", "report", str(c.tmp))
    assert code == 0, out


def audit_1(c: Case) -> None:
    (c.tmp / "shared").mkdir()
    (c.tmp / "records").mkdir()
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2"}
        argv = [sys.executable, "-c", _AUDITED_WRITER, str(c.tmp / "shared"), str(c.tmp / "records")]
        subprocess.run(argv, env=env, check=True, timeout=BOUND)
    code, out = run("audit", "report", str(c.tmp / "records"))
    assert code == 1 and "tokenizer_config.json" in out, out


def audit_2(c: Case) -> None:
    expect_missing(missing_paths(c, ["audit", "report"]))


def audit_130(c: Case) -> None:
    where = c.on_share("audit130")
    code, out = c.hung("audit130", ["audit", "report", str(where)])
    assert code == 130 and "safeio audit: interrupted" in out, out


# ---- autopatch


def autopatch_1(c: Case) -> None:
    code, out = run("autopatch", env={"SAFEIO_PATCH": "bogus"})  # names no part: nothing patched
    assert code == 1 and "is patched: NO (SAFEIO_PATCH='bogus' names no part (unknown: bogus)" in out, out


def autopatch_2(c: Case) -> None:
    code, out = run("autopatch", "--frobnicate")
    assert code == 2 and "unrecognized arguments" in out, out
    # Without transformers: the same code as the demo's missing dependencies (a process in which it
    # cannot be imported, as where it is not installed).
    absent = "import sys; sys.modules['transformers'] = None; from safeio.cli import main; sys.exit(main(['autopatch']))"
    done = subprocess.run([sys.executable, "-c", absent], capture_output=True, text=True, timeout=BOUND)
    assert done.returncode == 2 and "transformers is not installed" in done.stderr, done.stderr


def autopatch_130(c: Case) -> None:
    err = c.tmp / "stderr.txt"
    proc = started(["autopatch"], err)

    def probing() -> bool:  # its fresh interpreter is running
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            return bool(f.read().split())

    code, out = interrupted(proc, err, probing, lambda: None)
    assert code == 130 and "safeio autopatch: interrupted" in out, out


def covered_by(test: str, assertion: str) -> Callable[[Case], None]:
    """A case another test of the suite runs already (a full demo, a probe importing transformers: 10 s
    each on a loaded machine): that test exists and asserts this exit code."""

    def check(_: Case) -> None:
        path, name = test.split("::")
        source = (Path(__file__).resolve().parent.parent / path).read_text()
        (found,) = [
            node
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef) and node.name == name
        ]
        assert assertion in (ast.get_source_segment(source, found) or ""), (test, assertion)

    return check


CASES: dict[tuple[str, int], Callable[[Case], None]] = {
    ("doctor", 0): doctor_0,
    ("doctor", 1): doctor_1,
    ("doctor", 2): doctor_2,
    ("doctor", 130): doctor_130,
    ("gc", 0): gc_0,
    ("gc", 1): gc_1,
    ("gc", 2): gc_2,
    ("gc", 130): gc_130,
    ("verify", 0): verify_0,
    ("verify", 1): verify_1,
    ("verify", 2): verify_2,
    ("verify", 130): verify_130,
    ("ls", 0): ls_0,
    ("ls", 1): ls_1,
    ("ls", 2): ls_2,
    ("ls", 130): ls_130,
    ("demo", 0): covered_by("tests/test_cli_demo.py::test_demo_local", "assert code == 0"),
    ("demo", 1): demo_1,
    ("demo", 2): demo_2,
    ("demo", 130): demo_130,
    ("audit report", 0): audit_0,
    ("audit report", 1): audit_1,
    ("audit report", 2): audit_2,
    ("audit report", 130): audit_130,
    ("autopatch", 0): covered_by(
        "tests/test_autopatch.py::test_safeio_autopatch_reports_the_hook_and_a_patched_process",
        "assert done.returncode == 0",
    ),
    ("autopatch", 1): autopatch_1,
    ("autopatch", 2): autopatch_2,
    ("autopatch", 130): autopatch_130,
}


def documented() -> list[tuple[str, int]]:
    rows = {row[0].strip("`"): row[1:] for row in docs_table("## Exit codes")}
    pairs = []
    for command in COMMANDS:
        cells = [own if own != "—" else every for own, every in zip(rows[command], rows[EVERY], strict=True)]
        pairs.extend((command, code) for code, cell in zip(HEADINGS, cells, strict=True) if cell != "—")
    return pairs


def test_every_documented_code_has_its_case() -> None:
    assert sorted(documented()) == sorted(CASES)
    assert sorted(documented()) == sorted((c, code) for c in COMMANDS for code in codes_of(c))


@pytest.mark.parametrize(("command", "code"), sorted(CASES))
def test_each_documented_exit_code_happens(
    command: str, code: int, shared_dir: Path, request: pytest.FixtureRequest
) -> None:
    CASES[command, code](Case(shared_dir, request))
