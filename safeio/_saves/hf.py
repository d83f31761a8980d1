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

import os
import sys
import weakref
from collections.abc import Callable
from pathlib import PurePath
from typing import Any

from safeio._diagnostics.collectives import writer_only_section
from safeio._errors import UnsupportedSaveError
from safeio._options import LockSetting, Mode, SaveOptions
from safeio._promotion import active
from safeio._saves.identity import save_identity
from safeio._saves.replicated import ReplicatedSave, Stage
from safeio._storage.location import resolve


def _is_model(obj: Any) -> bool:
    """Models (anything whose save takes ``is_main_process``) must be saved on every rank."""
    # Only an imported modeling_utils can have made a model: never import it (torch, sympy...) to ask.
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is not None and isinstance(obj, modeling.PreTrainedModel):
        return True
    method = getattr(obj, "save_pretrained", None)
    function = getattr(method, "__func__", None)
    if function is None:  # not a plain bound method (a patched instance, a callable object): ask anew
        return _takes_is_main_process(method)
    # A signature costs 45 us, a quarter of a small save's overhead; a method's own signature never changes.
    known = _MODEL_METHODS.get(function)
    if known is None:
        known = _MODEL_METHODS[function] = _takes_is_main_process(method)
    return known


_MODEL_METHODS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _takes_is_main_process(method: Any) -> bool:
    import inspect

    try:
        return "is_main_process" in inspect.signature(method).parameters
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
    warn_after: float | None = None,
    **hf_kwargs: Any,
) -> Any:
    """``obj.save_pretrained(target, ...)`` written once, atomically, with every rank told the outcome.

    Returns what the wrapped call returns, with stage paths rewritten to the target, on every rank.
    ``target`` may be a local path or an fsspec URL (``s3://``, ``memory://``, ...).
    """
    options = SaveOptions.of(
        mode=mode,
        durable=durable,
        lock=lock,
        manifest=manifest,
        timeout=timeout,
        writer=writer,
        warn_after=warn_after,
    )
    original = getattr(obj, "save_pretrained", None)
    if not callable(original):
        raise UnsupportedSaveError(
            f"cannot save {type(obj).__name__} to {os.fspath(target)}: it has no save_pretrained method",
            os.fspath(target),
        )
    return save_through(obj, original, target, args, hf_kwargs, options, group)


def save_through(
    obj: Any,
    method: Callable[..., Any],
    target: str | os.PathLike[str],
    args: tuple[Any, ...],
    hf_kwargs: dict[str, Any],
    options: SaveOptions,
    group: Any,
) -> Any:
    """Run ``method`` (``obj``'s own save_pretrained) through the replicated flow."""
    location = resolve(target)
    if hf_kwargs.get("push_to_hub"):
        raise UnsupportedSaveError(
            f"push_to_hub=True is not a file write and safeio will not do it: save to {location.url()} "
            "with safeio, then push from one process",
            location.url(),
        )
    covered = active.covering(location.url())  # a local target's absolute path, or its URL
    what = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if covered is not None:
        nested, entry = covered
        if entry.results is not None and not _is_model(obj):
            return _save_nested_once(entry.results, what, nested, location.given, method, args, hf_kwargs)
        # A save inside a save (a processor saving its tokenizer): write straight into the open stage,
        # with no second stage, lock, counter or wait (peers never make this nested call).
        return method(nested, *args, **hf_kwargs)
    is_model = _is_model(obj)
    with ReplicatedSave(location.given, options, group=group, what=what, peer_body=is_model) as stage:
        if is_model:
            # state_dict gathering may be collective: every rank calls, only the writer's stage is kept.
            hf_kwargs = {**hf_kwargs, "is_main_process": stage.is_writer}
            _run(stage, location.given.rstrip("/"), method, args, hf_kwargs, writer_only=False)
        elif stage.is_writer:
            _run(stage, location.given.rstrip("/"), method, args, hf_kwargs, writer_only=True)
    return stage.result


def _save_nested_once(
    results: active.WriterResults,
    what: str,
    nested: str,
    given: str,
    method: Callable[..., Any],
    args: tuple[Any, ...],
    hf_kwargs: dict[str, Any],
) -> Any:
    """A save inside a stage only the writer's files of are kept (a checkpoint's): the writer saves, the
    others do not serialise the object at all and return the writer's result (paths as the caller gave
    them: the writer's may be in its scratch, on object stores)."""
    identity = save_identity(what)
    if not results.writes:
        return results.hear(identity)
    try:
        value = _rewrite(method(nested, *args, **hf_kwargs), nested, given.rstrip("/"))
    except BaseException as exc:
        results.publish(identity, None, exc)  # every rank raises what the writer raised
        raise
    results.publish(identity, value, None)
    return value


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
        with writer_only_section(target):
            value = method(stage.path, *args, **hf_kwargs)
    else:
        value = method(stage.path, *args, **hf_kwargs)
    if stage.is_writer:
        stage.result = _rewrite(value, stage.path, target)
