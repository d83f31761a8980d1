"""Promotion modes, fallbacks and recovery on the local disk (single process)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from threading import Event, Thread

import pytest

import safeio
from safeio._promotion.leftovers import recover_directory
from safeio._storage import manifest
from safeio._storage.dirfd import HELD, held_directory, remove_directory_at, walk
from safeio._storage.names import NAME_MAX, parse, process_start, sibling_name
from tests._deep_trees import make_chain


def save(target: Path, files: dict[str, str], **options: object) -> None:
    with safeio.replicated(target, **options) as stage:  # type: ignore[arg-type]
        for rel, text in files.items():
            p = Path(stage.path, rel)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_replace_swaps_the_whole_directory(tmp_path: Path) -> None:
    target = tmp_path / "tok"
    save(target, {"a.json": "1", "b.json": "1"})
    save(target, {"a.json": "2"})
    assert listing(target) == [manifest.MANIFEST_NAME, "a.json"]
    assert (target / "a.json").read_text() == "2"
    assert listing(tmp_path) == [".tok.safeio.lock", "tok"]
    assert safeio.verify(target) == []


def test_replace_fallback_without_rename_exchange(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAFEIO_NO_EXCHANGE", "1")
    target = tmp_path / "tok"
    save(target, {"a.json": "1"})
    seen: list[list[str]] = []
    real_rename = os.rename

    def observing_rename(src: str, dst: str, **dir_fds: int) -> None:
        real_rename(src, dst, **dir_fds)
        seen.append(listing(tmp_path))

    monkeypatch.setattr(os, "rename", observing_rename)
    save(target, {"a.json": "2"})
    # Intermediate states: old aside (target name missing, no partial directory), then new in place.
    kinds_after_first = {parse(n).kind for n in seen[0] if parse(n)}
    assert "tok" not in seen[0] and kinds_after_first == {"old", "stage"}
    assert "tok" in seen[1] and {parse(n).kind for n in seen[1] if parse(n)} == {"old"}
    assert (target / "a.json").read_text() == "2"
    assert listing(tmp_path) == [".tok.safeio.lock", "tok"]


def test_replace_fallback_puts_the_old_version_back_if_the_new_cannot_go_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SAFEIO_NO_EXCHANGE", "1")
    target = tmp_path / "tok"
    save(target, {"a.json": "old"})
    real_rename = os.rename

    def failing_second_rename(src: str, dst: str, **dir_fds: int) -> None:
        if ".safeio-stage-" in os.path.basename(src):
            raise OSError(5, "Input/output error")
        real_rename(src, dst, **dir_fds)

    monkeypatch.setattr(os, "rename", failing_second_rename)
    with pytest.raises(safeio.PromotionError, match="Input/output error") as info:
        save(target, {"a.json": "new"})
    assert info.value.path == str(target)
    assert (target / "a.json").read_text() == "old"
    assert listing(tmp_path) == [".tok.safeio.lock", "tok"]


def test_a_kill_between_the_fallback_renames_is_recovered(tmp_path: Path) -> None:
    """The instant where the name is missing: the next save (or gc) restores the old version first."""
    target = tmp_path / "tok"
    save(target, {"a.json": "old"})
    pid = dead_pid()
    aside = tmp_path / sibling_name("tok", "old").replace(f"-{os.getpid()}-", f"-{pid}-")
    stage = tmp_path / sibling_name("tok", "stage").replace(f"-{os.getpid()}-", f"-{pid}-")
    os.rename(target, aside)
    stage.mkdir()
    (stage / "a.json").write_text("half")
    actions = recover_directory(str(tmp_path), dry_run=True)
    assert {a.verb for a in actions} == {"restore", "remove"} and not target.exists()
    actions = recover_directory(str(tmp_path))
    assert (target / "a.json").read_text() == "old"
    assert listing(tmp_path) == ["tok"]  # a first save takes no lock: no lock file either


def test_merge_keeps_other_files_and_merges_the_manifest(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint-1"
    save(target, {"model.safetensors": "weights", "config.json": "c1"}, mode="replace")
    save(target, {"tokenizer.json": "t", "config.json": "c2"}, mode="merge")
    assert listing(target) == [manifest.MANIFEST_NAME, "config.json", "model.safetensors", "tokenizer.json"]
    assert (target / "model.safetensors").read_text() == "weights"
    assert (target / "config.json").read_text() == "c2"
    recorded = json.loads((target / manifest.MANIFEST_NAME).read_text())["files"]
    assert sorted(recorded) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert safeio.verify(target) == []


def test_merge_never_truncates_a_file_in_place(tmp_path: Path) -> None:
    target = tmp_path / "d"
    save(target, {"a": "old"}, mode="merge")
    inode_before = os.stat(target / "a").st_ino
    with open(target / "a") as reader:  # a reader holding the old file keeps reading the old content
        save(target, {"a": "new"}, mode="merge")
        assert reader.read() == "old"
    assert os.stat(target / "a").st_ino != inode_before
    assert (target / "a").read_text() == "new"


def test_interrupted_merge_is_rolled_forward(tmp_path: Path) -> None:
    target = tmp_path / "d"
    save(target, {"a": "1", "b": "1", "keep": "k"}, mode="merge")
    pid = dead_pid()
    stage = tmp_path / sibling_name("d", "stage").replace(f"-{os.getpid()}-", f"-{pid}-")
    stage.mkdir()
    (stage / "b").write_text("2")  # "a" was already replaced before the crash
    (target / "a").write_text("2")
    (stage / manifest.MERGE_INTENT_NAME).write_text(json.dumps({"target_name": "d", "files": ["a", "b"]}))
    save(target, {"c": "2"}, mode="merge")  # the next save of the target completes the old merge first
    assert [(target / n).read_text() for n in ("a", "b", "c", "keep")] == ["2", "2", "2", "k"]
    assert listing(tmp_path) == [".d.safeio.lock", "d"]


def test_merge_conflict_is_refused_before_anything_moves(tmp_path: Path) -> None:
    target = tmp_path / "d"
    save(target, {"sub/x": "1"}, mode="replace")
    with pytest.raises(safeio.InvalidTargetError, match="is a directory there"):
        save(target, {"sub": "file now", "other": "o"}, mode="merge")
    assert listing(target) == [manifest.MANIFEST_NAME, "sub"]
    assert listing(tmp_path) == [".d.safeio.lock", "d"]


def test_error_mode(tmp_path: Path) -> None:
    target = tmp_path / "d"
    save(target, {"a": "1"}, mode="error")
    with pytest.raises(safeio.TargetExistsError) as info:
        save(target, {"a": "2"}, mode="error")
    assert isinstance(info.value, FileExistsError) and str(target) in str(info.value)
    assert (target / "a").read_text() == "1"


def test_versioned_swaps_a_symlink_and_snapshot_is_stable(tmp_path: Path) -> None:
    target = tmp_path / "tok"
    save(target, {"a": "1"}, mode="versioned")
    first = safeio.snapshot(target)
    save(target, {"a": "2"}, mode="versioned")
    assert os.path.islink(target) and (target / "a").read_text() == "2"
    assert Path(first, "a").read_text() == "1"  # a reader that resolved once keeps its version
    assert safeio.snapshot(target) != first


def test_stale_stages_of_dead_owners_are_swept_live_ones_kept(tmp_path: Path) -> None:
    target = tmp_path / "tok"
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        dead = tmp_path / sibling_name("tok", "stage").replace(f"-{os.getpid()}-", f"-{dead_pid()}-")
        # A live owner is its pid *and* its start time (a pid alone may have been reused since).
        mine, theirs = (
            f"-{os.getpid()}-{process_start(os.getpid())}-",
            f"-{other.pid}-{process_start(other.pid)}-",
        )
        live = tmp_path / sibling_name("tok", "stage").replace(mine, theirs)
        reused = tmp_path / sibling_name("tok", "stage").replace(mine, f"-{other.pid}-{process_start(1)}-")
        ours = tmp_path / sibling_name("tok", "old")  # left by an earlier save of this very process
        lookalike = tmp_path / ".tok.safeio-stage-notours"
        for d in (dead, live, reused, ours, lookalike):
            d.mkdir()
        save(target, {"a": "1"})
        assert not dead.exists() and not ours.exists()
        assert not reused.exists()  # the pid is alive, but it is a later process than the stage's owner
        assert live.exists() and lookalike.exists()
    finally:
        other.communicate(b"")


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_permissions_follow_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        target = tmp_path / "tok"
        with safeio.replicated(target) as stage:
            fd = os.open(os.path.join(stage.path, "model.safetensors"), os.O_CREAT | os.O_WRONLY, 0o600)
            os.close(fd)  # like safetensors' mkstemp: 0600 whatever the umask
            Path(stage.path, "config.json").write_text("{}")
            os.mkdir(os.path.join(stage.path, "sub"))
    finally:
        os.umask(old)
    assert os.stat(target).st_mode & 0o777 == 0o777 & ~umask
    assert os.stat(target / "sub").st_mode & 0o777 == 0o777 & ~umask
    for name in ("model.safetensors", "config.json"):
        assert os.stat(target / name).st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize(
    "name",
    ["x" * NAME_MAX, "é" * 127, "токенизатор 🚀", "with space", "new\nline"],
    ids=["255-bytes", "254-bytes-2-byte-chars", "unicode", "space", "newline"],
)
def test_hostile_names(tmp_path: Path, name: str) -> None:
    target = tmp_path / name
    save(target, {"a": "1"})
    save(target, {"a": "2"})
    assert (target / "a").read_text() == "2"
    assert [n for n in listing(tmp_path) if ".safeio-" in n and not n.endswith(".lock")] == []


def test_target_is_a_foreign_symlink(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("k")
    (tmp_path / "link").symlink_to(elsewhere)
    with pytest.raises(safeio.InvalidTargetError, match="symlink"):
        save(tmp_path / "link", {"a": "1"})
    assert listing(elsewhere) == ["keep"]


def test_parent_is_created(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "c"
    save(target, {"x": "1"})
    assert (target / "x").read_text() == "1"


def test_dotdot_in_path_is_normalised(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    save(tmp_path / "a" / ".." / "b", {"x": "1"})
    assert (tmp_path / "b" / "x").read_text() == "1"


def test_body_error_and_cleanup_error_first_error_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safeio._promotion.local import LocalPromotion

    def broken_discard(self: LocalPromotion, stage: str) -> None:
        raise PermissionError(13, "cannot remove", stage)

    monkeypatch.setattr(LocalPromotion, "discard", broken_discard)
    with pytest.raises(KeyError, match="body") as info, safeio.replicated(tmp_path / "t"):
        raise KeyError("body")
    assert isinstance(info.value.__context__, PermissionError)


def test_non_durable_manifest_has_sizes_but_no_hashes(tmp_path: Path) -> None:
    save(tmp_path / "fast", {"a": "1"}, durable=False)
    save(tmp_path / "safe", {"a": "1"}, durable=True)
    fast = json.loads((tmp_path / "fast" / manifest.MANIFEST_NAME).read_text())["files"]["a"]
    safe = json.loads((tmp_path / "safe" / manifest.MANIFEST_NAME).read_text())["files"]["a"]
    assert fast == {"size": 1} and set(safe) == {"size", "xxh3_128"}


def test_verify_finds_damage(tmp_path: Path) -> None:
    target = tmp_path / "t"
    save(target, {"a": "1111", "b": "2"})
    (target / "a").write_text("2222")
    (target / "b").unlink()
    assert safeio.verify(target) == ["xxh3_128 mismatch: a", "missing: b"]
    assert not safeio.is_complete(target)


def test_a_later_save_of_the_same_job_covers_an_earlier_one() -> None:
    from safeio._saves.visibility import call_covers

    assert call_covers("job/abc/3", "job/abc/3")
    assert call_covers("job/abc/4", "job/abc/3")  # the writer saved again before this peer looked
    assert not call_covers("job/abc/2", "job/abc/3")  # an older save does not
    assert not call_covers("other/abc/9", "job/abc/3")  # nor one from another job
    assert not call_covers(None, "job/abc/1")


_RIVAL = (
    "import sys, safeio\nfrom pathlib import Path\n"
    "with safeio.replicated(sys.argv[1], timeout=30) as stage:\n"
    "    Path(stage.path, 'b.json').write_text('rival')\n"
)


@pytest.mark.parametrize("where", ["local", "nfslike"])
@pytest.mark.parametrize("mode", ["error", "replace"])
def test_a_first_save_never_replaces_a_version_a_rival_promoted_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, where: str, mode: str
) -> None:
    """A first save takes no lock: its rename must refuse to replace what a rival job promoted between
    its look at the target and the rename (RENAME_NOREPLACE; on NFS/FUSE a directory's rename refuses a
    non-empty one), and the save then goes the locked way as if it had found the target."""
    from safeio._promotion import local

    root = request.getfixturevalue("nfslike_mount").path if where == "nfslike" else tmp_path
    target = Path(root) / "tok"
    looked: list[str] = []
    real_lstat_at = local.lstat_at

    def missed_once(dir_fd: int, name: str) -> os.stat_result | None:
        if name == "tok" and not looked:  # the look before the rename: the rival is not there yet
            looked.append(name)
            return None
        return real_lstat_at(dir_fd, name)

    monkeypatch.setattr(local, "lstat_at", missed_once)

    def save_while_the_rival_promotes() -> None:
        with safeio.replicated(target, mode=mode, timeout=30) as stage:
            Path(stage.path, "a.json").write_text("ours")
            subprocess.run([sys.executable, "-c", _RIVAL, str(target)], check=True, timeout=120)
            assert (target / "b.json").read_text() == "rival"

    if mode == "error":
        with pytest.raises(safeio.TargetExistsError):
            save_while_the_rival_promotes()
        assert listing(target) == [manifest.MANIFEST_NAME, "b.json"]  # the rival's version, untouched
    else:
        save_while_the_rival_promotes()
        assert listing(target) == [manifest.MANIFEST_NAME, "a.json"]  # replaced under the lock, whole
    assert looked == ["tok"]
    assert [n for n in listing(Path(root)) if n != ".tok.safeio.lock"] == ["tok"]


def _pause_after(monkeypatch: pytest.MonkeyPatch, owner: type, method: str) -> tuple[Event, Event]:
    """The first call of ``owner.method`` (in any thread) returns, then waits until ``go`` is set;
    ``made`` says it got there. Later calls (the other thread's) run straight through."""
    made, go = Event(), Event()
    real = getattr(owner, method)

    def paused(*args: object, **kwargs: object) -> object:
        value = real(*args, **kwargs)
        if not made.is_set():
            made.set()
            assert go.wait(60), "the test never let the paused save go on"
        return value

    monkeypatch.setattr(owner, method, paused)
    return made, go


def _in_thread(fn: Callable[[], None]) -> tuple[Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # reported by the test, which asserts none
            errors.append(exc)

    thread = Thread(target=run, name="checkpoint-writer")
    thread.start()
    return thread, errors


@pytest.mark.parametrize("first", [True, False], ids=["first-save", "over-a-version"])
def test_a_stage_another_thread_has_just_made_is_not_a_leftover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: bool
) -> None:
    """CI caught a background thread's save of the same target removing the stage a save in the main
    thread had made an instant before (the stage was registered as in use only after its mkdir): the main
    thread's save then failed with "the stage ... was moved or replaced". The stage's name is claimed
    before the mkdir, so the other thread's recovery leaves it alone at any instant."""
    from safeio._promotion.local import LocalPromotion

    target = tmp_path / "out"
    if not first:
        save(target, {"config.json": "0"})
    made, go = _pause_after(monkeypatch, LocalPromotion, "open_stage")
    thread, errors = _in_thread(lambda: save(target, {"tokenizer.json": "tok"}, mode="merge"))
    try:
        assert made.wait(60)
        stage = [n for n in listing(tmp_path) if ".safeio-stage-" in n]
        assert len(stage) == 1
        save(target, {"config.json": "1"}, mode="merge")  # recovers leftovers of "out" before promoting
        assert stage[0] in listing(tmp_path)
    finally:
        go.set()
        thread.join(60)
    assert not thread.is_alive() and errors == []
    assert listing(target) == [manifest.MANIFEST_NAME, "config.json", "tokenizer.json"]
    assert [n for n in listing(tmp_path) if ".safeio-" in n and not n.endswith(".safeio.lock")] == []


def test_a_checkpoint_stage_another_thread_has_just_made_is_not_a_leftover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for whole checkpoints: every save of a step first recovers the root's leftovers."""
    from safeio._promotion.local import LocalPromotion

    root = tmp_path / "ckpts"

    def save_step(step: int) -> None:
        with safeio.Checkpoints(root, keep=None, timeout=60).save(step) as ckpt:
            Path(ckpt.path, "weights.bin").write_bytes(bytes([step]) * 10)

    made, go = _pause_after(monkeypatch, LocalPromotion, "open_stage")
    thread, errors = _in_thread(lambda: save_step(1))
    try:
        assert made.wait(60)
        save_step(2)
    finally:
        go.set()
        thread.join(60)
    assert not thread.is_alive() and errors == []
    assert safeio.Checkpoints(root, keep=None).steps() == [1, 2]


# ---- walks without recursion (issue 25, item 7) ---------------------------------------------------


def test_a_walk_holds_a_bounded_number_of_descriptors_at_any_depth(tmp_path: Path) -> None:
    (tmp_path / "t").mkdir()
    make_chain(tmp_path / "t", 3000)
    before = len(os.listdir("/proc/self/fd"))
    most = seen = 0
    with held_directory(str(tmp_path)) as fd:
        for listing in walk(fd, max_relative=None):
            if seen % 100 == 0:
                most = max(most, len(os.listdir("/proc/self/fd")) - before)
            seen += 1
            assert listing.entries == [] or [name for name, _ in listing.entries] == ["f"]
        assert seen == 3002
        errors: list[OSError] = []
        assert sum(1 for _ in walk(fd, onerror=errors.append)) < 3002  # stops where paths pass PATH_MAX
        assert [(e.errno, e.filename) for e in errors] == [(errno.ENAMETOOLONG, "t")]
        remove_directory_at(fd, "t")
    assert 0 < most <= HELD + 2, most
    assert os.listdir(tmp_path) == []


def test_a_directory_moved_while_it_is_walked_stops_the_walk(tmp_path: Path) -> None:
    """Ancestors past the held window are reopened through ``..``: if one was moved meanwhile, ``..`` is
    another directory, and the walk stops rather than go on there."""
    (tmp_path / "t").mkdir()
    make_chain(tmp_path / "t", 200)
    with held_directory(str(tmp_path)) as fd:
        walking = walk(fd)
        for depth, _listing in enumerate(walking):
            if depth == 150:  # level 80's descriptor is closed by now (only the last HELD are open)
                os.rename(tmp_path / "t" / "/".join(["d"] * 79), tmp_path / "moved")
                break
        with pytest.raises(OSError, match="moved while it was walked") as raised:
            for _ in walking:
                pass
    assert raised.value.errno == errno.ESTALE, raised.value
