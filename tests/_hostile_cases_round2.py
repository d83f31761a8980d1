"""Hostile shares, round 2 (issue 25): ownership of leftovers, the window before a rename, and a peer
without a store. Registered into ``tests._hostile_cases.CASES``, so that ``tests/test_hostile_share.py``
runs each as root and as uid 65534, on local disk and on the NFS-like mount, under an alarm, with the
sentinel-tree check. Numbers are those of issue 25's list; ``r2baseline_*`` cases show the failure done
the old way.

Another user is uid 4242: only root can make files of theirs, so the cases that need one run as root
(and, where the victim must be an ordinary user, drop to uid 65534 in a forked child for its part).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safeio
from safeio._coordination.group import Group
from safeio._promotion.local import LocalPromotion
from safeio._storage.manifest import MANIFEST_NAME, MERGE_INTENT_NAME
from tests._hostile_cases import (
    CASE_CEILING,
    ROOT_ONLY,
    Share,
    captured_warnings,
    case,
    checkpoint,
    cli,
    raises,
    read_tree,
    save,
    siblings,
    stale_sibling,
)

OTHER = 4242
NOBODY = 65534


def _chown_tree(path: Path, uid: int) -> None:
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, uid)
    os.lchown(path, uid, uid)


def _foreign_merge_stage(share: Share, target_name: str) -> Path:
    """What another user's failed merge save keeps: a stage with an intent naming the target."""
    stage = stale_sibling(share.share, target_name)
    stage.mkdir()
    (stage / "evil.txt").write_text("theirs")
    (stage / MERGE_INTENT_NAME).write_text(json.dumps({"target_name": target_name, "files": ["evil.txt"]}))
    _chown_tree(stage, OTHER)
    return stage


# ---- 1. another user's failed save is completed into your directory ------------------------------


@case
def r2case1_another_users_merge_stage_is_never_rolled_into_your_target(share: Share) -> None:
    target = checkpoint(share)
    stage = _foreign_merge_stage(share, "ckpt")
    with captured_warnings() as warnings:
        save(target, {"a.txt": "new a"}, mode="merge")
    assert read_tree(target) == {"a.txt": "new a", "sub/b.txt": "old b"}, read_tree(target)
    assert stage.is_dir() and any(str(stage) in w and f"uid {OTHER}" in w for w in warnings), warnings
    code, text = cli("gc", str(share.share))  # root's gc: the owner is compared with the target's
    assert code in (0, 1), text
    assert stage.is_dir() and (stage / "evil.txt").exists(), text
    assert f"owned by uid {OTHER}" in text and str(stage) in text, text
    assert "evil.txt" not in read_tree(target)


@case
def r2baseline1_owner_blind_recovery_rolls_their_files_into_your_target(share: Share) -> None:
    target = checkpoint(share)
    stage = _foreign_merge_stage(share, "ckpt")
    intent = json.loads((stage / MERGE_INTENT_NAME).read_text())
    for rel in intent["files"]:  # what recovery did when only the owner's process was judged
        os.replace(stage / rel, target / rel)
    assert read_tree(target)["evil.txt"] == "theirs"


# ---- 2. retention deletes your checkpoints for another user's higher steps -----------------------


def _step(ckpts: safeio.Checkpoints, step: int, text: str) -> Any:
    with ckpts.save(step) as ckpt:
        Path(ckpt.path, "weights.bin").write_text(text)
    return ckpt


@case
def r2case2_another_users_steps_are_never_retired_nor_resumed_from(share: Share) -> None:
    root = share.share / "run"
    theirs = safeio.Checkpoints(root, keep=None, timeout=10)
    for step in (50, 60):  # committed-looking steps of another user, moved into your root
        _step(theirs, step, "theirs")
        _chown_tree(root / f"step_{step}", OTHER)
    ours = safeio.Checkpoints(root, keep=2, timeout=10)
    for step in (1, 2, 3):
        _step(ours, step, "ours")
    latest = ours.latest()
    assert latest is not None and latest.step == 3, latest
    assert ours.steps() == [2, 3]
    assert (root / "step_50" / "weights.bin").read_text() == "theirs" and (root / "step_60").is_dir()
    code, text = cli("ls", str(root))
    assert code == 0 and f"another user's (uid {OTHER})" in text, text


