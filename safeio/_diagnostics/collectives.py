"""Writer-only sections: a torch.distributed collective called where only the writer runs fails at once.

The save of a replicated object runs on the writer alone while the other ranks wait for its outcome. A
collective called inside it (``torch.distributed.checkpoint.save`` behind a rank-0 guard, an
``all_gather_object`` in a custom ``save_pretrained``) waits for ranks that never join: the writer
deadlocks and the job hangs silently (transformers#48569, accelerate#1171). Inside
``writer_only_section`` those collectives raise ``CollectiveInWriterSection`` instead, before they block;
the writer publishes that failure, so every other rank raises ``RemoteWriterError`` naming it.

How, and its limits:
- The functions are replaced in ``torch.distributed`` and ``torch.distributed.distributed_c10d`` only
  while a section is active, and restored when the last one ends: torch.compile recognises the c10d
  functions by identity when it traces collectives, so a permanent wrapper would change how compiled
  training code is traced. Calls that look the function up at call time (``dist.all_gather_object(...)``,
  as DCP's ``_DistWrapper`` does, and c10d's own object collectives) are caught; a name bound earlier
  with ``from torch.distributed import barrier`` is not: the watchdog's stall warning names it instead
  (``blocked_in_collective`` reads the writer thread's stack).
- Sections belong to the thread that entered them: another thread of the writer process (an async
  checkpoint thread that runs DCP on every rank) may run collectives meanwhile. Threads started inside
  a section are not covered.
- Nothing here imports torch: if ``torch.distributed`` is not imported yet, no process group exists and
  no collective can be called (``init_process_group`` must precede any save that has peers).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, ClassVar

from safeio._errors import CollectiveInWriterSection
from safeio._storage.location import as_str_path
from safeio._who import who

# Every collective of torch.distributed (c10d) that needs the other ranks to make the same call.
COLLECTIVES: tuple[str, ...] = (
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
)
_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")

# thread ident -> the targets of that thread's open sections (innermost last). Keyed by ident rather
# than thread-local so that the watchdog's thread can tell whether the writer thread is in a section.
_threads: dict[int, list[str]] = {}


class _Installed:
    lock: ClassVar[threading.Lock] = threading.Lock()
    depth: ClassVar[int] = 0  # sections active in any thread
    # id(original) -> its wrapper, reused across sections
    wrappers: ClassVar[dict[int, Callable[..., Any]]] = {}


def active_section(thread: int | None = None) -> str | None:
    """The target of the innermost writer-only section of ``thread`` (default: this one), or None."""
    targets = _threads.get(threading.get_ident() if thread is None else thread)
    return targets[-1] if targets else None


def blocked_in_collective(frame: FrameType | None) -> str | None:
    """The torch.distributed collective a thread is inside, judged from its innermost ``frame``: the
    outermost c10d function of that name (the one the caller called), or None."""
    found = None
    while frame is not None:
        code = frame.f_code
        if code.co_name in COLLECTIVES and "/torch/distributed/" in code.co_filename.replace(os.sep, "/"):
            found = code.co_name
        frame = frame.f_back
    return found


@contextlib.contextmanager
def writer_only_section(target: str | os.PathLike[str]) -> Iterator[None]:
    """Run a block that only the writer executes: torch.distributed collectives in it raise
    ``CollectiveInWriterSection`` (naming the collective and ``target``) instead of deadlocking."""
    shown = as_str_path(target)  # checked before the section starts, not at its first collective
    targets = _threads.setdefault(threading.get_ident(), [])
    targets.append(shown)
    with _Installed.lock:
        _Installed.depth += 1
        _install()
    try:
        yield
    finally:
        targets.pop()
        if not targets:
            _threads.pop(threading.get_ident(), None)
        with _Installed.lock:
            _Installed.depth -= 1
            if _Installed.depth == 0:
                _uninstall()


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    wrapper = _Installed.wrappers.get(id(original))
    if wrapper is not None:
        return wrapper

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        target = active_section()
        if target is not None:
            raise CollectiveInWriterSection(
                f"{who()}: torch.distributed.{name}() was called inside the writer-only save of "
                f"{target}: only the writer runs this code, so the other ranks never join the "
                f"collective and the writer would wait for them forever. Collective and sharded saves "
                f"(torch.distributed.checkpoint, FSDP state-dict gathers) must run on every rank, "
                f"outside safeio's replicated saves.",
                target,
            )
        return original(*args, **kwargs)

    guarded.__safeio_original__ = original  # type: ignore[attr-defined]
    _Installed.wrappers[id(original)] = guarded
    return guarded


def _collectives() -> Iterator[tuple[Any, str, Any]]:
    """(module, name, current function) of every collective of the imported torch.distributed modules."""
    for module_name in _MODULES:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name in COLLECTIVES:
            current = getattr(module, name, None)
            if current is not None:
                yield module, name, current


def _install() -> None:
    for module, name, current in _collectives():
        if not hasattr(current, "__safeio_original__"):
            setattr(module, name, _wrap(name, current))


def _uninstall() -> None:
    for module, name, current in _collectives():
        original = getattr(current, "__safeio_original__", None)
        # Only our own wrapper: whoever patched the name after us (a test's monkeypatch) keeps theirs.
        if original is not None:
            setattr(module, name, original)
