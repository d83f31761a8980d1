"""Merge: each file of the stage replaces its namesake in the existing directory; other files stay.

Hugging Face's contract is "write my files into this directory": a checkpoint directory holds a model,
its tokenizer and its config side by side, and replacing the whole directory when the tokenizer is saved
would delete the model. Each file is ``os.replace``d (atomic, never truncated in place; measured: 0 failed
loads for concurrent readers, who may still combine files of two versions).

The set is made whole after a crash: before the first replacement the stage records the intent (the
target's name and the files, in order) durably, and recovery rolls an interrupted merge forward. The
intent is a key of the stage's manifest, which moves last (a merge without a manifest, and stages of
earlier versions, have it in ``.safeio-merge-intent.json``). A merge
that fails part-way (a destination not writable, say) keeps its stage and intent, so the next save of the
target or ``safeio gc`` rolls it forward to the whole new set once the cause is fixed.

Both sides are walked through descriptors: a symlinked directory planted in the target, or in a stale
stage, is refused rather than followed, and only regular files and links (moved as links) ever move.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
from typing import Any

from safeio._errors import InvalidTargetError
from safeio._promotion.behaviour import Behaviour
from safeio._promotion.local import LocalPromotion
from safeio._promotion.recovery_records import Action, Leftover
from safeio._storage import manifest
from safeio._storage.dirfd import held_directory, lstat_at, open_directory, open_relative_directory
from safeio._storage.fsops import remove_at
from safeio._storage.metadata import INTENT_CAP, Damaged, load_manifest, read_json, validate_intent
from safeio._storage.names import truncated_base
from safeio._who import who

logger = logging.getLogger("safeio")


class Merge(Behaviour):
    def __init__(self) -> None:
        self._intent_written = False

    def commit(self, p: LocalPromotion, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        with p.target_directory() as target_fd:
            files = list(p.contents.content)
            if p.options.manifest:
                files.append(manifest.MANIFEST_NAME)  # last: it describes the whole set
            self._check_conflicts(p, target_fd, files)
            intent = {"target_name": p.name, "files": files}
            if p.options.manifest:
                # One file and one fsync for both: the manifest is in the stage until the last move.
                p.write_manifest(entries, target_fd, intent)
                self._intent_written = True
            else:
                self._write_intent(p, intent)
            p.seal_stage()
            p.parent_changed = False  # only the target's entries change (the stage's removal need not last)
            roll_forward(p.stage_fd, target_fd, files, durable=p.options.durable)
        self._remove_merged_stage(p, stage)

    def _remove_merged_stage(self, p: LocalPromotion, stage: str) -> None:
        """What is left of a merged stage: its intent file (without a manifest), and directories emptied
        by the moves."""
        try:
            if not p.options.manifest:
                os.unlink(manifest.MERGE_INTENT_NAME, dir_fd=p.stage_fd)
            os.rmdir(p.stage_name, dir_fd=p.parent_fd)
        except OSError:  # subdirectories (or something a rival put there): the general removal
            remove_at(p.parent_fd, p.stage_name, what="merged stage", shown=stage)

    def _write_intent(self, p: LocalPromotion, intent: dict[str, Any]) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(manifest.MERGE_INTENT_NAME, flags, 0o666, dir_fd=p.stage_fd)
        try:
            os.write(fd, json.dumps(intent).encode())
            if p.options.durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        self._intent_written = True

    def keeps_failed_stage(self, p: LocalPromotion, stage: str) -> bool:
        if self._intent_written:
            # Some files may already be in the target: removing the stage would leave it half merged
            # for good. Keep stage and intent for the next save or `safeio gc` to roll forward.
            logger.warning(
                "%s: the merge into %s failed part-way; its stage %s is kept so that the next save of "
                "the target or `safeio gc` completes it",
                who(p.rank),
                p.target,
                stage,
            )
            # Its files may be read back into the target by a later save: nobody else may read or change
            # them meanwhile (a shared directory).
            with contextlib.suppress(OSError):
                os.fchmod(p.stage_fd, 0o700)
            return True
        return False

    def _check_conflicts(self, p: LocalPromotion, target_fd: int, files: list[str]) -> None:
        for rel in files:
            if "/" not in rel:  # a top-level file (most saves): one lstat, no descriptor to walk
                st = lstat_at(target_fd, rel)
                if st is not None and stat.S_ISDIR(st.st_mode):
                    raise InvalidTargetError(
                        f"cannot merge {rel} into {p.target}: it is a directory there", p.target
                    )
                continue
            parts = rel.split("/")
            fd = os.dup(target_fd)
            try:
                for depth, part in enumerate(parts):
                    st = lstat_at(fd, part)
                    if st is None:
                        break
                    last = depth == len(parts) - 1
                    if stat.S_ISLNK(st.st_mode) and not last:
                        raise InvalidTargetError(
                            f"cannot merge {rel} into {p.target}: {'/'.join(parts[: depth + 1])} is a "
                            "symlink there, and safeio never writes through one",
                            p.target,
                        )
                    if last:
                        if stat.S_ISDIR(st.st_mode):
                            raise InvalidTargetError(
                                f"cannot merge {rel} into {p.target}: it is a directory there", p.target
                            )
                        break
                    if not stat.S_ISDIR(st.st_mode):
                        raise InvalidTargetError(
                            f"cannot merge {rel} into {p.target}: {'/'.join(parts[: depth + 1])} is a "
                            "file there",
                            p.target,
                        )
                    child = open_directory(part, dir_fd=fd)
                    os.close(fd)
                    fd = child
            finally:
                os.close(fd)

    @staticmethod
    def recover(
        leftover: Leftover, target_name: str | None, *, dry_run: bool, durable: bool
    ) -> Action | None:
        """A stage with a merge intent: roll it forward. None when the stage holds no intent."""
        pfd = leftover.parent_fd
        try:
            stage_fd = open_directory(leftover.name, dir_fd=pfd)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM):
                # Another user's stage closed to others (a failed merge's is 0700): whether it holds a
                # merge to complete cannot be told, so it is not taken for a plain stale stage.
                raise
            return None  # not a directory (a planted link or file): removed like any stale sibling
        try:
            raw = _read_intent(stage_fd)
            if raw is None:
                return None
            named = _intent_target(raw, leftover, target_name)
            intent = validate_intent(raw, named) if named is not None else Damaged("no target name")
            if isinstance(intent, Damaged):
                # Half-written (its writer died before the first file moved) or crafted: nothing to roll
                # forward from it. The stale stage goes like any other, never followed or read further.
                return _remove(
                    leftover, dry_run, f"{leftover.reason}; its merge intent is unusable: {intent.reason}"
                )
            target = os.path.join(leftover.parent, named or "")
            size = leftover.size
            if not dry_run:
                _roll_leftover_forward(stage_fd, leftover, str(named), intent["files"], durable)
                logger.warning(
                    "%s: rolled an interrupted merge forward into %s (%s)", who(), target, leftover.reason
                )
            reason = f"interrupted merge into {target}; {leftover.reason}"
            return Action("roll-forward", leftover.path, reason, size)
        finally:
            os.close(stage_fd)


def _read_intent(stage_fd: int) -> object:
    """A stage's merge intent as found (validated by the caller): its intent file, else the key of its
    manifest; None when it has neither (every file moved, or not a merge)."""
    raw = read_json(stage_fd, manifest.MERGE_INTENT_NAME, INTENT_CAP)
    if raw is not None:
        return raw
    record = load_manifest(stage_fd, manifest.MANIFEST_NAME)
    if not isinstance(record, dict):
        return None  # absent, or damaged: removed like any stale stage, never read further
    return record.get(manifest.MERGE_INTENT_KEY)


def _intent_target(raw: object, leftover: Leftover, target_name: str | None) -> str | None:
    """The target the intent may name: the stage's own (from its name), never another."""
    named = raw.get("target_name") if isinstance(raw, dict) else None
    if not isinstance(named, str):
        return None
    if target_name is not None:
        return target_name
    return named if truncated_base(named) == leftover.sibling.base else leftover.sibling.base