# ---- 4. "nothing was committed" after a commit --------------------------------------------------


@case
def r2case4_a_directory_planted_at_latest_leaves_the_step_committed_and_says_so(share: Share) -> None:
    root = share.share / "run"
    ckpts = safeio.Checkpoints(root, keep=None, timeout=10)
    _step(ckpts, 1, "one")
    (root / "latest").unlink()
    (root / "latest").mkdir()  # planted
    with captured_warnings() as warnings:
        ckpt = _step(ckpts, 2, "two")
    assert len(ckpt.warnings) == 1 and "step 2 is committed, but the pointer" in ckpt.warnings[0], (
        ckpt.warnings
    )
    assert any("step 2 is committed" in w for w in warnings), warnings
    latest = ckpts.latest()
    assert latest is not None and latest.step == 2 and safeio.verify(root / "step_2") == []
    assert (root / "latest").is_dir()  # not removed: it is not safeio's


# ---- 3. a stage swapped after the last identity check -------------------------------------------


def _swapping_check_stage() -> Callable[[], None]:
    """From now on, the second ``check_stage`` of a save (the last one: before the promoting rename, with
    or without the lock) is followed at once by a swap of the stage for an attacker's directory: the
    window between the last check and the rename, which goes by name."""
    real = LocalPromotion.check_stage
    calls = [0]

    def check_then_swap(self: LocalPromotion) -> None:
        real(self)
        calls[0] += 1
        if calls[0] == 2:
            fd = self.parent_fd
            os.rename(self.stage_name, self.stage_name + ".moved", src_dir_fd=fd, dst_dir_fd=fd)
            os.mkdir(self.stage_name, dir_fd=fd)
            evil = os.open(f"{self.stage_name}/evil.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
            os.write(evil, b"theirs")
            os.close(evil)

    LocalPromotion.check_stage = check_then_swap  # type: ignore[method-assign]

    def restore() -> None:
        LocalPromotion.check_stage = real  # type: ignore[method-assign]

    return restore


@case
def r2case3_a_stage_swapped_just_before_the_rename_is_never_promoted(share: Share) -> None:
    for mode, existing in (("replace", True), ("replace", False), ("versioned", True)):
        target = share.share / f"t-{mode}-{existing}"
        if existing:
            save(target, {"a.txt": "old"}, mode=mode)
        restore = _swapping_check_stage()
        try:
            exc = raises(safeio.PromotionError, lambda t=target, m=mode: save(t, {"a.txt": "new"}, mode=m))
        finally:
            restore()
        assert "replaced by someone else just before it was promoted" in str(exc), exc
        if existing:
            assert read_tree(target) == {"a.txt": "old"}, (mode, read_tree(target))
        else:
            assert not os.path.lexists(target), os.listdir(share.share)
        save(target, {"a.txt": "after"}, mode=mode)  # the next save is not blocked by anything left
        assert read_tree(target) == {"a.txt": "after"} and safeio.verify(target) == []


@case
def r2baseline3_a_rename_by_name_promotes_whatever_is_there(share: Share) -> None:
    stage, target = share.share / ".t.stage", share.share / "t"
    stage.mkdir()
    os.rename(stage, share.share / ".t.moved")  # checked, then swapped
    stage.mkdir()
    (stage / "evil.txt").write_text("theirs")
    os.rename(stage, target)
    assert (target / "evil.txt").read_text() == "theirs"


# ---- 6. a store-less peer accepts another job's save as its own ---------------------------------


def _with_job(job: str, fn: Callable[[], Any]) -> Any:
    saved = os.environ.get("TORCHELASTIC_RUN_ID")
    os.environ["TORCHELASTIC_RUN_ID"] = job
    try:
        return fn()
    finally:
        if saved is None:
            os.environ.pop("TORCHELASTIC_RUN_ID", None)
        else:
            os.environ["TORCHELASTIC_RUN_ID"] = saved


@case
def r2case6_a_peer_without_a_store_never_takes_another_jobs_save(share: Share) -> None:
    """Rank 1 of a job whose ranks come from RANK/WORLD_SIZE (no store) waits for its writer, which
    died; meanwhile another job (another user's, when run as root) saves the same target."""
    target = share.share / "tok"
    peer = safeio.replicated(target, group=Group(1, 2), timeout=2)
    _with_job(f"mine-{secrets.token_hex(4)}", peer.__enter__)
    # Another thread: a save in this one would be nested in the peer's (its scratch).
    rival = threading.Thread(
        target=_with_job,
        args=("theirs", lambda: save(target, {"tokenizer.json": "theirs"}, group=Group(0, 1))),
    )
    rival.start()
    rival.join(CASE_CEILING)  # bounded by the runner's stall alarm first
    assert not rival.is_alive() and safeio.verify(target) == []
    if share.privileged:
        os.lchown(target / MANIFEST_NAME, OTHER, OTHER)
    exc = raises(safeio.PeerTimeout, lambda: peer.__exit__(None, None, None))
    assert str(target) in str(exc), exc


# ---- 8. another user's killed save blocks yours, unnamed -----------------------------------------


def _as_nobody(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()`` in a forked child running as uid/gid 65534; its result (or its error) as a dict."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read)
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            result = fn()
        except BaseException as exc:
            result = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(write, json.dumps(result).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return dict(json.loads(data))


@case
def r2case8_another_users_killed_save_neither_blocks_yours_nor_goes_unnamed(share: Share) -> None:
    """A sticky, world-writable share: uid 4242's save of ``tok`` was killed and left its stage; uid
    65534 then saves ``tok`` and runs ``safeio gc``. Before, the save failed with "Operation not
    permitted" naming nothing (recovery tried to remove a leftover it may not), and gc said "nothing to
    clean"."""
    share.share.chmod(0o1777)
    target = share.share / "tok"
    leftover = stale_sibling(share.share, "tok")
    leftover.mkdir()
    (leftover / "tokenizer.json").write_text("theirs, half written")
    _chown_tree(leftover, OTHER)

    def victim() -> dict[str, Any]:
        with captured_warnings() as warnings:
            save(target, {"tokenizer.json": "mine"})
        code, text = cli("gc", str(share.share))
        return {"tree": read_tree(target), "warnings": warnings, "gc": text, "code": code}

    result = _as_nobody(victim)
    assert "error" not in result, result
    assert result["tree"] == {"tokenizer.json": "mine"}, result
    assert any(str(leftover) in w and f"uid {OTHER}" in w for w in result["warnings"]), result
    assert str(leftover) in result["gc"] and f"owned by uid {OTHER}" in result["gc"], result
    assert leftover.is_dir() and siblings(share.share, "stage") == [leftover.name]


@case
def r2baseline8_removing_another_users_leftover_in_a_sticky_share_is_refused(share: Share) -> None:
    share.share.chmod(0o1777)
    leftover = stale_sibling(share.share, "tok")
    leftover.mkdir()
    _chown_tree(leftover, OTHER)

    def remove() -> dict[str, Any]:
        try:
            os.rmdir(leftover)
        except OSError as exc:
            return {"errno": exc.errno}
        return {"errno": 0}

    assert _as_nobody(remove)["errno"] == errno.EPERM


# ---- 5. a foreign file's mode, set-id bits included, copied onto yours ---------------------------


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@case
def r2case5_atomic_open_keeps_only_its_own_files_permission_bits(share: Share) -> None:
    """A sticky share. A file of another user's (planted 06777 under the name you write) gives you
    nothing: the umask's default; your own file keeps its permission bits, never a set-id or sticky bit."""
    share.share.chmod(0o1777)
    if share.privileged:  # only root can plant another user's file
        import torch

        default = 0o666 & ~_umask()
        for name, write in (
            ("trainer_state.json", lambda p: _write_atomically(p, "{}")),
            ("state.pt", lambda p: safeio.torch_save({"step": 1}, p)),
        ):
            planted = share.share / name
            planted.write_text("theirs")
            os.chown(planted, OTHER, OTHER)
            planted.chmod(0o6777)
            write(planted)
            st = os.lstat(planted)
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), default), (name, oct(st.st_mode))
        assert torch.load(share.share / "state.pt") == {"step": 1}
    own = share.share / "own.json"
    own.write_text("old")
    own.chmod(0o6750)
    _write_atomically(own, "new")
    assert stat.S_IMODE(os.lstat(own).st_mode) == 0o750, oct(os.lstat(own).st_mode)


def _write_atomically(path: Path, text: str) -> None:
    with safeio.atomic_open(path) as f:
        f.write(text)


# ---- 7. a tree deeper than the recursion limit -----------------------------------------------------

DEEP = 3000  # levels: past Python's recursion limit (1000), and its path past PATH_MAX (4096)
# The NFS-like mount's daemon works by path on its backing directory: no path past PATH_MAX there.
DEEP_NFSLIKE = 1100  # still past the recursion limit


def _deep_tree(parent: Path, name: str, levels: int) -> None:
    """``parent/name/d/d/.../d/f`` with ``levels`` directories below ``name``, made relative to a held
    descriptor (its paths are too long to make by name)."""
    flags = os.O_RDONLY | os.O_DIRECTORY
    os.mkdir(parent / name)
    fd = os.open(parent / name, flags)
    try:
        for _ in range(levels):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", flags, dir_fd=fd)
            os.close(fd)
            fd = child
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    finally:
        os.close(fd)


def _depth(share: Share) -> tuple[int, bool]:
    """Levels for a deep tree in this share, and whether its paths go past PATH_MAX."""
    levels = DEEP if share.share.is_relative_to(share.root) else DEEP_NFSLIKE
    return levels, 2 * levels > 4096


@case
def r2case7_deep_leftovers_are_removed_by_the_next_save_and_by_gc(share: Share) -> None:
    """Past the recursion limit: removed wherever they are leftovers; a directory that is not safeio's is
    walked where its paths fit in PATH_MAX (the NFS-like mount's case), else reported as too deep."""
    levels, too_deep = _depth(share)
    target = checkpoint(share)
    # A killed save of the target left a deep tree in its stage: the next save removes it.
    _deep_tree(share.share, stale_sibling(share.share, "ckpt").name, levels)
    save(target, {"a.txt": "new a"}, mode="merge")
    assert read_tree(target) == {"a.txt": "new a", "sub/b.txt": "old b"}
    assert not siblings(share.share, "stage"), siblings(share.share)
    # gc, dry run and real, beside a deep directory that is not safeio's and another deep leftover.
    _deep_tree(share.share, "not-ours", levels)
    stage = stale_sibling(share.share, "ckpt")
    _deep_tree(share.share, stage.name, levels)
    code, dry = cli("gc", "--dry-run", str(share.share))
    assert str(stage) in dry and stage.is_dir(), dry
    code, text = cli("gc", str(share.share))
    assert not stage.exists() and (share.share / "not-ours").is_dir(), text
    if too_deep:
        assert code == 1 and f"{share.share / 'not-ours'}: too deep" in text, text
    else:
        assert code == 0, text
    _remove_deep_tree(share.share, "not-ours", levels)  # shutil.rmtree, the harness's clean-up, cannot


@case
def r2case7_a_deep_tree_saved_or_planted_is_refused_or_reported(share: Share) -> None:
    levels, too_deep = _depth(share)
    # A body that writes one: refused (naming the target, nothing left behind) or saved.
    deep = share.share / "deep"
    if too_deep:
        exc = raises(safeio.SafeIOError, lambda: _deep_save(deep, levels))
        assert str(deep) in str(exc) and "too deep" in str(exc), exc
        assert not siblings(share.share, "stage") and not deep.exists(), os.listdir(share.share)
    else:
        _deep_save(deep, levels)
        assert safeio.verify(deep) == [], safeio.verify(deep)
        _remove_deep_tree(deep, "sub", levels)
    # A target with one planted inside: verify reports it or lists it, never a traceback.
    target = checkpoint(share)
    _deep_tree(target, "planted", levels)
    code, text = cli("verify", str(target))
    if too_deep:
        assert code == 1 and f"{target / 'planted'}: too deep" in text, text
    else:
        assert code == 0 and "planted/d/d" in text, text  # listed as not in the manifest
    _remove_deep_tree(target, "planted", levels)


def _remove_deep_tree(parent: Path, name: str, levels: int) -> None:
    """Undo ``_deep_tree``: down holding every level, then ``f`` and each ``d`` on the way up."""
    fds = [os.open(parent, os.O_RDONLY | os.O_DIRECTORY)]
    try:
        for part in [name, *["d"] * levels]:
            fds.append(os.open(part, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
        os.unlink("f", dir_fd=fds[-1])
        for part, fd in zip(reversed([name, *["d"] * levels]), reversed(fds[:-1]), strict=True):
            os.rmdir(part, dir_fd=fd)
    finally:
        for fd in fds:
            os.close(fd)


def _deep_save(target: Path, levels: int) -> None:
    with safeio.replicated(target, timeout=10) as stage:
        _deep_tree(Path(stage.path), "sub", levels)


# ---- 9. a bogus latest pointer --------------------------------------------------------------------


@case
def r2case9_a_bogus_latest_is_reported_never_followed_nor_read_whole(share: Share) -> None:
    root = share.share / "run"
    ckpts = safeio.Checkpoints(root, keep=None, timeout=10)
    _step(ckpts, 1, "one")
    pointer = root / "latest"
    bogus: dict[str, Callable[[], None]] = {
        "a link": lambda: os.symlink("/etc/passwd", pointer),
        "a FIFO": lambda: os.mkfifo(pointer),
        "a 1 GiB file": lambda: _sparse(pointer, 1 << 30),
    }
    for what, make in bogus.items():
        pointer.unlink()
        make()
        for command in ("ls", "verify"):
            code, text = cli(command, str(root))
            assert code == 1 and str(pointer) in text, (what, command, code, text)
        with captured_warnings() as warnings:
            latest = ckpts.latest()  # no pointer: the steps are scanned
        assert latest is not None and latest.step == 1, (what, latest)
        assert any(str(pointer) in w for w in warnings), (what, warnings)
        assert os.path.lexists(pointer), what  # not removed: it is not safeio's
    _step(ckpts, 2, "two")  # a save replaces it with a good one (the 1 GiB file, here)
    assert pointer.read_text() == "step_2"
    code, text = cli("verify", str(root))
    assert code == 0, text


def _sparse(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


ROOT_ONLY.update(
    {
        "r2case2_another_users_steps_are_never_retired_nor_resumed_from",
        "r2case1_another_users_merge_stage_is_never_rolled_into_your_target",
        "r2baseline1_owner_blind_recovery_rolls_their_files_into_your_target",
        "r2case8_another_users_killed_save_neither_blocks_yours_nor_goes_unnamed",
        "r2baseline8_removing_another_users_leftover_in_a_sticky_share_is_refused",
    }
)
