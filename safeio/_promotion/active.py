"""The stages open in this process, so that a save nested inside one writes straight into it.

A processor's ``save_pretrained`` saves its tokenizer into the same directory; under the patch that
nested call would otherwise open a second stage, take the lock again and wait for peers that never
make the nested call (they skipped the outer body). Nested saves get no stage, lock, identity or wait.
Nesting is per thread: a save of the same directory from another thread at the same time (a background
checkpoint thread) is a save of its own, not part of the one running here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol


class WriterResults(Protocol):
    """How a save nested in a stage that only the writer keeps (a checkpoint's) hands the writer's return
    value to the other ranks, which then never make the save at all (their files would be thrown away).
    Saves are told apart by ``identity`` (``safeio._saves.identity``), numbered per stage."""

    @property
    def writes(self) -> bool:
        """Whether this rank makes the nested saves itself (the writer; any rank without a store)."""

    def publish(self, identity: str, value: Any, error: BaseException | None) -> None:
        """The writer: what its save of ``identity`` returned (or raised)."""

    def hear(self, identity: str) -> Any:
        """The other ranks: what the writer's save of ``identity`` returned; raises what it raised."""


@dataclass(frozen=True)
class ActiveStage:
    target: str  # absolute local path or URL
    stage: str  # local path
    thread: int = field(default_factory=threading.get_ident)  # the thread whose body writes into it
    # Where saves nested in it write, when not the stage itself: a checkpoint's stage is shared by every
    # rank (sharded files), but its replicated files are written by one rank; the others' go to scratch.
    replicated: str | None = None
    # Set when the other ranks' replicated files would be thrown away (a checkpoint's scratch): they skip
    # such saves and are handed the writer's result instead.
    results: WriterResults | None = None


_lock = threading.Lock()
_active: list[ActiveStage] = []


def _within(path: str, root: str) -> str | None:
    """``path`` relative to ``root`` ("" for root itself), or None if it is outside."""
    if path == root:
        return ""
    prefix = root.rstrip("/") + "/"
    return path[len(prefix) :] if path.startswith(prefix) else None


def redirect(path: str) -> str | None:
    """Where ``path`` lives inside an active stage of this thread, or None if none covers it."""
    found = covering(path)
    return found[0] if found is not None else None


def covering(path: str) -> tuple[str, ActiveStage] | None:
    """Where ``path`` lives inside an active stage of this thread, and that stage; None if none covers it."""
    thread = threading.get_ident()
    with _lock:
        for entry in reversed(_active):
            if entry.thread != thread:
                continue
            rel = _within(path, entry.stage)
            if rel is None:
                rel = _within(path, entry.target)
            if rel is not None:
                base = entry.replicated or entry.stage
                return (base if rel == "" else f"{base}/{rel}"), entry
    return None


def push(entry: ActiveStage) -> None:
    with _lock:
        _active.append(entry)


def pop(entry: ActiveStage) -> None:
    with _lock:
        if entry in _active:
            _active.remove(entry)


def inside_stage(path: str) -> bool:
    """Whether ``path`` is an active stage of this process or lies inside one (safeio.audit exempts it)."""
    # No lock: an audit hook must never block (it runs inside every open of the process), and copying
    # the list is atomic under the GIL.
    return any(_within(path, entry.stage) is not None for entry in tuple(_active))
