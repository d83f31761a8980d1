"""What a hostile or careless user of a shared directory can plant, and what safeio must do about it.

Each case is a function of a `Share`: a group-writable parent (on local disk or the NFS-like mount) in
which the case plants what it likes, and an ``outside`` sentinel tree beside it standing for what the
victim owns elsewhere (a private key, ``~/.ssh``). The case plays both parts in one process, attacker
and victim (a save, ``safeio gc``, ``safeio verify``), and raises AssertionError on an unsafe outcome.
`run_cases` checks around every case that nothing outside the share changed (every name, type, mode,
owner, size and content under the case's directory, the share excepted) and bounds it by its progress
(`tests._stall.stall_alarm`: a case that does nothing for 30 s has hung; one that works may take longer).

Cases named ``baseline_*`` show the failure the matching case prevents, done the naive way (a path join,
a blocking ``open``, a ``chmod`` by path): they assert the unsafe outcome does happen, and are exempt from
the sentinel check since changing the sentinel is their point.

`tests/test_hostile_share.py` runs every case in a forked child as root and as uid 65534, on local disk
and on the NFS-like mount. Numbers in the case names are those of issue 13's list.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import secrets
import signal
import stat
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safeio
from safeio._storage.manifest import MANIFEST_NAME, MERGE_INTENT_KEY, MERGE_INTENT_NAME
from safeio._storage.names import host_tag, lock_name, parse
from safeio.cli import main as cli_main
from tests._stall import Hung, stall_alarm

# A case that made no progress (no CPU time, no request answered) for this long has hung: a FIFO opened
# blindly waits for ever. Not a wall-clock bound: under load a working case may take minutes (issue 37).
STALL_SECONDS = 30
CASE_CEILING = 600  # wall time, for a case that spins for ever; far above what load does to a case
PRIVATE = b"-----BEGIN OPENSSH PRIVATE KEY-----\nnot really\n"


@dataclass
class Share:
    root: Path  # the case's own directory on local disk (share and outside are in it, or on the mount)
    share: Path  # the shared parent every target of the case lives in
    outside: Path  # the victim's files elsewhere: never to be read into the share, moved or changed
    privileged: bool  # running as root (who ignores file modes)

    @property
    def key(self) -> Path:
        return self.outside / "id_rsa"


CASES: dict[str, Callable[[Share], None]] = {}
ROOT_ONLY = {"case5_gc_keeps_a_live_save_in_another_pid_namespace"}  # creating a PID namespace needs root
UNPRIVILEGED_ONLY = {  # root ignores file modes, so nothing here can be made to fail for it
    "case7_partial_merge_keeps_its_intent_and_rolls_forward",
    "case7_replace_succeeds_when_the_old_version_cannot_be_removed",
}


def case(fn: Callable[[Share], None]) -> Callable[[Share], None]:
    CASES[fn.__name__] = fn
    return fn


# ---- helpers ------------------------------------------------------------------------------------


def make_outside(outside: Path) -> None:
    outside.mkdir()
    (outside / "id_rsa").write_bytes(PRIVATE)
    (outside / "id_rsa").chmod(0o600)
    (outside / ".ssh").mkdir(mode=0o700)
    (outside / ".ssh" / "authorized_keys").write_text("ssh-ed25519 AAAA victim\n")
    (outside / "dir").mkdir()
    (outside / "dir" / "secret").write_text("root-only secret\n")
    (outside / "dir" / "secret").chmod(0o600)


def tree_state(root: Path, skip: Path | None = None) -> dict[str, tuple[Any, ...]]:
    """Everything observable under ``root`` (links not followed, FIFOs not opened)."""
    state: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if skip is not None:
            dirnames[:] = [d for d in dirnames if Path(dirpath, d) != skip]
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            st = os.lstat(path)
            content: Any = None
            if stat.S_ISREG(st.st_mode):
                content = hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                content = os.readlink(path)
            state[str(path.relative_to(root))] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, content)
    return state


def dead_pid() -> int:
    """A pid that was just used and is now free (a reaped child)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def stale_sibling(parent: Path, target_name: str, kind: str = "stage") -> Path:
    """A sibling named as a dead writer of ``target_name`` on this host would have named it."""
    return parent / f".{target_name}.safeio-{kind}-{host_tag()}-{dead_pid()}-{secrets.token_hex(4)}"


