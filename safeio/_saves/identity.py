"""Which save is which, across ranks: the call that makes it, not how many saves a process has made.

A peer must match its own save to the writer's save *of the same thing*. Counting saves per target in
each process does not: real code mixes saves guarded by "rank 0 only" (HF Trainer's ``save_model``,
accelerate's ``is_main_process``) with unguarded ones into one directory, so rank 0's count ran ahead and
a peer's tokenizer save was matched to rank 0's config save, returning before the tokenizer existed.

A save is identified instead by what makes it: the type of the object saved (for ``save_pretrained``)
and the line of code that calls safeio (module, function, line: the first frame outside safeio). Ranks
run the same program, so a save every rank makes has the same identity on all of them, while a guarded
save made elsewhere (``Trainer._save`` rather than the user's script) or of another object has another,
and peers never wait for it. Saves with one identity are numbered in order, which keeps a loop that
saves into one target on every iteration in step. Only the innermost frame counts: the frames below it
differ between a launcher's rank 0 and its children (a pool worker, a notebook) for the same save.

What remains matched by count: one line that some ranks pass more often than others for the same target
and object type — a save in a loop whose guard differs by rank, or a helper function that saves
differently guarded things of one type from its one line.
"""

from __future__ import annotations

import hashlib
import sys
from types import FrameType


def _is_internal(module: str) -> bool:
    # safeio's own frames (other than the public test helpers) and contextlib's (a ``with`` statement)
    # are the same for every save.
    if module == "contextlib":
        return True
    return (module == "safeio" or module.startswith("safeio.")) and not module.startswith("safeio.testing")


def call_site(start: FrameType | None) -> str:
    """``module:function:line`` of the first frame at or below ``start`` that is not safeio's."""
    frame = start
    while frame is not None:
        module = str(frame.f_globals.get("__name__", "?"))
        if not _is_internal(module):
            return f"{module}:{frame.f_code.co_qualname}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def save_identity(what: str | None = None) -> str:
    """The identity of the save being entered: ``what`` is saved (an object's type), from which line.
    Equal on every rank that makes the same call in the same program."""
    site = call_site(sys._getframe(1))
    digest = hashlib.sha256(f"{what or ''}\n{site}".encode()).hexdigest()[:12]
    return f"{what or 'a save'} from {site} [{digest}]"
