"""Hugging Face integration: ``save_pretrained`` through safeio, and a patch for code you do not own.

Every tokenizer, processor and config ``save_pretrained`` opens its files with ``O_TRUNC`` in the target
directory and writes them in place; when every rank does it on NFS, writers and readers interlock in
the kernel (the 35-hour hang). Here only the writer calls the object's ``save_pretrained``, into a
private stage, and the stage is promoted atomically. Models are different: their ``save_pretrained``
may gather state from every rank, so every rank calls it (into its own stage, ``is_main_process`` true
on the writer only) and only the writer's stage is promoted.

The default mode is ``merge``: Hugging Face's contract is "write my files into this directory", and a
checkpoint directory holds a model, its tokenizer, its config and trainer state side by side; replacing
the whole directory when the tokenizer is saved would delete the model.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import PurePath
from typing import Any

from safeio import active
from safeio.errors import UnsupportedSaveError
from safeio.locking import LockSetting
from safeio.promote import Mode
from safeio.replicated import Stage, replicated
from safeio.storage import resolve


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - exercised only without transformers
        raise ImportError(
            "safeio's Hugging Face integration needs transformers: pip install 'safeio[hf]'"
        ) from exc
    return transformers


def _is_model(obj: Any) -> bool:
    """Models (anything whose save takes ``is_main_process``) must be saved on every rank."""
    # Only an imported modeling_utils can have made a model: never import it (torch, sympy...) to ask.
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is not None and isinstance(obj, modeling.PreTrainedModel):
        return True
    import inspect

    try:
        return "is_main_process" in inspect.signature(obj.save_pretrained).parameters
    except (TypeError, ValueError):
        return False


def _rewrite(value: Any, stage: str, target: str) -> Any:
    """Replace the stage prefix of every path in ``value`` by the target's."""
    if isinstance(value, (str, PurePath)):
        text = os.fspath(value)
        if text == stage or text.startswith(stage.rstrip("/") + "/"):
            rewritten = target + text[len(stage.rstrip("/")) :]
            return rewritten if isinstance(value, str) else type(value)(rewritten)
        return value
    if isinstance(value, tuple):
        return tuple(_rewrite(v, stage, target) for v in value)
    if isinstance(value, list):
        return [_rewrite(v, stage, target) for v in value]
    if isinstance(value, dict):
        return {k: _rewrite(v, stage, target) for k, v in value.items()}
    return value


def save_pretrained(
    obj: Any,
    target: str | os.PathLike[str],
    *args: Any,
    group: Any = None,
    timeout: float | None = None,
    mode: Mode = "merge",
    durable: bool = True,
    lock: LockSetting = "auto",
    manifest: bool = True,
    writer: int | None = None,
    **hf_kwargs: Any,
) -> Any:
    """``obj.save_pretrained(target, ...)`` written once, atomically, with every rank told the outcome.

    Returns what the wrapped call returns, with stage paths rewritten to the target, on every rank.
    ``target`` may be a local path or an fsspec URL (``s3://``, ``memory://``, ...).
    """
    original = getattr(obj, "save_pretrained", None)
    if not callable(original):
        raise UnsupportedSaveError(
            f"cannot save {type(obj).__name__} to {os.fspath(target)}: it has no save_pretrained method",
            os.fspath(target),
        )
    return _save(
        obj, original, target, args, hf_kwargs, group, timeout, mode, durable, lock, manifest, writer
    )


def _save(
    obj: Any,
    method: Callable[..., Any],
    target: str | os.PathLike[str],
    args: tuple[Any, ...],
    hf_kwargs: dict[str, Any],
    group: Any,
    timeout: float | None,
    mode: Mode,
    durable: bool,
    lock: LockSetting,
    manifest: bool,
    writer: int | None,
) -> Any:
    location = resolve(target)
    if hf_kwargs.get("push_to_hub"):
        raise UnsupportedSaveError(
            f"push_to_hub=True is not a file write and safeio will not do it: save to {location.url()} "
            "with safeio, then push from one process",
            location.url(),
        )
    nested = active.redirect(location.path if location.is_local else location.url())
    if nested is not None:
        # A save inside a save (a processor saving its tokenizer): write straight into the open stage,
        # with no second stage, lock, counter or wait (peers never make this nested call).
        return method(nested, *args, **hf_kwargs)
    is_model = _is_model(obj)
    with replicated(
        location.given,
        group=group,
        timeout=timeout,
        mode=mode,
        durable=durable,
        lock=lock,
        manifest=manifest,
        writer=writer,
    ) as stage:
        if is_model:
            # state_dict gathering may be collective: every rank calls, only the writer's stage is kept.
            hf_kwargs = {**hf_kwargs, "is_main_process": stage.is_writer}
            _run(stage, location.given.rstrip("/"), method, args, hf_kwargs, writer_only=False)
        elif stage.is_writer:
            _run(stage, location.given.rstrip("/"), method, args, hf_kwargs, writer_only=True)
    return stage.result


def _run(
    stage: Stage,
    target: str,
    method: Callable[..., Any],
    args: tuple[Any, ...],
    hf_kwargs: dict[str, Any],
    *,
    writer_only: bool,
) -> None:
    if writer_only:
        from safeio.collectives import writer_only_section

        with writer_only_section(target):
            value = method(stage.path, *args, **hf_kwargs)
    else:
        value = method(stage.path, *args, **hf_kwargs)
    if stage.is_writer:
        stage.result = _rewrite(value, stage.path, target)


# ---------------------------------------------------------------------------------------------------
# The patch


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
    ) -> None:
        self.options: dict[str, Any] = {
            "group": group,
            "timeout": timeout,
            "mode": mode,
            "durable": durable,
            "lock": lock,
        }
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
            options = {**routing.options, **{k: kwargs.pop(k) for k in list(kwargs) if k in routing.options}}
            return _save(self, bound, save_directory, args, kwargs, writer=None, manifest=True, **options)

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
) -> SaveRouting:
    """Route transformers' ``save_pretrained`` (tokenizers, processors, image processors, feature
    extractors, configs, generation configs; models only with ``include_models``) through safeio.

    Use as a context manager, or call ``.install()`` and ``.uninstall()``. Correct whether every rank
    calls ``save_pretrained`` (one writes, the others wait for its outcome) or only rank 0 does because
    the caller already guards it (rank 0 saves and returns without waiting for anyone).
    """
    return SaveRouting(
        group=group, include_models=include_models, timeout=timeout, mode=mode, durable=durable, lock=lock
    )
