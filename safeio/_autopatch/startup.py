"""Run by ``safeio-autopatch.pth`` at interpreter start-up when ``SAFEIO_PATCH`` is set.

Loaded from its file, not imported as part of safeio: importing safeio (fsspec, filelock) at every
start would cost ~150 ms. It reads which parts the variable asks for (``parts``), reports an unknown
word on stderr, and registers ``_PatchWhenImported`` on ``sys.meta_path``; as transformers' modules
finish importing, that imports safeio and installs each part: ``patch_save_pretrained()`` when
``transformers`` is imported (with models for ``models``), ``patch_trainer()`` when
``transformers.trainer_utils`` or ``transformers.trainer`` is (transformers imports them lazily, on
first use of the Trainer), ``patch_accelerator()`` when ``accelerate.accelerator`` is. Each part is
logged on the ``safeio`` logger and recorded in
``os.environ["SAFEIO_PATCH_ACTIVE"]`` as ``<pid>:<part>,<part>`` (what ``safeio autopatch`` reports).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

PARTS = ("save_pretrained", "trainer", "accelerate", "models")
EVERYTHING = ("save_pretrained", "trainer", "accelerate")  # what ``1`` covers
_ON = ("1", "all", "true", "yes", "on")
_OFF = ("0", "off", "false", "no", "none")


def parts(value: str) -> tuple[list[str], list[str]]:
    """The parts ``SAFEIO_PATCH=value`` asks for, and the words it does not know. A comma-separated
    list read left to right: ``1``/``all`` is every part but models; ``models`` is that plus models'
    ``save_pretrained`` (its meaning before the list existed); ``save_pretrained``, ``trainer`` and
    ``accelerate`` add one part each; ``-part`` removes one; ``0``/``off`` removes all."""
    chosen: list[str] = []
    unknown: list[str] = []
    for word in value.replace(" ", "").lower().split(","):
        remove, name = word.startswith("-"), word.lstrip("-")
        if not name:
            continue
        if name in _OFF:
            chosen.clear()
            continue
        if name in _ON:
            names: tuple[str, ...] = EVERYTHING
        elif name == "models":
            names = ("models",) if remove else (*EVERYTHING, "models")
        elif name in PARTS:
            names = (name,)
        else:
            unknown.append(word)
            continue
        for part in names:
            if remove and part in chosen:
                chosen.remove(part)
            elif not remove and part not in chosen:
                chosen.append(part)
    if "models" in chosen and "save_pretrained" not in chosen:
        chosen.remove("models")  # models' save_pretrained is a widening of save_pretrained's patch
    return [p for p in PARTS if p in chosen], unknown


_RAN = "_safeio_autopatch_ran"
_active: list[str] = []
_trainer_patch: list[Any] = []  # the one TrainerPatch installed in this process, once installed


def _record(installed: list[str], what: str) -> None:
    import logging

    _active[:] = [p for p in PARTS if p in _active or p in installed]  # one order, whatever imports first
    os.environ["SAFEIO_PATCH_ACTIVE"] = f"{os.getpid()}:{','.join(_active)}"
    logging.getLogger("safeio").info(
        "SAFEIO_PATCH=%s: %s goes through safeio in this process (pid %d)",
        os.environ.get("SAFEIO_PATCH"),
        what,
        os.getpid(),
    )


def _install_save_pretrained(chosen: list[str]) -> None:
    try:
        from safeio._saves.hf_patch import patch_save_pretrained

        include_models = "models" in chosen
        patch_save_pretrained(include_models=include_models).install()
        _record(
            ["save_pretrained", "models"] if include_models else ["save_pretrained"],
            "save_pretrained" + (" (models included)" if include_models else ""),
        )
    except Exception as exc:  # never break the user's program: say so, leave transformers as it is
        print(f"safeio: SAFEIO_PATCH is set but the patch failed: {exc!r}", file=sys.stderr)


def _install_trainer(chosen: list[str]) -> None:
    try:
        from safeio.integrations.transformers import patch_trainer

        if _trainer_patch:
            _trainer_patch[0].refresh()
        else:
            _trainer_patch.append(patch_trainer().install(load=False))
        trainer_module = sys.modules.get("transformers.trainer")
        if trainer_module is not None and "Trainer" in vars(trainer_module) and "trainer" not in _active:
            _record(["trainer"], "the Trainer's checkpoints (and get_last_checkpoint)")
    except Exception as exc:  # never break the user's program
        print(f"safeio: SAFEIO_PATCH is set but the patch failed (the Trainer's): {exc!r}", file=sys.stderr)


def _install_accelerate() -> None:
    try:
        from safeio.integrations._accelerate_patch import patch_accelerator

        patch_accelerator().install()
        _record(["accelerate"], "accelerate's Accelerator.save_state/load_state")
    except Exception as exc:  # never break the user's program
        print(f"safeio: SAFEIO_PATCH is set but the patch failed (accelerate's): {exc!r}", file=sys.stderr)


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the part that waits for it."""

    def __init__(self, inner: Any, then: Callable[[], None]) -> None:
        self.inner = inner
        self.then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create = getattr(self.inner, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.then()


class _PatchWhenImported(importlib.abc.MetaPathFinder):
    def __init__(self, waiting: dict[str, Callable[[], None]]) -> None:
        self.waiting = waiting

    def find_spec(
        self, name: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        then = self.waiting.pop(name, None)
        if then is None:
            return None
        if not self.waiting:
            sys.meta_path.remove(self)
        spec = None
        for finder in list(sys.meta_path):  # the finders after this one, as if it were not there
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader, then)
        return spec


def _start() -> None:
    # Once per process: a venv whose lib64 links to lib has its site-packages processed twice. The mark
    # is no module of safeio's (safeio itself is not imported until transformers is).
    if _RAN in sys.modules:
        return
    sys.modules[_RAN] = ModuleType(_RAN, "marks that safeio's start-up hook ran in this process")
    value = os.environ.get("SAFEIO_PATCH", "")
    chosen, unknown = parts(value)
    if unknown:
        print(
            f"safeio: SAFEIO_PATCH={value!r}: unknown {', '.join(map(repr, unknown))} ignored (known: "
            f"1, all, {', '.join(PARTS)}, -part to remove one, 0); "
            f"patching: {', '.join(chosen) or 'nothing'}",
            file=sys.stderr,
        )
    waiting: dict[str, Callable[[], None]] = {}
    if "save_pretrained" in chosen:
        waiting["transformers"] = lambda: _install_save_pretrained(chosen)
    if "trainer" in chosen:
        for module in ("transformers.trainer_utils", "transformers.trainer"):
            waiting[module] = lambda: _install_trainer(chosen)
    if "accelerate" in chosen:
        waiting["accelerate.accelerator"] = _install_accelerate
    now = [name for name in waiting if name in sys.modules]  # imported before site ran (not normally)
    for name in now:
        waiting.pop(name)()
    if waiting:
        sys.meta_path.insert(0, _PatchWhenImported(waiting))


if __name__ == "safeio_autopatch_startup":  # run by the .pth; as safeio._autopatch.startup, a library
    _start()
