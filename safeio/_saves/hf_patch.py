"""``safeio.patch_save_pretrained``: every ``save_pretrained`` of transformers' classes through safeio.

For code you do not own (HF Trainer, accelerate, your own loop). While installed, the ``save_pretrained``
of tokenizers, processors, image processors, feature extractors, configs and generation configs (models
too with ``include_models``) is replaced by a wrapper that calls ``safeio._saves.hf.save_through``; classes
defined while the patch is active (transformers imports model modules lazily) are wrapped as they appear.
The last uninstall restores exactly the attributes that were there before (``safeio._saves.patches``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from safeio._options import LockSetting, Mode, SaveOptions
from safeio._saves.hf import save_through
from safeio._saves.patches import Patch


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - exercised only without transformers
        raise ImportError(
            "safeio's Hugging Face integration needs transformers: pip install 'safeio-ckpt[hf]'"
        ) from exc
    return transformers


def _patch_targets(include_models: bool) -> list[type]:
    transformers = _transformers()
    from transformers.feature_extraction_utils import FeatureExtractionMixin
    from transformers.image_processing_base import ImageProcessingMixin

    bases: list[type] = [
        transformers.PreTrainedTokenizerBase,
        transformers.ProcessorMixin,
        ImageProcessingMixin,
        FeatureExtractionMixin,
        transformers.PretrainedConfig,
        transformers.GenerationConfig,
    ]
    with contextlib.suppress(ImportError, AttributeError):
        from transformers.video_processing_utils import BaseVideoProcessor

        bases.append(BaseVideoProcessor)
    if include_models:
        bases.append(transformers.PreTrainedModel)
    return bases


def _subclasses(cls: type) -> Iterator[type]:
    seen: set[type] = set()
    stack: list[type] = [cls]
    while stack:
        sub: type
        for sub in stack.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
                yield sub


class SaveRouting(Patch):
    """Routes ``save_pretrained`` of transformers' classes through safeio while installed.

    ``install()``/``uninstall()`` for frameworks that need a pair of calls; also a context manager.
    Installs nest (the innermost options apply) and are thread-safe; the last uninstall restores
    exactly the attributes that were there before (``safeio._saves.patches.Patch``).
    """

    def __init__(
        self,
        *,
        group: Any = None,
        include_models: bool = False,
        timeout: float | None = None,
        mode: Mode = "merge",
        durable: bool = True,
        lock: LockSetting = "auto",
        manifest: bool = True,
        warn_after: float | None = None,
    ) -> None:
        super().__init__()
        # The safeio options a patched call may also pass as keyword arguments (they override these).
        self.options: dict[str, Any] = {
            "timeout": timeout,
            "mode": mode,
            "durable": durable,
            "lock": lock,
            "manifest": manifest,
            "warn_after": warn_after,
        }
        SaveOptions.of(**self.options)  # a bad option fails here, not at the first save
        self.group = group
        self.include_models = include_models

    def apply(self) -> None:
        """Make the patched set match what the installed patches ask for."""
        wanted: list[type] = []
        for patch in self._installs:
            assert isinstance(patch, SaveRouting)
            for base in _patch_targets(patch.include_models):
                if base not in wanted:
                    wanted.append(base)
        for base in self.replaced_owners("__init_subclass__"):
            if base not in wanted:
                self.restore(base, "__init_subclass__")
        for klass in self.replaced_owners("save_pretrained"):
            if not any(klass is base or issubclass(klass, base) for base in wanted):
                self.restore(klass, "save_pretrained")
        for base in wanted:
            self._hook(base)
            for klass in (base, *_subclasses(base)):
                if "save_pretrained" in vars(klass):
                    self._wrap(klass)

    @classmethod
    def _wrap(cls, klass: type) -> None:
        if cls.is_replaced(klass, "save_pretrained"):
            return
        original = vars(klass)["save_pretrained"]

        @functools.wraps(original)
        def save_pretrained(self: Any, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
            routing = SaveRouting.current()
            bound = original.__get__(self, type(self))
            if not isinstance(routing, SaveRouting):
                return bound(save_directory, *args, **kwargs)
            chosen = {**routing.options, **{k: kwargs.pop(k) for k in list(kwargs) if k in routing.options}}
            group = kwargs.pop("group", routing.group)
            options = SaveOptions.of(**chosen)
            return save_through(self, bound, save_directory, args, kwargs, options, group)

        save_pretrained.__safeio_original__ = original  # type: ignore[attr-defined]
        cls.replace(klass, "save_pretrained", save_pretrained)

    @classmethod
    def _hook(cls, base: type) -> None:
        """Wrap classes defined while the patch is active (transformers imports model modules lazily)."""
        if cls.is_replaced(base, "__init_subclass__"):
            return
        own = vars(base).get("__init_subclass__")

        def __init_subclass__(sub: Any, /, **kwargs: Any) -> None:
            if own is None:
                parent: Any = super(base, sub)
                parent.__init_subclass__(**kwargs)
            else:
                own.__func__(sub, **kwargs)
            with cls._lock:
                if cls.is_replaced(base, "__init_subclass__") and "save_pretrained" in vars(sub):
                    cls._wrap(sub)

        cls.replace(base, "__init_subclass__", classmethod(__init_subclass__))


def patch_save_pretrained(
    *,
    group: Any = None,
    include_models: bool = False,
    timeout: float | None = None,
    mode: Mode = "merge",
    durable: bool = True,
    lock: LockSetting = "auto",
    manifest: bool = True,
    warn_after: float | None = None,
) -> SaveRouting:
    """Route transformers' ``save_pretrained`` (tokenizers, processors, image processors, feature
    extractors, configs, generation configs; models only with ``include_models``) through safeio.

    Use as a context manager, or call ``.install()`` and ``.uninstall()``. Correct whether every rank
    calls ``save_pretrained`` (one writes, the others wait for its outcome) or only rank 0 does because
    the caller already guards it (rank 0 saves and returns without waiting for anyone).
    """
    return SaveRouting(
        group=group,
        include_models=include_models,
        timeout=timeout,
        mode=mode,
        durable=durable,
        lock=lock,
        manifest=manifest,
        warn_after=warn_after,
    )
