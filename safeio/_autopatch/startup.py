"""Run by ``safeio-autopatch.pth`` at interpreter start-up when ``SAFEIO_PATCH`` is set.

Loaded from its file, not imported as part of safeio: importing safeio (fsspec, filelock) at every
start would cost ~150 ms. It only registers ``_PatchWhenImported`` on ``sys.meta_path``; when
``transformers`` has been imported, that imports safeio and installs ``patch_save_pretrained()`` (with
models when ``SAFEIO_PATCH=models``), logs it on the ``safeio`` logger and records it in
``os.environ["SAFEIO_PATCH_ACTIVE"]`` (what ``safeio autopatch`` reports).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any


def _install() -> None:
    try:
        import logging

        from safeio._saves.hf_patch import patch_save_pretrained

        include_models = os.environ.get("SAFEIO_PATCH", "").strip().lower() == "models"
        patch_save_pretrained(include_models=include_models).install()
        os.environ["SAFEIO_PATCH_ACTIVE"] = str(os.getpid())
        logging.getLogger("safeio").info(
            "SAFEIO_PATCH=%s: save_pretrained goes through safeio in this process (pid %d)%s",
            os.environ.get("SAFEIO_PATCH"),
            os.getpid(),
            " (models included)" if include_models else "",
        )
    except Exception as exc:  # never break the user's program: say so, leave transformers as it is
        print(f"safeio: SAFEIO_PATCH is set but the patch failed: {exc!r}", file=sys.stderr)


class _Loader(importlib.abc.Loader):
    """transformers' own loader, then the patch."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create = getattr(self.inner, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _install()


class _PatchWhenImported(importlib.abc.MetaPathFinder):
    def find_spec(
        self, name: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "transformers":
            return None
        sys.meta_path.remove(self)  # once, and not for the lookup below
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


if "transformers" in sys.modules:  # imported before site ran (cannot happen normally)
    _install()
else:
    sys.meta_path.insert(0, _PatchWhenImported())