def cli(*argv: str) -> tuple[int, str]:
    """``safeio ARGV`` in this process, its exit code and everything it printed (stdout and stderr)."""
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile() as out:
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            stream = io.TextIOWrapper(os.fdopen(os.dup(1), "wb"), write_through=True)
            with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
                try:
                    code = cli_main(list(argv))
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 2
            stream.close()
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        text = out.read().decode(errors="replace")
    assert "Traceback" not in text, f"safeio {' '.join(argv)} printed a traceback:\n{text}"
    return code, text


def save(target: Path, files: dict[str, str], **options: Any) -> None:
    """A real single-process save of ``files`` (relative names) into ``target``."""
    options.setdefault("timeout", 10)
    with safeio.replicated(target, **options) as stage:
        for rel, text in files.items():
            path = Path(stage.path, rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


def raises(kind: type[BaseException], fn: Callable[[], object]) -> BaseException:
    try:
        fn()
    except kind as exc:
        return exc
    raise AssertionError(f"expected {kind.__name__}")


def read_tree(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): p.read_text()
        for p in sorted(path.rglob("*"))
        if p.is_file() and not p.is_symlink() and not p.name.startswith(".safeio-")
    }


def checkpoint(share: Share, name: str = "ckpt", **options: Any) -> Path:
    target = share.share / name
    save(target, {"a.txt": "old a", "sub/b.txt": "old b"}, mode="merge", **options)
    return target


def siblings(parent: Path, kind: str | None = None) -> list[str]:
    found = [p.name for p in parent.iterdir() if parse(p.name) is not None]
    return [n for n in found if kind is None or ((parsed := parse(n)) is not None and parsed.kind == kind)]


# ---- 1. recovery trusts the merge intent --------------------------------------------------------


def _crafted_merge(share: Share, target_name: str, files: list[str]) -> Path:
    stage = stale_sibling(share.share, "ckpt")
    stage.mkdir()
    (stage / "x").write_text("planted")
    (stage / MERGE_INTENT_NAME).write_text(json.dumps({"target_name": target_name, "files": files}))
    return stage


def _intents(share: Share) -> list[tuple[str, list[str]]]:
    return [
        (str(share.outside / "dir"), ["x"]),  # an absolute target
        ("../escaped", ["x"]),
        ("a/b", ["x"]),
        ("ckpt", [os.path.relpath(share.key, share.share / "ckpt")]),  # would move the key into the share
        ("ckpt", [str(share.key)]),
        ("ckpt", ["sub/../../escaped2"]),
        ("ckpt", ["x\0y"]),
    ]


@case
def case1_gc_never_follows_a_crafted_intent(share: Share) -> None:
    checkpoint(share)
    for target_name, files in _intents(share):
        _crafted_merge(share, target_name, files)
    code, dry = cli("gc", "--dry-run", str(share.share))
    assert code in (0, 1), dry
    before = tree_state(share.share)
    code, text = cli("gc", "--json", str(share.share))
    assert code in (0, 1), text
    report = json.loads(text[text.index("{") :])
    assert not siblings(share.share, "stage"), text
    # --dry-run listed exactly what the real run did, and changed nothing itself.
    assert before  # (the dry run ran before the snapshot; its effect would show in the real report)
    for action in report["actions"]:
        assert action["path"] in dry, (action, dry)
    assert read_tree(share.share / "ckpt") == {"a.txt": "old a", "sub/b.txt": "old b"}


@case
def case1_merge_save_never_follows_a_crafted_intent(share: Share) -> None:
    target = checkpoint(share)
    for target_name, files in _intents(share):
        _crafted_merge(share, target_name, files)
    save(target, {"a.txt": "new a"}, mode="merge")
    assert read_tree(target) == {"a.txt": "new a", "sub/b.txt": "old b"}
    assert safeio.verify(target) == []


