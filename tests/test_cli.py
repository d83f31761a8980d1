"""The ``safeio`` command: doctor, gc, verify, audit report; exit codes, --help, --json, bad input."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import safeio
from safeio._storage.mounts import mount_of
from safeio._storage.names import host_tag
from safeio.cli import main

NOBODY = 65534


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The real entry point, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "safeio", *args], capture_output=True, text=True, timeout=timeout
    )


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
    code = main([*args, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def probes(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in report["probes"]}


def verdicts(report: dict[str, Any]) -> dict[str, str]:
    return {v["risk"]: v["status"] for v in report["verdicts"]}


# ---------------------------------------------------------------------------------------------------
# The command itself


@pytest.mark.parametrize(
    "argv", [[], ["doctor"], ["gc"], ["verify"], ["demo"], ["audit"], ["audit", "report"]]
)
def test_help_everywhere_documents_exit_codes(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    assert main([*argv, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: safeio") and "exit codes:" in out and "130" in out


def test_entry_point_runs_as_a_module_and_reports_usage_errors() -> None:
    done = cli("--help")
    assert done.returncode == 0 and "doctor" in done.stdout and "demo" in done.stdout
    done = cli("frobnicate")
    assert done.returncode == 2 and "invalid choice" in done.stderr
    done = cli("gc", ".", "--older-than", "soon")
    assert done.returncode == 2 and "not a duration" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), ("45s", 45), ("30m", 1800), ("2h", 7200), ("1.5d", 129600), ("1w", 604800)],
)
def test_durations(text: str, seconds: float) -> None:
    from safeio.cli._common import parse_duration

    assert parse_duration(text) == seconds


# ---------------------------------------------------------------------------------------------------
# doctor


def test_doctor_on_local_disk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = run_json(capsys, "doctor", str(tmp_path))
    assert code == 0 and report["ok"]
    fs = report["filesystem"]
    assert fs["fs_type"] == mount_of(str(tmp_path)).fs_type and fs["is_network"] is False  # type: ignore[union-attr]
    p = probes(report)
    for name in ("rename_over", "exclusive_create", "flock", "posix"):
        assert p[name]["status"] == "ok", p[name]
    assert p["fsync"]["seconds"] > 0 and len(p["fsync"]["data"]["samples"]) == 5
    assert p["visibility"]["data"]["elapsed"]["new"] is not None
    assert verdicts(report)["locks that do not exclude across clients"] == "absent"
    assert report["seconds"] < 5
    assert os.listdir(tmp_path) == []  # the scratch directory is gone


@contextlib.contextmanager
def tmpfs_dir() -> Iterator[Path]:
    shm = mount_of("/dev/shm")
    if shm is not None and shm.fs_type == "tmpfs" and os.access("/dev/shm", os.W_OK):
        path = Path(tempfile.mkdtemp(dir="/dev/shm"))
        try:
            yield path
        finally:
            path.rmdir()
        return
    path = Path(tempfile.mkdtemp())
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(path)], capture_output=True).returncode != 0:
        path.rmdir()
        pytest.skip("no tmpfs: /dev/shm is not tmpfs and mounting one failed (not root?)")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)
        path.rmdir()


def test_doctor_on_tmpfs(capsys: pytest.CaptureFixture[str]) -> None:
    with tmpfs_dir() as path:
        code, report = run_json(capsys, "doctor", str(path))
        assert code == 0
        assert report["filesystem"]["fs_type"] == "tmpfs" and report["filesystem"]["kind"] == "memory"
        assert probes(report)["exchange"]["status"] == "ok"  # tmpfs supports RENAME_EXCHANGE
        assert verdicts(report)["no atomic directory exchange"] == "absent"
        assert os.listdir(path) == []


def test_doctor_text_report_on_local_disk(tmp_path: Path) -> None:
    done = cli("doctor", str(tmp_path))
    assert done.returncode == 0, done.stderr
    for heading in ("filesystem", "probes", "risks", "covered by:", "fsync latency", "flock"):
        assert heading in done.stdout
    assert os.listdir(tmp_path) == []


@pytest.mark.fuse_opts(entry_timeout=1.0, attr_timeout=1.0, negative_timeout=1.0)
def test_doctor_on_the_nfslike_mount(nfslike_mount: Any, capsys: pytest.CaptureFixture[str]) -> None:
    a = nfslike_mount
    code, report = run_json(capsys, "doctor", str(a.path))
    assert code == 0
    fs = report["filesystem"]
    assert fs["fs_type"] == "fuse.nfslike" and fs["kind"] == "fuse" and fs["is_network"]
    assert "FUSE" in fs["label"]
    # The configured cache timeouts, read from the daemon's command line.
    assert "entry_timeout 1 s" in fs["settings"]["cache timeouts"]
    assert "attr_timeout 1 s" in fs["settings"]["cache timeouts"]
    assert fs["cache_window"] == 1.0
    p = probes(report)
    assert p["exchange"]["status"] == "unsupported"  # refused like NFS, not silently dropped
    assert p["rename_over"]["status"] == "ok"
    assert verdicts(report)["no atomic directory exchange"] == "present"
    assert verdicts(report)["stale-cache windows"] == "present"
    assert report["seconds"] < 5
    assert os.listdir(a.path) == []


@pytest.mark.fuse_opts(entry_timeout=1.0, attr_timeout=1.0, negative_timeout=1.0)
def test_doctor_observes_cache_timeouts_through_a_peer_mount(
    nfslike_clients: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = nfslike_clients
    code, report = run_json(capsys, "doctor", str(a.path), "--peer-path", str(b.path))
    assert code == 0
    visibility = probes(report)["visibility"]
    elapsed = visibility["data"]["elapsed"]
    assert visibility["data"]["cross_client"] is True
    assert elapsed["new"] < 0.5  # never looked up on the peer: nothing cached
    # The peer looked these names up first; its caches hide the change for about the 1 s timeouts.
    for what in ("negative", "removed", "grown"):
        assert 0.5 < elapsed[what] < 1.9, (what, elapsed)
    assert verdicts(report)["stale-cache windows"] == "present"
    assert report["seconds"] < 5
    assert os.listdir(a.path) == [] and os.listdir(b.path) == []


def classify(fs_type: str, options: str, source: str = "server:/export") -> Any:
    from safeio._storage.mounts import MountInfo
    from safeio.cli._fsinfo import classify as classify_mount

    return classify_mount("/ckpt", MountInfo("/ckpt", fs_type, source, tuple(options.split(","))))


def test_nfs_mount_options_are_interpreted() -> None:
    info = classify("nfs4", "rw,relatime,vers=4.2,hard,proto=tcp,timeo=600,retrans=2,local_lock=none")
    assert info.kind == "nfs" and info.label == "NFS v4.2" and info.is_network
    assert info.settings["hard/soft"] == "hard" and info.lock_scope == "cluster"
    assert info.settings["lookupcache"] == "all (default)"
    assert info.cache_window == 60.0 and "nfs(5) defaults" in info.settings["attribute cache"]
    assert any("hard mount" in n for n in info.notes)

    info = classify("nfs", "rw,vers=3,soft,nolock,actimeo=5,lookupcache=positive")
    assert info.settings["hard/soft"] == "soft" and info.lock_scope == "local"
    assert info.settings["locks"] == "nolock" and info.cache_window == 5.0
    assert "files 5-5 s, directories 5-5 s (actimeo)" in info.settings["attribute cache"]
    assert info.settings["lookupcache"] == "positive"

    info = classify("nfs", "rw,vers=3,hard,local_lock=flock,acregmin=1,acdirmax=10,noac")
    assert info.lock_scope == "local" and info.settings["locks"] == "local_lock=flock"
    assert info.cache_window == 0.0 and info.settings["attribute cache"] == "noac (off)"


@pytest.mark.parametrize(
    ("fs_type", "options", "kind", "lock_scope"),
    [
        ("lustre", "rw,flock", "lustre", "cluster"),
        ("lustre", "rw,localflock", "lustre", "local"),
        ("gpfs", "rw", "gpfs", "cluster"),
        ("cifs", "rw,vers=3.0,nobrl,actimeo=2", "cifs", "local"),
        ("overlay", "rw,lowerdir=/a,upperdir=/b", "overlay", "n/a"),
        ("xfs", "rw", "local", "n/a"),
        ("fuse.sshfs", "rw,user_id=0", "fuse", "unknown"),
    ],
)
def test_other_filesystems_are_classified(fs_type: str, options: str, kind: str, lock_scope: str) -> None:
    info = classify(fs_type, options)
    assert info.kind == kind and info.lock_scope == lock_scope
    assert info.is_network == (kind in ("lustre", "gpfs", "cifs", "fuse"))


def test_fuse_daemon_timeouts_from_its_command_line() -> None:
    from safeio.cli._fsinfo import _timeouts_from_argv

    argv = ["sshfs", "h:/x", "/mnt", "-o", "entry_timeout=3,attr_timeout=2.5,ro", "--negative-timeout", "1"]
    assert _timeouts_from_argv(argv) == {"entry_timeout": 3.0, "attr_timeout": 2.5, "negative_timeout": 1.0}
    assert _timeouts_from_argv(["daemon", "-oattr_timeout=7", "--entry-timeout=4"]) == {
        "attr_timeout": 7.0,
        "entry_timeout": 4.0,
    }


def test_doctor_peer_path_must_show_the_same_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    code = main(["doctor", str(tmp_path / "a"), "--peer-path", str(tmp_path / "b"), "--probe-timeout", "0.2"])
    err = capsys.readouterr().err
    assert code == 2 and "must be the same directory" in err
    assert os.listdir(tmp_path / "a") == []


def run_as_nobody(argv: list[str], out: Path) -> tuple[int, str]:
    """``main(argv)`` as uid/gid 65534, in a forked child.

    A subprocess cannot drop privileges here: the interpreter lives under /root (0700), which uid
    65534 cannot reach. A fork already has the interpreter loaded.
    """
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 99
        try:
            with open(out, "w") as f:
                sys.stdout = sys.stderr = f
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                code = main(argv)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.read_text()


def test_doctor_bad_input(shared_dir: Path, tmp_path: Path) -> None:
    done = cli("doctor", str(tmp_path / "missing"))
    assert done.returncode == 2 and "no such file or directory" in done.stderr
    (tmp_path / "file").write_text("x")
    done = cli("doctor", str(tmp_path / "file"))
    assert done.returncode == 2 and "not a directory" in done.stderr
    for result in (done,):
        assert "Traceback" not in result.stderr + result.stdout
    # No write permission: a root-owned 0755 directory, probed as uid 65534.
    locked = shared_dir / "readonly"
    locked.mkdir(mode=0o755)
    code, text = run_as_nobody(["doctor", str(locked)], tmp_path / "out.txt")
    assert code == 2, text
    assert "no write permission" in text and "Traceback" not in text
    assert os.listdir(locked) == []


# ---------------------------------------------------------------------------------------------------
# gc

_KILLED_WRITER = """
import pathlib, sys
import safeio
with safeio.replicated(sys.argv[1]) as stage:
    pathlib.Path(stage.path, "tokenizer.json").write_text("x" * 5000)
    # What NFS leaves when a reader still had a removed file open: gc removes it with its stage.
    pathlib.Path(stage.path, ".nfs00000000000a0001").write_text("silly")
    print(stage.path, flush=True)
    sys.stdin.read()
