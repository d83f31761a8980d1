"""``SAFEIO_PATCH=accelerate``: ``Accelerator.save_state`` / ``load_state`` of a program nobody here
edits (accelerate's own ``test_checkpointing.py``, a user's training script) through
``safeio.integrations.accelerate``.

Where the script saves decides what safeio can protect, since the patch keeps the script's own names:

- ``save_state(output_dir)`` whose last path component ends in a step number (``epoch_3``,
  ``checkpoint_7``, ``step-12``, a ``tempfile`` directory ``tmpk2f9``): committed as that step of a
  ``Checkpoints`` at its parent, named by the same pattern (``epoch_{step}``), keeping every step
  (accelerate retires nothing for a named directory), with no pointer file in the parent
  (``pointer=False``: it is the script's directory, and accelerate's own listing of it must not change).
  As accelerate writes into ``output_dir`` whatever it holds, the directory is the script's: an empty
  one it made, or one it wrote a tokenizer into, is committed with its files (``adopt``); a step saved
  again is committed anew;
- ``save_state()`` with ``automatic_checkpoint_naming`` (accelerate then ignores ``output_dir``): the
  adapter's default, ``<project_dir>/checkpoints/checkpoint_<N>``, retention by ``total_limit``;
- any other ``output_dir`` (no number, a zero-padded one ``StepNames`` cannot round-trip): accelerate's
  own save, in place, with one WARNING per directory that it is not protected.

``load_state(input_dir)`` of such a numbered directory loads it only when it is committed (every rank
gets the writer's answer); one accelerate wrote without safeio is loaded with a WARNING when complete by
the adapter's rule (``_accelerate_files``), else ``InvalidTargetError`` names it on every rank (a save
killed mid-way) with the committed steps. ``load_state()`` with automatic naming loads the adapter's
latest. A call made while a safeio save is writing (the adapter's own, the Trainer patch's stage) is
accelerate's, untouched: nothing is staged twice.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

from safeio import Checkpoints, InvalidTargetError
from safeio.frameworks import Patch, is_staged, process_name
from safeio.integrations import accelerate as adapter
from safeio.integrations._accelerate_files import is_complete_for

__all__ = ["AcceleratorPatch", "patch_accelerator"]

logger = logging.getLogger("safeio")

# A step number as StepNames writes it (no sign, no leading zero), after a prefix ending in a non-digit.
_NUMBERED = re.compile(r"(.*[^0-9])(0|[1-9][0-9]{0,17})")

_lock = threading.Lock()  # guards _roots
_warned: set[str] = set()
_calling = threading.local()  # set while this thread is inside the adapter, called by the patch


class AcceleratorPatch(Patch):
    """``install()``/``uninstall()`` or a context manager; installs are counted, the last uninstall
    restores accelerate's own methods (``safeio.frameworks.Patch``)."""

    def apply(self) -> None:
        from accelerate.accelerator import Accelerator  # not `accelerate`: still importing when patched

        for name, wrap in (("save_state", _save_state), ("load_state", _load_state)):
            if not self.is_replaced(Accelerator, name):
                self.replace(Accelerator, name, wrap(vars(Accelerator)[name]))


def patch_accelerator() -> AcceleratorPatch:
    """The patch ``SAFEIO_PATCH`` installs for accelerate (see ``AcceleratorPatch``)."""
    return AcceleratorPatch()


def numbered(directory: str | os.PathLike[str]) -> tuple[str, str, int] | None:
    """(parent, name pattern, step) of a directory whose name ends in a step number, else None."""
    path = os.path.abspath(os.fspath(directory)).rstrip("/")
    match = _NUMBERED.fullmatch(os.path.basename(path))
    if match is None or "{" in match[1] or "}" in match[1]:
        return None
    return os.path.dirname(path), match[1] + "{step}", int(match[2])


def _accelerates_own(directory: Any) -> bool:
    """Whether this call is left to accelerate: the adapter's own call into it, or a save into a
    safeio stage already open on this thread (nothing is staged twice)."""
    if getattr(_calling, "inside", False):
        return True
    return directory is not None and is_staged(directory)


