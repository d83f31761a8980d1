"""``safeio.patch_save_pretrained``: every ``save_pretrained`` of transformers' classes through safeio.

For code you do not own (HF Trainer, accelerate, your own loop). While installed, the ``save_pretrained``
of tokenizers, processors, image processors, feature extractors, configs and generation configs (models
too with ``include_models``) is replaced by a wrapper that calls ``safeio._saves.hf.save_through``; classes
defined while the patch is active (transformers imports model modules lazily) are wrapped as they appear.
The last uninstall restores exactly the attributes that were there before.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

from safeio._options import LockSetting, Mode, SaveOptions
from safeio._saves.hf import save_through


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


_MISSING = object()
# Process-wide, as the classes they patch: the installed patches (innermost last), and what each
# patched class had as its own attribute before (or _MISSING).
_lock = threading.RLock()
_stack: list[SaveRouting] = []
_saved: dict[type, Any] = {}  # class -> its own save_pretrained
_hooks: dict[type, Any] = {}  # base -> its own __init_subclass__


class SaveRouting:
    """Routes ``save_pretrained`` of transformers' classes through safeio while installed.

    ``install()``/``uninstall()`` for frameworks that need a pair of calls; also a context manager.
    Installs nest (the innermost options apply) and are thread-safe; the last uninstall restores
    exactly the attributes that were there before.
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
        self.installed = False

    # -- public --------------------------------------------------------------------------------

    def install(self) -> SaveRouting:
        with _lock:
            if self.installed:
                return self
            _stack.append(self)
            self.installed = True
            self._sync()
        return self

    def uninstall(self) -> None:
        with _lock:
            if not self.installed:
                return
            _stack.remove(self)
            self.installed = False
            self._sync()

    def __enter__(self) -> SaveRouting:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # -- machinery -----------------------------------------------------------------------------

    @classmethod
    def _current(cls) -> SaveRouting | None:
        return _stack[-1] if _stack else None

    @classmethod
    def _sync(cls) -> None:
        """Make the patched set match what the installed patches ask for."""
        wanted: list[type] = []
        for patch in _stack:
            for base in _patch_targets(patch.include_models):
                if base not in wanted:
                    wanted.append(base)
        for base in list(_hooks):
            if base not in wanted:
                cls._unhook(base)
        for klass in list(_saved):
            if not any(klass is base or issubclass(klass, base) for base in wanted):
                cls._restore(klass)
        for base in wanted:
            cls._hook(base)
            for klass in (base, *_subclasses(base)):
                if "save_pretrained" in vars(klass):
                    cls._wrap(klass)

    @classmethod
    def _wrap(cls, klass: type) -> None:
        if klass in _saved:
            return
        original = vars(klass)["save_pretrained"]
        _saved[klass] = original

        @functools.wraps(original)
        def save_pretrained(self: Any, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
            routing = SaveRouting._current()
            bound = original.__get__(self, type(self))
            if routing is None:
                return bound(save_directory, *args, **kwargs)
            chosen = {**routing.options, **{k: kwargs.pop(k) for k in list(kwargs) if k in routing.options}}
            group = kwargs.pop("group", routing.group)
            options = SaveOptions.of(**chosen)
            return save_through(self, bound, save_directory, args, kwargs, options, group)

        save_pretrained.__safeio_original__ = original  # type: ignore[attr-defined]
        setattr(klass, "save_pretrained", save_pretrained)  # noqa: B010 - the attribute is the point

    @classmethod
    def _restore(cls, klass: type) -> None:
        original = _saved.pop(klass)
        klass.save_pretrained = original  # type: ignore[attr-defined]

    @classmethod
    def _hook(cls, base: type) -> None:
        """Wrap classes defined while the patch is active (transformers imports model modules lazily)."""
        if base in _hooks:
            return
        own = vars(base).get("__init_subclass__", _MISSING)
        _hooks[base] = own

        def __init_subclass__(sub: Any, /, **kwargs: Any) -> None:
            if own is _MISSING:
                parent: Any = super(base, sub)
                parent.__init_subclass__(**kwargs)
            else:
                own.__func__(sub, **kwargs)
            with _lock:
                if base in _hooks and "save_pretrained" in vars(sub):
                    SaveRouting._wrap(sub)

        hook: Any = classmethod(__init_subclass__)
        setattr(base, "__init_subclass__", hook)  # noqa: B010

    @classmethod
    def _unhook(cls, base: type) -> None:
        own = _hooks.pop(base)
        if own is _MISSING:
            delattr(base, "__init_subclass__")
        else:
            setattr(base, "__init_subclass__", own)  # noqa: B010


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