@case
def case1_gc_dry_run_is_read_only(share: Share) -> None:
    checkpoint(share)
    for target_name, files in _intents(share):
        _crafted_merge(share, target_name, files)
    good = stale_sibling(share.share, "ckpt")  # a genuine interrupted merge: rolled forward for real
    (good / "sub").mkdir(parents=True)
    (good / "sub" / "b.txt").write_text("new b")
    (good / MERGE_INTENT_NAME).write_text(json.dumps({"target_name": "ckpt", "files": ["sub/b.txt"]}))
    before = tree_state(share.share)
    code, dry = cli("gc", "--dry-run", "--json", str(share.share))
    assert code in (0, 1), dry
    assert tree_state(share.share) == before, "gc --dry-run changed the share"
    code, real = cli("gc", "--json", str(share.share))
    assert code in (0, 1), real

    def paths(text: str) -> list[tuple[str, str]]:
        report = json.loads(text[text.index("{") :])
        return sorted((a["verb"], a["path"]) for a in report["actions"])

    assert paths(dry) == paths(real)
    assert ("roll-forward", str(good)) in paths(real)
    assert read_tree(share.share / "ckpt") == {"a.txt": "old a", "sub/b.txt": "new b"}


@case
def baseline_1_naive_roll_forward_moves_the_key_into_the_share(share: Share) -> None:
    stage = _crafted_merge(share, "ckpt", [os.path.relpath(share.key, share.share / "ckpt")])
    intent = json.loads((stage / MERGE_INTENT_NAME).read_text())
    (share.share / "ckpt").mkdir()
    for rel in intent["files"]:  # what recovery did before: trust the names, join, rename
        os.replace(os.path.join(share.share, intent["target_name"], rel), share.share / "ckpt" / "stolen")
    assert (share.share / "ckpt" / "stolen").read_bytes() == PRIVATE
    assert not share.key.exists()


# ---- 2. symlinks ----------------------------------------------------------------------------------


@case
def case2_merge_refuses_a_symlinked_subdirectory_in_the_target(share: Share) -> None:
    target = checkpoint(share)
    os.symlink(share.outside / ".ssh", target / "planted")
    exc = raises(
        safeio.SafeIOError, lambda: save(target, {"planted/authorized_keys": "attacker"}, mode="merge")
    )
    assert str(target) in str(exc) and "symlink" in str(exc), exc
    assert read_tree(target) == {"a.txt": "old a", "sub/b.txt": "old b"}
    assert not siblings(share.share, "stage"), "a refused merge leaves nothing behind"


@case
def baseline_2_naive_write_follows_a_planted_symlink(share: Share) -> None:
    target = share.share / "ckpt"
    target.mkdir()
    os.symlink(share.outside / ".ssh", target / "planted")
    Path(target, "planted", "authorized_keys").write_text("attacker")
    assert (share.outside / ".ssh" / "authorized_keys").read_text() == "attacker"


@case
def case2_roll_forward_refuses_symlinked_directories(share: Share) -> None:
    checkpoint(share)
    # A stale stage whose subdirectory is a link to the victim's ~/.ssh: rolling it forward would move
    # authorized_keys into the share.
    stage = stale_sibling(share.share, "ckpt")
    stage.mkdir()
    os.symlink(share.outside / ".ssh", stage / "sub2")
    (stage / MERGE_INTENT_NAME).write_text(
        json.dumps({"target_name": "ckpt", "files": ["sub2/authorized_keys"]})
    )
    # And one that would write into the victim's directory through a link planted in the target.
    os.symlink(share.outside / "dir", share.share / "ckpt" / "sub3")
    stage2 = stale_sibling(share.share, "ckpt")
    (stage2 / "sub3").mkdir(parents=True)
    (stage2 / "sub3" / "secret").write_text("attacker")
    (stage2 / MERGE_INTENT_NAME).write_text(json.dumps({"target_name": "ckpt", "files": ["sub3/secret"]}))
    code, text = cli("gc", str(share.share))
    # The first is rolled forward without its link (nothing followed); the second is reported.
    assert code == 1 and stage2.name in text and "sub3" not in siblings(share.share), text
    assert not stage.exists() and stage2.exists(), text
    # The owner's next save will not promote over a target it cannot put right: a clear error.
    exc = raises(safeio.SafeIOError, lambda: save(share.share / "ckpt", {"a.txt": "new a"}, mode="merge"))
    assert stage2.name in str(exc), exc
    os.unlink(share.share / "ckpt" / "sub3")  # the owner removes the planted link
    code, text = cli("gc", str(share.share))
    assert code == 0 and not stage2.exists(), text
    save(share.share / "ckpt", {"a.txt": "new a"}, mode="merge")
    assert read_tree(share.share / "ckpt") == {
        "a.txt": "new a",
        "sub/b.txt": "old b",
        "sub3/secret": "attacker",
    }