@contextlib.contextmanager
def _through_adapter() -> Iterator[None]:
    _calling.inside = True
    try:
        yield
    finally:
        _calling.inside = False


def _save_state(original: Any) -> Any:
    @functools.wraps(original)
    def save_state(self: Any, output_dir: Any = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        if _accelerates_own(output_dir):
            return original(self, output_dir, safe_serialization, **kwargs)
        options = dict(kwargs, safe_serialization=safe_serialization)
        if self.project_configuration.automatic_checkpoint_naming:
            with _through_adapter():
                return adapter.save_state(self, **options).path
        found = numbered(output_dir) if output_dir is not None else None
        if found is None:
            _warn_unprotected(self, output_dir)
            return original(self, output_dir, safe_serialization, **kwargs)
        root, name, step = found
        with _through_adapter():
            return adapter.committed_save_state(
                self, _checkpoints(root, name), step, adopt=True, **options
            ).path

    return save_state


def _warn_unprotected(accelerator: Any, output_dir: Any) -> None:
    key = os.path.abspath(os.fspath(output_dir)) if output_dir is not None else repr(output_dir)
    if key in _warned:
        return
    _warned.add(key)
    logger.warning(
        "%s: accelerator.save_state(%s) is not protected by safeio (SAFEIO_PATCH=accelerate): its name "
        "does not end in a step number (like epoch_3), so accelerate writes it in place",
        process_name(accelerator.process_index),
        key,
    )


def _load_state(original: Any) -> Any:
    @functools.wraps(original)
    def load_state(self: Any, input_dir: Any = None, load_kwargs: Any = None, **kwargs: Any) -> Any:
        if _accelerates_own(input_dir):
            return original(self, input_dir, load_kwargs, **kwargs)
        if input_dir is None:
            if not self.project_configuration.automatic_checkpoint_naming:
                return original(self, input_dir, load_kwargs, **kwargs)  # accelerate's own error
            ckpts = adapter.checkpoints_for(self)
            with _through_adapter():
                found = adapter.load_state(self, ckpts, load_kwargs=load_kwargs, **kwargs)
            if found is None:
                raise InvalidTargetError(
                    f"accelerator.load_state(): no committed checkpoint under {ckpts.root}", ckpts.root
                )
            return None
        target = numbered(input_dir)
        if target is not None:
            _check_loadable(self, input_dir, *target)
        return original(self, input_dir, load_kwargs, **kwargs)

    return load_state


_roots: dict[tuple[str, str], Checkpoints] = {}  # one per (parent, pattern): its recovery runs once


def _checkpoints(root: str, name: str) -> Checkpoints:
    """The ``Checkpoints`` of a script's numbered directories: keep=None (accelerate retires nothing it
    was given a name for), no pointer file in the script's directory."""
    with _lock:
        if (root, name) not in _roots:
            _roots[(root, name)] = Checkpoints(root, keep=None, name=name, pointer=False)
        return _roots[(root, name)]


def _check_loadable(accelerator: Any, input_dir: Any, root: str, name: str, step: int) -> None:
    """Return when ``input_dir`` (step ``step`` of ``root``) may be loaded; raise naming it when not. The
    decision is the writer's, for every rank (``Checkpoints.at``): ranks whose views of a shared
    directory differ load the same or fail together."""
    path = os.fspath(input_dir)
    try:
        # Written by accelerate without safeio (no marker at all): loaded when complete by the files
        # accelerate's load_state reads, with a WARNING.
        _checkpoints(root, name).at(step, unmarked=lambda found: is_complete_for(accelerator, found))
    except InvalidTargetError as exc:
        raise InvalidTargetError(
            f"accelerator.load_state({path}): not a checkpoint safeio committed (a save killed mid-way "
            f"leaves none under its final name) nor a complete one written without safeio; {exc}",
            path,
        ) from exc
