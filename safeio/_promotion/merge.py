"""Merge: each file of the stage replaces its namesake in the existing directory; other files stay.

Hugging Face's contract is "write my files into this directory": a checkpoint directory holds a model,
its tokenizer and its config side by side, and replacing the whole directory when the tokenizer is saved
would delete the model. Each file is ``os.replace``d (atomic, never truncated in place; measured: 0 failed
loads for concurrent readers, who may still combine files of two versions).

The set is made whole after a crash: before the first replacement the stage records the intent (the
target's name and the files, in order) durably, and recovery rolls an interrupted merge forward. A merge
that fails part-way (a destination not writable, say) keeps its stage and intent, so the next save of the
target or ``safeio gc`` rolls it forward to the whole new set once the cause is fixed.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from safeio._errors import InvalidTargetError
from safeio._promotion.local import LocalPromotion
from safeio._promotion.recovery import Action, Leftover
from safeio._storage import manifest
from safeio._storage.fsops import remove_tree
from safeio._storage.posix import fsync_path
from safeio._who import who

logger = logging.getLogger("safeio")


class Merge(LocalPromotion):
    _intent_written = False

    def _replace_existing(self, stage: str, entries: dict[str, dict[str, Any]]) -> None:
        target = self.target
        self.write_manifest(stage, entries, target)
        files = manifest.content_files(stage)
        if self.options.manifest:
            files.append(manifest.MANIFEST_NAME)  # last: it describes the whole set
        self._check_conflicts(files)
        with open(os.path.join(stage, manifest.MERGE_INTENT_NAME), "x", encoding="utf-8") as f:
            json.dump({"target_name": self.name, "files": files}, f)
            if self.options.durable:
                f.flush()
                os.fsync(f.fileno())
        if self.options.durable:
            fsync_path(stage, directory=True)
        self._intent_written = True
        roll_forward(stage, target, files, durable=self.options.durable)

    def discard(self, stage: str) -> None:
        if self._intent_written:
            # Some files may already be in the target: removing the stage would leave it half merged
            # for good. Keep stage and intent for the next save or `safeio gc` to roll forward.
            logger.warning(
                "%s: the merge into %s failed part-way; its stage %s is kept so that the next save of "
                "the target or `safeio gc` completes it",
                who(self.rank),
                self.target,
                stage,
            )
            return
        super().discard(stage)

    def _check_conflicts(self, files: list[str]) -> None:
        for rel in files:
            parts = rel.split("/")
            for depth in range(1, len(parts)):
                prefix = os.path.join(self.target, *parts[:depth])
                if os.path.lexists(prefix) and not os.path.isdir(prefix):
                    raise InvalidTargetError(
                        f"cannot merge {rel} into {self.target}: {prefix} is a file there", self.target
                    )
            dest = os.path.join(self.target, *parts)
            if os.path.isdir(dest) and not os.path.islink(dest):
                raise InvalidTargetError(
                    f"cannot merge {rel} into {self.target}: it is a directory there", self.target
                )

    @staticmethod
    def recover(
        leftover: Leftover, target_name: str | None, *, dry_run: bool, durable: bool
    ) -> Action | None:
        """A stage with a merge intent: roll it forward. None when the stage has no intent."""
        intent = read_intent(leftover.path)
        if intent is None:
            return None
        named = str(intent.get("target_name", ""))
        if target_name is not None and named != target_name:
            return Action("skip", leftover.path, "merge intent of another target")
        target = os.path.join(leftover.parent, named)
        size = leftover.size
        if not dry_run:
            listed = intent["files"]
            files = [str(f) for f in listed] if isinstance(listed, list) else []
            roll_forward(leftover.path, target, files, durable=durable)
            logger.warning(
                "%s: rolled an interrupted merge forward into %s (%s)", who(), target, leftover.reason
            )
        return Action(
            "roll-forward", leftover.path, f"interrupted merge into {target}; {leftover.reason}", size
        )


def read_intent(stage: str) -> dict[str, object] | None:
    try:
        with open(os.path.join(stage, manifest.MERGE_INTENT_NAME), encoding="utf-8") as f:
            intent = json.load(f)
    except (OSError, ValueError):
        return None
    return intent if isinstance(intent, dict) and isinstance(intent.get("files"), list) else None


def roll_forward(stage: str, target: str, files: list[str], *, durable: bool) -> None:
    """Replace every file of ``files`` still in ``stage`` into ``target``, in order, then drop the stage."""
    touched: set[str] = set()
    for rel in files:
        src = os.path.join(stage, *rel.split("/"))
        if not os.path.lexists(src):
            continue  # replaced before the crash
        dst = os.path.join(target, *rel.split("/"))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.replace(src, dst)
        touched.add(os.path.dirname(dst))
    if durable:
        for directory in sorted(touched, key=len, reverse=True):
            fsync_path(directory, directory=True)
    remove_tree(stage, what="merged stage")