@case
def case2_versioned_merge_never_links_files_from_outside(share: Share) -> None:
    target = share.share / "ckpt"
    save(target, {"a.txt": "v1"}, mode="versioned")
    version = Path(os.readlink(target))
    # Three crafted links: to a directory outside, to a "version" that is itself a link outside, and
    # to a version of another target.
    fake_version = share.share / f".ckpt.safeio-v-{host_tag()}-1-{secrets.token_hex(4)}"
    os.symlink(share.outside, fake_version)
    other = share.share / f".other.safeio-v-{host_tag()}-1-{secrets.token_hex(4)}"
    os.symlink(share.outside, other)
    outside_inodes = {
        (st.st_dev, st.st_ino) for st in (share.key.stat(), (share.outside / "dir" / "secret").stat())
    }
    for pointee in (str(share.outside), fake_version.name, other.name):
        link = share.share / "tmp-link"
        os.symlink(pointee, link)
        os.replace(link, target)
        with contextlib.suppress(safeio.SafeIOError):
            save(target, {"b.txt": "v2"}, mode="merge")
        for path in share.share.rglob("*"):
            if path.is_file() and not path.is_symlink():
                st = path.stat()
                assert (st.st_dev, st.st_ino) not in outside_inodes, (
                    f"{path} is a hard link to a victim's file"
                )
                assert path.read_bytes() != PRIVATE, f"{path} holds the victim's key"
    assert version.name  # the genuine first version was a version directory name


@case
def case2_swapped_stage_is_refused_and_nothing_is_chmodded(share: Share) -> None:
    for mode in ("replace", "merge"):
        target = checkpoint(share, f"ckpt-{mode}")

        def body(target: Path = target, mode: str = mode) -> None:
            with safeio.replicated(target, mode=mode, timeout=10) as stage:
                Path(stage.path, "secret").write_text("the body's own file")
                os.rename(stage.path, stage.path + "-moved")  # another user swaps the stage for a link
                os.symlink(share.outside / "dir", stage.path)

        exc = raises(safeio.SafeIOError, body)
        assert str(target) in str(exc), exc
        secret = share.outside / "dir" / "secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, "the victim's 0600 file was chmodded"
        assert secret.read_text() == "root-only secret\n"
        assert read_tree(target) == {"a.txt": "old a", "sub/b.txt": "old b"}


@case
def baseline_2_naive_permission_fix_follows_a_swapped_stage(share: Share) -> None:
    stage = share.share / ".ckpt.stage"
    stage.mkdir()
    stage.rename(share.share / ".ckpt.moved")
    os.symlink(share.outside / "dir", stage)
    for dirpath, _, names in os.walk(stage, followlinks=True):  # the old permission fix: by path
        for name in names:
            os.chmod(os.path.join(dirpath, name), 0o644)
    assert stat.S_IMODE((share.outside / "dir" / "secret").stat().st_mode) == 0o644


# ---- 3. metadata opened blindly -------------------------------------------------------------------