"""

_LEASE_HOLDER = """
import sys
from safeio._storage.locking import make_lock
lock = make_lock(sys.argv[1], "lease", 5)
lock.acquire()
print(lock.lock_file, flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def process(code: str, *args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A Python process running ``code``; yields it and the first line it printed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line, f"the helper process exited early ({proc.wait()})"
        yield proc, line
    finally:
        proc.kill()
        proc.wait()


def killed(code: str, *args: str) -> str:
    with process(code, *args) as (proc, line):
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return line


def make_sibling(
    parent: Path, base: str, kind: str, pid: int, host: str | None = None, rand: str = "0badc0de"
) -> Path:
    path = parent / f".{base}.safeio-{kind}-{host or host_tag()}-{pid}-{rand}"
    path.mkdir()
    (path / "data.bin").write_bytes(b"d" * 1000)
    return path


def test_gc_removes_only_stale_safeio_leftovers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    (root / "step_1").mkdir(parents=True)
    dead = dead_pid()
    # Real leftovers: a writer killed inside its body, and a lease holder killed while holding it.
    stale_stage = Path(killed(_KILLED_WRITER, str(root / "step_1" / "tokenizer")))
    stale_lock = Path(killed(_LEASE_HOLDER, str(root / ".tokenizer.safeio.lock")))
    assert stale_stage.is_dir() and stale_lock.is_file()
    stage_bytes = 5000 + len("silly")
    # An old version renamed aside by a writer that died before the new one went in: put back.
    aside = make_sibling(root, "config", "old", dead)
    # Another host's stage: its owner cannot be probed from here.
    foreign = make_sibling(root, "tokenizer", "stage", 4242, host=host_tag("another-host"))
    # Look-alikes safeio did not create, and things that are safeio's but must stay.
    look_alikes = [
        f"tokenizer.safeio-stage-{host_tag()}-{dead}-deadbeef",  # no leading dot
        f".tokenizer.safeio-stage-{host_tag()}-{dead}-DEADBEEF",  # not lower-case hex
        f".tokenizer.safeio-stage-{host_tag()}-{dead}-deadbeef.bak",
        f".tokenizer.safeio-staging-{host_tag()}-{dead}-deadbeef",
        f".tokenizer.safeio-stage-{host_tag()}-12x-deadbeef",
        ".nfs000000000000abcd",
        "notes.safeio-stage.txt",
    ]
    for name in look_alikes:
        (root / name).write_text("mine")
    (root / ".tokenizer.safeio.lock.bak").write_text(f"filelock/2\npid={dead}\nhost=x\n")
    (root / ".model.safeio.lock").write_text("")  # flock's lock file: never removed
    (root / ".other.safeio.lock").write_text("hello\n")  # not a soft-lock marker
    # A symlink out of PATH to a directory with a real stale stage: gc must not follow it.
    outside = tmp_path / "outside"
    outside.mkdir()
    outside_stage = make_sibling(outside, "tok", "stage", dead)
    (root / "link").symlink_to(outside)

    with process(_KILLED_WRITER, str(root / "step_1" / "live")) as (_live, live_line):
        live_stage = Path(live_line)
        with process(_LEASE_HOLDER, str(root / ".live.safeio.lock")) as (_holder, live_lock_line):
            live_lock = Path(live_lock_line)
            before = sorted(p.name for p in root.rglob("*"))

            code, dry = run_json(capsys, "gc", str(root), "--dry-run")
            assert code == 0 and dry["dry_run"]
            assert sorted(p.name for p in root.rglob("*")) == before  # nothing changed
            assert {a["path"] for a in dry["actions"]} == {str(stale_stage), str(stale_lock), str(aside)}
            assert dry["freed_bytes"] >= stage_bytes

            code, report = run_json(capsys, "gc", str(root))
            assert code == 0, report
            verbs = {a["path"]: a["verb"] for a in report["actions"]}
            assert verbs == {str(stale_stage): "remove", str(stale_lock): "remove", str(aside): "restore"}
            assert {a["state"] for a in report["actions"]} == {"stale"}
            assert report["freed_bytes"] >= stage_bytes
            assert not stale_stage.exists() and not stale_lock.exists()
            assert (root / "config" / "data.bin").exists()  # the old version was put back
            kept = {k["path"]: k["detail"] for k in report["kept"]}
            assert "alive" in kept[str(live_stage)] and "live pid" in kept[str(live_lock)]
            assert "another host" in kept[str(foreign)]
            states = {k["path"]: (k["state"], k["fix"]) for k in report["kept"]}
            assert states[str(live_stage)] == states[str(live_lock)] == ("in-progress", None)
            assert states[str(foreign)] == (
                "other-host",
                f"`safeio gc {root} --older-than 1d` removes it "
                "once it is older than that (choose an age no save of yours lasts)",
            )
            assert live_stage.is_dir() and live_lock.is_file() and foreign.is_dir()
            for name in [
                *look_alikes,
                ".tokenizer.safeio.lock.bak",
                ".model.safeio.lock",
                ".other.safeio.lock",
            ]:
                assert (root / name).exists(), name
            assert outside_stage.is_dir()

            # With an age, another host's leftovers go too; a live owner's stage still never does.
            done = cli("gc", str(root), "--older-than", "0s")
            assert done.returncode == 0 and "freed" in done.stdout
            assert not foreign.exists() and live_stage.is_dir() and live_lock.is_file()
            assert outside_stage.is_dir()


def test_gc_older_than_keeps_young_leftovers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stage = make_sibling(tmp_path, "tok", "stage", dead_pid())
    code, report = run_json(capsys, "gc", str(tmp_path), "--older-than", "1h")
    assert code == 0 and report["actions"] == [] and stage.is_dir()
    assert "younger" in report["kept"][0]["detail"] and report["kept"][0]["state"] == "stale"
    assert report["kept"][0]["fix"].startswith(f"`safeio gc {tmp_path}` removes it")
    code = main(["gc", str(tmp_path)])
    assert code == 0 and not stage.exists()
    assert "freed 1000 B" in capsys.readouterr().out


def test_gc_nothing_to_do_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gc", str(tmp_path)]) == 0
    assert "nothing to clean" in capsys.readouterr().out
    (tmp_path / "f").write_text("x")
    assert main(["gc", str(tmp_path / "f")]) == 2
    assert main(["gc", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "not a directory" in err and "no such file" in err


# ---------------------------------------------------------------------------------------------------
# verify


def save(target: Path) -> None:
    with safeio.replicated(target) as stage:
        Path(stage.path, "tokenizer.json").write_text('{"vocab": [1, 2, 3]}')
        Path(stage.path, "sub").mkdir()
        Path(stage.path, "sub", "config.json").write_text("{}")


def test_verify_complete_damaged_and_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "tok"
    save(target)
    code, report = run_json(capsys, "verify", str(target))
    assert code == 0 and report["ok"] and report["files"] == 2 and report["hashes_checked"]
    done = cli("verify", str(target))
    assert done.returncode == 0 and done.stdout.startswith("ok:")

    (target / "tokenizer.json").write_text('{"vocab": [1, 2, 4]}')  # same size, other bytes
    code, report = run_json(capsys, "verify", str(target))
    assert code == 1 and report["problems"] == ["xxh3_128 mismatch: tokenizer.json"]
    assert main(["verify", str(target), "--no-hashes"]) == 0  # sizes still match
    capsys.readouterr()

    (target / "tokenizer.json").write_text("{}")
    code, report = run_json(capsys, "verify", str(target))
    assert code == 1 and "size mismatch: tokenizer.json" in report["problems"][0]

    (target / "sub" / "config.json").unlink()
    (target / "extra.txt").write_text("written in place")
    code, report = run_json(capsys, "verify", str(target))
    assert code == 1 and "missing: sub/config.json" in report["problems"]
    assert report["unlisted"] == ["extra.txt"]

    # A path that names nothing is bad input, worded and numbered as ls and gc do (it was exit 1 here).
    done = cli("verify", str(tmp_path / "nowhere"))
    assert done.returncode == 2 and f"{tmp_path / 'nowhere'}: no such file or directory" in done.stderr
    assert "Traceback" not in done.stderr


def test_verify_object_store_commits(capsys: pytest.CaptureFixture[str]) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    try:
        with safeio.replicated("memory://cli-bucket/done") as stage:
            Path(stage.path, "tokenizer.json").write_text("{}")
        code, report = run_json(capsys, "verify", "memory://cli-bucket/done")
        assert code == 0 and report["files"] == 1

        fs.pipe("/cli-bucket/partial/tokenizer.json", b"{}")  # an upload that never wrote its marker
        code, report = run_json(capsys, "verify", "memory://cli-bucket/partial")
        assert code == 1 and report["problems"][0].startswith("incomplete commit: 1 object(s)")
        assert report["state"] == "uncommitted" and report["fix"] is not None

        assert main(["verify", "memory://cli-bucket/never"]) == 2  # nothing there: as a missing directory
        assert "memory://cli-bucket/never: no such file or directory" in capsys.readouterr().err
    finally:
        fs.rm("/cli-bucket", recursive=True)


def test_verify_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", ""]) == 2
    assert "empty" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# audit report


_AUDITED_WRITER = """
import sys
from safeio._diagnostics.audit import audit
with audit(sys.argv[1], "record", sys.argv[2]):
    with open(sys.argv[1] + "/tokenizer_config.json", "w") as f:  # every rank truncates the same file
        f.write("{}")
"""


def test_audit_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "report", str(tmp_path / "missing")]) == 2
    capsys.readouterr()
    records = tmp_path / "records"
    records.mkdir()
    code = main(["audit", "report", str(records), "--json"])
    captured = capsys.readouterr()
    if importlib.util.find_spec("safeio._diagnostics.audit") is None:
        assert code == 2 and "audit sanitizer is not available" in captured.err
        return
    assert code == 0, captured  # no records, no conflicts
    assert json.loads(captured.out)["conflicts"] == []
    shared = tmp_path / "shared"
    shared.mkdir()
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2"}
        subprocess.run(
            [sys.executable, "-c", _AUDITED_WRITER, str(shared), str(records)], env=env, check=True
        )
    code = main(["audit", "report", str(records), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["conflicts"], report
    done = cli("audit", "report", str(records))
    assert done.returncode == 1 and "tokenizer_config.json" in done.stdout


def test_a_lock_timeout_names_the_lease_holder_read_as_a_marker(tmp_path: Path) -> None:
    """The holder in a LockTimeout comes from the marker, read without following a link or blocking."""
    target = tmp_path / "ckpt"
    lock_path = tmp_path / ".ckpt.safeio.lock"
    with safeio.replicated(target, lock="lease", timeout=5) as stage:  # a first save takes no lock
        Path(stage.path, "f").write_text("old")
    with process(_LEASE_HOLDER, str(lock_path)) as (holder, _):
        with (
            pytest.raises(safeio.LockTimeout) as caught,
            safeio.replicated(target, lock="lease", timeout=1) as stage,
        ):
            Path(stage.path, "f").write_text("x")
        assert caught.value.holder is not None and f"pid {holder.pid} on " in caught.value.holder
        assert str(lock_path) in str(caught.value)
    assert (target / "f").read_text() == "old"