def _roll_leftover_forward(
    stage_fd: int, leftover: Leftover, name: str, files: list[str], durable: bool
) -> None:
    pfd = leftover.parent_fd
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o777, dir_fd=pfd)  # a merge's target existed; put it back if it has gone
    try:
        with held_directory(name, dir_fd=pfd) as target_fd:
            roll_forward(stage_fd, target_fd, files, durable=durable)
    except OSError as exc:
        raise InvalidTargetError(
            f"cannot roll the merge {leftover.path} forward into {os.path.join(leftover.parent, name)}: "
            f"{exc.strerror or exc} (a link or a file where a directory should be?)",
            leftover.path,
        ) from exc
    remove_at(pfd, leftover.name, what="merged stage", shown=leftover.path)


def roll_forward(stage_fd: int, target_fd: int, files: list[str], *, durable: bool) -> None:
    """Move every file of ``files`` still in the stage into the target, in order (names, not paths).

    Only regular files and links move, from real directories of the stage; in the target, a directory
    on the way that is a link or a file raises (ELOOP/ENOTDIR).
    """
    synced: set[str] = set()
    for rel in files:
        rel_dir, _, name = rel.rpartition("/")
        if not rel_dir:  # a top-level file (most saves): both directories are held already
            _move_top_level(stage_fd, target_fd, name)
            synced.add("")
            continue
        try:
            src = open_relative_directory(stage_fd, rel_dir)
        except FileNotFoundError:
            continue  # its directory was already emptied before the crash
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            continue  # a link or a file where the stage had a directory: planted, never followed
        try:
            st = lstat_at(src, name)
            if st is None or not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                continue  # replaced before the crash (or nothing a merge moves)
            dst = open_relative_directory(target_fd, rel_dir, create=True)
            try:
                os.replace(name, name, src_dir_fd=src, dst_dir_fd=dst)
            finally:
                os.close(dst)
            synced.add(rel_dir)
        finally:
            os.close(src)
    if durable:  # the replaced names, children before parents
        for rel_dir in sorted(synced, key=len, reverse=True):
            fd = open_relative_directory(target_fd, rel_dir)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _move_top_level(stage_fd: int, target_fd: int, name: str) -> None:
    """``roll_forward``'s move of one file at the top of the stage (same rules, no walk)."""
    st = lstat_at(stage_fd, name)
    if st is not None and (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        os.replace(name, name, src_dir_fd=stage_fd, dst_dir_fd=target_fd)


def _remove(leftover: Leftover, dry_run: bool, reason: str) -> Action:
    size = leftover.size
    if not dry_run:
        remove_at(leftover.parent_fd, leftover.name, what="stale stage", shown=leftover.path)
    return Action("remove", leftover.path, reason, size)