def plant(path: Path, how: str, wrong_types: object = None) -> None:
    """Put something damaged under ``path``: not a regular file, too big, too deep, or not valid."""
    if how == "fifo":
        os.mkfifo(path)
    elif how == "dev-zero":
        os.symlink("/dev/zero", path)
    elif how == "huge":
        with open(path, "wb") as f:
            f.truncate(64 << 20)  # sparse: costs nothing to make, 64 MB to read
    elif how == "deep":
        path.write_text('{"files": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif how == "not-json":
        path.write_bytes(b"\xff\xfe garbage")
    else:
        path.write_text(json.dumps(wrong_types))


def _damage(target: Path, how: str, share: Share) -> None:
    manifest = target / MANIFEST_NAME
    manifest.unlink()
    if how == "wrong-types":
        plant(manifest, how, {"files": {"a.txt": {"size": "big"}, "b\0c": {"size": 1}, "d": 5}})
    elif how == "escaping-names":
        rel = os.path.relpath(share.key, target)
        plant(manifest, how, {"files": {rel: {"size": 1}, "/etc/passwd": {"size": 1}}})
    else:
        plant(manifest, how)


DAMAGE = ("fifo", "dev-zero", "huge", "deep", "wrong-types", "escaping-names", "not-json")


@case
def case3_damaged_manifests_are_reported_and_replaced(share: Share) -> None:
    for how in DAMAGE:
        target = checkpoint(share, f"ckpt-{how}")
        _damage(target, how, share)
        problems = safeio.verify(target)
        assert problems and any("damaged" in p or MANIFEST_NAME in p for p in problems), (how, problems)
        assert not any(str(share.key) in p or "id_rsa" in p for p in problems), (how, problems)
        assert safeio.is_complete(target) is False, how
        code, text = cli("verify", str(target))
        assert code == 1 and MANIFEST_NAME in text, (how, code, text)
        code, text = cli("gc", str(share.share))
        assert code in (0, 1), (how, text)
        # The next save replaces it (merge keeps the other files).
        save(target, {"a.txt": "new a"}, mode="merge")
        assert safeio.verify(target) == [], (how, safeio.verify(target))
        assert stat.S_ISREG(os.lstat(target / MANIFEST_NAME).st_mode), how
        assert read_tree(target) == {"a.txt": "new a", "sub/b.txt": "old b"}, how


@case
def case3_verify_never_opens_a_listed_device_or_fifo(share: Share) -> None:
    target = checkpoint(share)
    os.symlink("/dev/zero", target / "zero")
    os.mkfifo(target / "pipe")
    record = json.loads((target / MANIFEST_NAME).read_text())
    record["files"]["zero"] = {"size": 0, "xxh3_128": "0" * 32}
    record["files"]["pipe"] = {"size": 0, "sha256": "0" * 64}
    (target / MANIFEST_NAME).write_text(json.dumps(record))
    problems = safeio.verify(target)
    assert any("zero" in p for p in problems) and any("pipe" in p for p in problems), problems
    code, text = cli("verify", str(target))
    assert code == 1 and "zero" in text, text


@case
def case3_damaged_intents_are_removed_not_followed(share: Share) -> None:
    checkpoint(share)
    for how in ("fifo", "dev-zero", "huge", "deep", "wrong-types", "not-json"):
        stage = stale_sibling(share.share, "ckpt")
        stage.mkdir()
        plant(stage / MERGE_INTENT_NAME, how, {"target_name": "ckpt", "files": [1, None, {"a": "b"}]})
    code, text = cli("gc", str(share.share))
    assert code in (0, 1), text
    assert not siblings(share.share, "stage"), text
    assert read_tree(share.share / "ckpt") == {"a.txt": "old a", "sub/b.txt": "old b"}


@case
def case3_merge_save_with_a_fifo_intent_beside_it_is_bounded(share: Share) -> None:
    target = checkpoint(share)
    stage = stale_sibling(share.share, "ckpt")
    stage.mkdir()
    os.mkfifo(stage / MERGE_INTENT_NAME)
    save(target, {"a.txt": "new a"}, mode="merge", timeout=5)
    assert read_tree(target)["a.txt"] == "new a"


@case
def baseline_3_naive_reads_hang_or_crash(share: Share) -> None:
    fifo = share.share / MANIFEST_NAME
    os.mkfifo(fifo)
    with alarm(1):
        hung = False
        try:
            open(fifo).close()  # what the reader did before: a plain open
        except Hung:
            hung = True
    assert hung, "a plain open of a FIFO returned"
    deep = "[" * 100_000 + "]" * 100_000
    assert isinstance(raises(RecursionError, lambda: json.loads(deep)), RecursionError)


# ---- 4. numbers -----------------------------------------------------------------------------------


@case
def case4_timeouts_must_be_finite_positive_numbers(share: Share) -> None:
    ran = []

    def body(**options: Any) -> None:
        with safeio.replicated(share.share / "t", **options) as stage:
            ran.append(stage.path)

    for bad in (float("nan"), float("inf"), 1e400, 0, -1, "5", True):
        exc = raises(safeio.InvalidOptionError, lambda bad=bad: body(timeout=bad))
        assert "timeout" in str(exc), exc
        assert isinstance(exc, ValueError)
    for bad_env in ("nan", "inf", "1e400", "0", "abc"):
        with environment(SAFEIO_TIMEOUT=bad_env):
            exc = raises(safeio.InvalidOptionError, body)
            assert "SAFEIO_TIMEOUT" in str(exc), exc
    assert ran == [], "a body ran despite an invalid option"
    assert not os.path.exists(share.share / "t")


@case
def baseline_4_nan_never_runs_out(share: Share) -> None:
    remaining = float("nan")
    assert not remaining <= 0  # the old loop's only exit


# ---- 5. liveness across PID namespaces ----------------------------------------------------------

_NAMESPACED_WRITER = """
import os, pathlib, sys
import safeio
with safeio.replicated(sys.argv[1], timeout=60) as stage:
    pathlib.Path(stage.path, "a.txt").write_text("from the container")
    print(os.getpid(), stage.path, flush=True)
    sys.stdin.readline()
print("saved", flush=True)
"""


@case
def case5_gc_keeps_a_live_save_in_another_pid_namespace(share: Share) -> None:
    target = share.share / "ckpt"
    writer = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", _NAMESPACED_WRITER, str(target)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdin is not None
        inner_pid, stage_path = writer.stdout.readline().split()  # the body is running: its stage exists
        # The baseline: the pid in the stage's name means nothing in this namespace.
        stage_name = Path(stage_path).name
        parsed = parse(stage_name)
        assert parsed is not None and parsed.pid == int(inner_pid)
        assert parsed.host != host_tag(), "the host tag must differ between PID namespaces"
        code, text = cli("gc", str(share.share))
        assert code == 0, text
        assert Path(stage_path).is_dir(), f"gc removed a live save's stage:\n{text}"
        code, text = cli("gc", "--older-than", "1d", str(share.share))
        assert Path(stage_path).is_dir(), text
        writer.stdin.write("go\n")
        writer.stdin.flush()
        assert writer.stdout.readline().strip() == "saved"
        assert writer.wait(timeout=CASE_CEILING) == 0  # bounded by the runner's stall alarm first
    finally:
        writer.kill()
        writer.wait()
    assert read_tree(target) == {"a.txt": "from the container"}


@case
def case5_a_reused_pid_does_not_keep_a_dead_save(share: Share) -> None:
    # A live pid with another start time: the process that made the stage is gone.
    stage = share.share / f".ckpt.safeio-stage-{host_tag()}-{os.getpid()}-zzzz-{secrets.token_hex(4)}"
    stage.mkdir()
    code, text = cli("gc", str(share.share))
    assert code == 0, text
    assert not stage.exists(), text


# ---- 6. setgid shares -----------------------------------------------------------------------------

PROJECT_GID = 4242


@case
def case6_setgid_group_shares_keep_their_group(share: Share) -> None:
    project = share.share / "project"
    project.mkdir()
    # What an admin sets up: the project's group, setgid. (Root may give any group; uid 65534 owns
    # the directory and may set setgid only on a group it belongs to, so it uses its own.)
    gid = PROJECT_GID if share.privileged else os.getgid()
    os.chown(project, -1, gid)
    project.chmod(0o2777)
    for mode in ("replace", "merge", "versioned"):
        target = project / f"ckpt-{mode}"
        save(target, {"a.txt": "1", "sub/b.txt": "1"}, mode=mode)
        save(target, {"a.txt": "2", "sub/deeper/c.txt": "2"}, mode=mode)
        real = Path(os.path.realpath(target))
        for path in [real, *real.rglob("*")]:
            st = os.lstat(path)
            assert st.st_gid == gid, f"{path} lost the project group ({st.st_gid} != {gid})"
            if stat.S_ISDIR(st.st_mode):
                assert st.st_mode & stat.S_ISGID, f"{path} lost setgid ({oct(st.st_mode)})"


@case
def baseline_6_chmod_of_a_private_stage_drops_setgid(share: Share) -> None:
    share.share.chmod(0o2777)
    stage = tempfile.mkdtemp(dir=share.share)  # 0700 and setgid inherited ...
    os.chmod(stage, 0o775)  # ... until an explicit mode drops it
    assert not os.stat(stage).st_mode & stat.S_ISGID


# ---- 7. failures that lie or leave half a version ---------------------------------------------


@case
def case7_partial_merge_keeps_its_intent_and_rolls_forward(share: Share) -> None:
    target = checkpoint(share)
    (target / "z").mkdir()
    (target / "z" / "c.txt").write_text("old c")
    (target / "z").chmod(0o555)  # not writable: the merge fails after a.txt (sorted first) moved
    exc = raises(
        safeio.PromotionError, lambda: save(target, {"a.txt": "new a", "z/c.txt": "new c"}, mode="merge")
    )
    assert exc.errno == errno.EACCES and str(target) in str(exc), exc
    stages = siblings(share.share, "stage")
    assert len(stages) == 1, stages
    intent = json.loads((share.share / stages[0] / MANIFEST_NAME).read_text())[MERGE_INTENT_KEY]
    assert intent == {"target_name": "ckpt", "files": ["a.txt", "z/c.txt", MANIFEST_NAME]}, intent
    code, text = cli("gc", "--dry-run", str(share.share))
    assert stages[0] in text and "roll" in text, text
    (target / "z").chmod(0o755)
    code, text = cli("gc", str(share.share))
    assert code == 0, text
    assert read_tree(target) == {"a.txt": "new a", "sub/b.txt": "old b", "z/c.txt": "new c"}
    assert not siblings(share.share, "stage")
    assert safeio.verify(target) == []


@case
def case7_replace_succeeds_when_the_old_version_cannot_be_removed(share: Share) -> None:
    target = share.share / "ckpt"
    save(target, {"a.txt": "old a", "ro/b.txt": "old b"})
    (target / "ro").chmod(0o555)  # its file cannot be unlinked: the old version cannot be removed
    with captured_warnings() as warnings:
        save(target, {"a.txt": "new a"})  # no error: the new version is in place
    assert read_tree(target) == {"a.txt": "new a"}
    assert safeio.verify(target) == []
    assert any("old" in w for w in warnings), warnings
    leftovers = siblings(share.share)
    assert leftovers, "the old version should be left for gc"
    for name in leftovers:
        for dirpath, dirnames, _ in os.walk(share.share / name):
            for d in dirnames:
                os.chmod(os.path.join(dirpath, d), 0o755)
    code, text = cli("gc", str(share.share))
    assert code == 0, text
    assert not siblings(share.share), text


# ---- 8. smaller ----------------------------------------------------------------------------------


@case
def case8_bad_environment_is_named_when_a_save_starts(share: Share) -> None:
    for variable in ("SAFEIO_VERSION_GRACE", "SAFEIO_LEASE_SECONDS", "SAFEIO_WARN_AFTER"):
        for bad in ("abc", "nan", "-1"):
            with environment(**{variable: bad}):
                code, text = cli("gc", "--dry-run", str(share.share))
                assert code in (0, 2), text
                code, text = cli("verify", str(share.share / "missing"))
                assert code in (1, 2), text
                for options in ({"mode": "versioned"}, {"lock": "lease"}, {}):
                    exc = raises(
                        safeio.InvalidOptionError, lambda o=options: save(share.share / "t", {"a": "1"}, **o)
                    )
                    assert variable in str(exc) and bad in str(exc), exc
    assert os.listdir(share.share) == [], "a save ran despite an invalid environment"


@case
def case8_refuses_to_replace_the_working_or_home_directory(share: Share) -> None:
    work = share.share / "work"
    save(work, {"keep.txt": "mine", "inner/x.txt": "x"})
    before = read_tree(work)
    cwd = os.getcwd()
    try:
        for where in (work, work / "inner"):
            os.chdir(where)
            for target in (".", str(work)):
                for mode in ("replace", "versioned"):
                    exc = raises(
                        safeio.InvalidTargetError, lambda t=target, m=mode: save(Path(t), {"x": "y"}, mode=m)
                    )
                    assert "working directory" in str(exc), exc
    finally:
        os.chdir(cwd)
    with environment(HOME=str(work)):
        exc = raises(safeio.InvalidTargetError, lambda: save(work, {"x": "y"}))
        assert "home" in str(exc), exc
    exc = raises(safeio.InvalidTargetError, lambda: save(Path("/"), {"x": "y"}))
    assert read_tree(work) == before
    assert not siblings(share.share, "stage")


@case
def case8_lock_problems_name_the_lock_and_gc_reports_them(share: Share) -> None:
    target = checkpoint(share)
    lock = share.share / lock_name("ckpt")
    lock.unlink(missing_ok=True)  # the empty flock lock file a save leaves (harmless, kept by design)
    lock.mkdir()  # something that cannot be a lock: every kind of lock says which file it is
    (lock / "x").write_text("x")
    for how in ("flock", "lease", "strict"):
        exc = raises(
            safeio.SafeIOError, lambda h=how: save(target, {"a.txt": h}, mode="merge", lock=h, timeout=3)
        )
        assert str(lock) in str(exc), (how, exc)
    (lock / "x").unlink()
    lock.rmdir()
    os.mkfifo(lock)  # a FIFO under the lock's name neither blocks a save nor is followed
    for how in ("flock", "lease"):
        save(target, {"a.txt": how}, mode="merge", lock=how, timeout=3)
        assert read_tree(target) == {"a.txt": how, "sub/b.txt": "old b"}
    # Broken markers: reported by gc, and removed once old enough.
    planted = {"fifo": share.share / lock_name("f"), "garbage": share.share / lock_name("g")}
    planted["link"] = share.share / lock_name("l")
    os.mkfifo(planted["fifo"])
    planted["garbage"].write_text("{not a holder")
    os.symlink(share.key, planted["link"])
    code, text = cli("gc", "--dry-run", str(share.share))
    for path in planted.values():
        assert f"{path}: damaged" in text, text
    code, text = cli("gc", "--older-than", "0", str(share.share))
    assert code == 0, text
    assert not any(os.path.lexists(p) for p in planted.values()), text


@case
def case8_an_overlong_name_is_refused_before_the_body(share: Share) -> None:
    ran = []

    def body() -> None:
        with safeio.replicated(share.share / ("n" * 5000), timeout=5) as stage:
            ran.append(stage)

    exc = raises(safeio.SafeIOError, body)
    assert "n" * 50 in str(exc), exc
    assert ran == []
    assert os.listdir(share.share) == [], "nothing (no lock, no stage) is left behind"


# ---- the runner -------------------------------------------------------------------------------------


@contextlib.contextmanager
def alarm(seconds: int) -> Iterator[None]:
    """Raise `Hung` after ``seconds`` of wall time: only where the bound itself is the subject (a call that
    never returns by itself, such as a plain open of a FIFO). The runner's `stall_alarm` is suspended
    meanwhile and goes on after."""

    def hung(signum: int, frame: object) -> None:
        raise Hung(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    outer = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer != (0.0, 0.0):
            signal.setitimer(signal.ITIMER_REAL, outer[0] or outer[1], outer[1])


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def captured_warnings() -> Iterator[list[str]]:
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                messages.append(record.getMessage())

    handler = Collect()
    logger = logging.getLogger("safeio")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def run_case(name: str, base: Path, *, privileged: bool, shared: Path | None = None) -> dict[str, Any]:
    """One case in a fresh directory under ``base``; ``shared`` (a directory on another filesystem, say
    the NFS-like mount) holds the share instead when given."""
    root = base / name
    root.mkdir()
    share_parent = shared / name if shared is not None else root
    if shared is not None:
        share_parent.mkdir()
    # The victim's files live on the share's filesystem: a rename could move them in, a link link them.
    share = Share(root, share_parent / "share", share_parent / "outside", privileged)
    share.share.mkdir()
    share.share.chmod(0o777)
    make_outside(share.outside)
    baseline = name.startswith("baseline_")
    watched = tree_state(root, skip=share.share)
    watched_shared = tree_state(share_parent, skip=share.share) if shared is not None else {}
    try:
        with stall_alarm(STALL_SECONDS, ceiling=CASE_CEILING):
            CASES[name](share)
    except BaseException:  # reported to the test, which fails with it
        return {"ok": False, "detail": traceback.format_exc()}
    if not baseline:
        after = tree_state(root, skip=share.share)
        changed = sorted(k for k in after.keys() | watched.keys() if after.get(k) != watched.get(k))
        if shared is not None:
            after_shared = tree_state(share_parent, skip=share.share)
            changed += sorted(
                k
                for k in after_shared.keys() | watched_shared.keys()
                if after_shared.get(k) != watched_shared.get(k)
            )
        if changed:
            return {"ok": False, "detail": f"changed outside the share: {changed}"}
    return {"ok": True, "detail": ""}


def applicable(name: str, privileged: bool) -> bool:
    if name in ROOT_ONLY:
        return privileged
    if name in UNPRIVILEGED_ONLY:
        return not privileged
    return True
