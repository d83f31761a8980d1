"""docs/errors.md's promise, checked: every public function and class of ``safeio``,
``safeio.integrations`` and ``safeio.cli`` (``main``), given bad input (a path of the wrong type, an empty one, one with a NUL byte,
one under a file; an option of the wrong type or value), raises a ``safeio.SafeIOError`` subclass that
names what was wrong (the path, or the argument), and keeps the builtin Python would have raised (issue 36:
``SafeCheckpointIO`` raised a bare ``TypeError``; a path that was None a bare ``TypeError`` everywhere).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import safeio
from safeio import cli as safeio_cli
from safeio.integrations import accelerate as safeio_accelerate
from safeio.integrations import lightning as safeio_lightning
from safeio.integrations import transformers as safeio_transformers

PUBLIC_MODULES = (safeio_transformers, safeio_accelerate, safeio_lightning, safeio_cli)

# Public names that take no input a caller can get wrong, with the reason.
EXEMPT = {
    "Checkpoint": "a value safeio returns (latest(), at()), not built by callers",
    "Stage": "a value safeio yields (with replicated(...) as stage), not built by callers",
    "current_group": "takes no argument",
    "build_parser": "takes no argument",
    "patch_trainer": "takes no argument",
    "TrainerPatch": "takes no argument",
    "SafeModelCheckpoint": "its arguments are Lightning's ModelCheckpoint's, checked by Lightning with its own "
    "errors (a framework's behaviour stays the framework's)",
}


class Tokenizer:
    """Anything with ``save_pretrained`` is what ``safeio.save_pretrained`` saves."""

    def save_pretrained(self, directory: str, **_: Any) -> None:
        Path(directory, "tokenizer.json").write_text("{}")


class Accelerator:
    """What the accelerate adapter reads of an ``accelerate.Accelerator`` (a real one would also do)."""

    def __init__(self, project_dir: str) -> None:
        self.project_dir = project_dir
        self.project_configuration = types.SimpleNamespace(
            total_limit=None, automatic_checkpoint_naming=False
        )
        self.save_iteration = 0

    def save_state(self, output_dir: str, **_: Any) -> None:
        Path(output_dir, "model.safetensors").write_bytes(b"w")


def _trainer_class() -> type:
    import transformers

    return type("Trainer", (safeio_transformers.CheckpointsTrainerMixin, transformers.Trainer), {})


def called(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[[], Any]:
    """A call, entering what it returns when that is a context manager (the save runs there)."""

    def call() -> Any:
        result = function(*args, **kwargs)
        if isinstance(result, contextlib.AbstractContextManager):
            with result:
                pass
        return result

    return call


def saved_checkpoints(root: Path) -> safeio.Checkpoints:
    ckpts = safeio.Checkpoints(root, keep=None)
    with ckpts.save(1) as ckpt:
        Path(ckpt.path, "w.bin").write_bytes(b"w")
    return ckpts


# name -> the call with a bad path (or a bad root), for the path-taking functions and classes; ``writes``:
# whether it writes there (a path under a regular file is then bad input too; a reader reports it).
PATHS: dict[str, tuple[Callable[[Any, Path], Callable[[], Any]], bool]] = {
    "replicated": (lambda p, _: called(safeio.replicated, p), True),
    "save_pretrained": (lambda p, _: called(safeio.save_pretrained, Tokenizer(), p), True),
    "torch_save": (lambda p, _: called(safeio.torch_save, {"w": 1}, p), True),
    "atomic_open": (lambda p, _: called(safeio.atomic_open, p), True),
    "write_pointer": (lambda p, _: called(safeio.write_pointer, p, "step_1"), True),
    "Checkpoints": (lambda p, _: called(lambda: safeio.Checkpoints(p).save(1)), True),
    "verify": (lambda p, _: called(safeio.verify, p), False),
    "is_complete": (lambda p, _: called(safeio.is_complete, p), False),
    "snapshot": (lambda p, _: called(safeio.snapshot, p), False),
    "audit": (lambda p, _: called(safeio.audit, p), False),
    "audit(record_dir)": (lambda p, tmp: called(safeio.audit, tmp, record_dir=p), False),
    "writer_only_section": (lambda p, _: called(safeio.writer_only_section, p), False),
    "get_last_checkpoint": (lambda p, _: called(safeio_transformers.get_last_checkpoint, p), False),
    "checkpoints_for": (
        lambda p, tmp: called(
            lambda: safeio_accelerate.checkpoints_for(Accelerator(str(tmp)), root=p).save(1)
        ),
        True,
    ),
    "SafeCheckpointIO": (
        lambda p, _: called(safeio_lightning.SafeCheckpointIO().save_checkpoint, {}, p),
        True,
    ),
    "SafeCheckpointIO.remove_checkpoint": (
        lambda p, _: called(safeio_lightning.SafeCheckpointIO().remove_checkpoint, p),
        False,
    ),
}

BAD_PATHS: dict[str, Any] = {
    "None": None,
    "a number": 7,
    "a list": ["ckpt"],
    "empty": "",
    "a NUL byte": "ck\0pt",
}
NONE_IS_THE_DEFAULT = {"audit(record_dir)", "checkpoints_for"}  # root=None, record_dir=None: not bad input

# name -> (what is wrong, the call, a word its message must hold: the argument's name or the path)
OPTIONS: list[tuple[str, str, Callable[[Path], Callable[[], Any]], str]] = [
    *[
        (entry, f"{option}={value!r}", make, option)
        for entry, make_with in {
            "replicated": lambda **o: lambda tmp: called(safeio.replicated, tmp / "t", **o),
            "save_pretrained": lambda **o: (
                lambda tmp: called(safeio.save_pretrained, Tokenizer(), tmp / "t", **o)
            ),
            "patch_save_pretrained": lambda **o: lambda tmp: called(safeio.patch_save_pretrained, **o),
        }.items()
        for option, value in [
            ("timeout", "x"),
            ("timeout", -1),
            ("mode", "bogus"),
            ("durable", "yes"),
            ("lock", "bogus"),
            ("manifest", "yes"),
            ("warn_after", -1),
        ]
        for make in [make_with(**{option: value})]
    ],
    ("replicated", "writer=-1", lambda tmp: called(safeio.replicated, tmp / "t", writer=-1), "writer"),
    ("replicated", "group='bogus'", lambda tmp: called(safeio.replicated, tmp / "t", group="bogus"), "group"),
    ("save_pretrained", "obj=7", lambda tmp: called(safeio.save_pretrained, 7, tmp / "t"), "save_pretrained"),
    (
        "save_pretrained",
        "push_to_hub=True",
        lambda tmp: called(safeio.save_pretrained, Tokenizer(), tmp / "t", push_to_hub=True),
        "push_to_hub",
    ),
    (
        "torch_save",
        "timeout='x'",
        lambda tmp: called(safeio.torch_save, {}, tmp / "t.pt", timeout="x"),
        "timeout",
    ),
    (
        "torch_save",
        "durable='yes'",
        lambda tmp: called(safeio.torch_save, {}, tmp / "t.pt", durable="yes"),
        "durable",
    ),
    (
        "torch_save",
        "writer='0'",
        lambda tmp: called(safeio.torch_save, {}, tmp / "t.pt", writer="0"),
        "writer",
    ),
    ("atomic_open", "mode='r'", lambda tmp: called(safeio.atomic_open, tmp / "f", "r"), "{tmp}/f"),
    (
        "atomic_open",
        "durable='yes'",
        lambda tmp: called(safeio.atomic_open, tmp / "f", durable="yes"),
        "{tmp}/f",
    ),
    (
        "atomic_open",
        "encoding='bogus'",
        lambda tmp: called(safeio.atomic_open, tmp / "f", encoding="bogus"),
        "{tmp}/f",
    ),
    ("atomic_open", "newline='x'", lambda tmp: called(safeio.atomic_open, tmp / "f", newline="x"), "{tmp}/f"),
    (
        "atomic_open",
        "'wb' with an encoding",
        lambda tmp: called(safeio.atomic_open, tmp / "f", "wb", encoding="utf-8"),
        "{tmp}/f",
    ),
    ("write_pointer", "text=5", lambda tmp: called(safeio.write_pointer, tmp / "latest", 5), "{tmp}/latest"),
    (
        "verify",
        "check_hashes='yes'",
        lambda tmp: called(safeio.verify, tmp, check_hashes="yes"),
        "check_hashes",
    ),
    ("audit", "action='bogus'", lambda tmp: called(safeio.audit, tmp, action="bogus"), "action"),
    ("Group", "rank='0'", lambda tmp: called(safeio.Group, rank="0"), "rank"),
    ("Group", "rank=3 of 2", lambda tmp: called(safeio.Group, rank=3, world_size=2), "rank"),
    ("Group", "world_size=0", lambda tmp: called(safeio.Group, world_size=0), "world_size"),
    ("Group", "writer=5", lambda tmp: called(safeio.Group, writer=5), "writer"),
    *[
        (
            "Checkpoints",
            f"{option}={value!r}",
            lambda tmp, o=option, v=value: called(safeio.Checkpoints, tmp, **{o: v}),
            option,
        )
        for option, value in [
            ("keep", -1),
            ("keep", "3"),
            ("name", "nostep"),
            ("timeout", "x"),
            ("durable", "yes"),
            ("lock", "bogus"),
            ("megatron_tracker", "yes"),
            ("pointer", "yes"),
            ("warn_after", -1),
        ]
    ],
    (
        "Checkpoints",
        "group='bogus'",
        lambda tmp: called(lambda: safeio.Checkpoints(tmp, group="bogus").save(1)),
        "group",
    ),
    ("Checkpoints", "save('x')", lambda tmp: called(lambda: safeio.Checkpoints(tmp).save("x")), "step"),
    ("Checkpoints", "save(-1)", lambda tmp: called(lambda: safeio.Checkpoints(tmp).save(-1)), "step"),
    (
        "Checkpoints",
        "save(1, adopt='yes')",
        lambda tmp: called(lambda: safeio.Checkpoints(tmp).save(1, adopt="yes")),
        "adopt",
    ),
    (
        "Checkpoints",
        "at(7), not committed",
        lambda tmp: called(lambda: saved_checkpoints(tmp).at(7)),
        "step 7",
    ),
    (
        "Checkpoints",
        "path_of(None)",
        lambda tmp: called(lambda: safeio.Checkpoints(tmp).path_of(None)),
        "name",
    ),
    (
        "Checkpoints",
        "keep = 0",
        lambda tmp: called(lambda: setattr(safeio.Checkpoints(tmp), "keep", 0)),
        "keep",
    ),
    (
        "CheckpointsTrainerMixin",
        "safeio_timeout='x'",
        lambda tmp: called(lambda: _trainer_class()(safeio_timeout="x")),
        "safeio_timeout",
    ),
    (
        "CheckpointsTrainerMixin",
        "on a class that is no Trainer",
        lambda tmp: called(type("NotATrainer", (safeio_transformers.CheckpointsTrainerMixin,), {})),
        "NotATrainer",
    ),
    ("main", "argv='ls /tmp'", lambda tmp: called(safeio_cli.main, "ls /tmp"), "argv"),
    ("main", "argv=[7]", lambda tmp: called(safeio_cli.main, [7]), "argv"),
    ("checkpoints_for", "accelerator=7", lambda tmp: called(safeio_accelerate.checkpoints_for, 7), "int"),
    ("save_state", "accelerator=7", lambda tmp: called(safeio_accelerate.save_state, 7), "int"),
    ("load_state", "accelerator=7", lambda tmp: called(safeio_accelerate.load_state, 7), "int"),
    (
        "save_state",
        "step='x'",
        lambda tmp: called(safeio_accelerate.save_state, Accelerator(str(tmp)), step="x"),
        "step",
    ),
    (
        "SafeCheckpointIO",
        "durable='yes'",
        lambda tmp: called(safeio_lightning.SafeCheckpointIO, durable="yes"),
        "durable",
    ),
    (
        "SafeCheckpointIO",
        "storage_options={}",
        lambda tmp: called(
            safeio_lightning.SafeCheckpointIO().save_checkpoint, {}, tmp / "c.ckpt", storage_options={}
        ),
        "storage_options",
    ),
]


def public_callables() -> set[str]:
    names = {n for n in safeio.__all__ if n != "__version__" and not _is_error(getattr(safeio, n))}
    for module in PUBLIC_MODULES:
        names.update(n for n in module.__all__ if callable(getattr(module, n)))
    return names


def _is_error(obj: Any) -> bool:
    return inspect.isclass(obj) and issubclass(obj, BaseException)


def test_every_public_function_and_class_is_given_bad_input() -> None:
    covered = {name.split("(")[0].split(".")[0] for name in PATHS} | {entry for entry, *_ in OPTIONS}
    assert public_callables() - set(EXEMPT) == covered


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        (n, k)
        for n in sorted(PATHS)
        for k in sorted(BAD_PATHS)
        if not (k == "None" and n in NONE_IS_THE_DEFAULT)
    ],
)
def test_a_bad_path_is_a_safeio_error_naming_it(name: str, kind: str, tmp_path: Path) -> None:
    make, _writes = PATHS[name]
    bad = BAD_PATHS[kind]
    with pytest.raises(safeio.SafeIOError) as caught:
        make(bad, tmp_path)()
    message = str(caught.value)
    if isinstance(bad, str):
        assert repr(bad) in message or f"{bad} " in message or "is empty" in message, message
        assert isinstance(caught.value, ValueError), type(caught.value)  # what the OS raised for a NUL byte
    else:  # the argument and what it got; a TypeError still, as os.fspath's was
        assert type(bad).__name__ in message and "must be" in message, message
        assert isinstance(caught.value, TypeError), type(caught.value)
    assert os.listdir(tmp_path) in ([], ["audit-records"]), os.listdir(tmp_path)  # nothing was written


@pytest.mark.parametrize("name", sorted(n for n, (_, writes) in PATHS.items() if writes))
def test_a_path_under_a_file_is_a_safeio_error_naming_it(name: str, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    bad = tmp_path / "file" / "ckpt"
    make, _writes = PATHS[name]
    with pytest.raises(safeio.SafeIOError) as caught:
        make(bad, tmp_path)()
    assert str(tmp_path / "file") in str(caught.value), caught.value
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize(("name", "what", "make", "named"), OPTIONS, ids=[f"{n}-{w}" for n, w, *_ in OPTIONS])
def test_a_bad_option_is_a_safeio_error_naming_it(
    name: str, what: str, make: Callable[[Path], Callable[[], Any]], named: str, tmp_path: Path
) -> None:
    with pytest.raises(safeio.SafeIOError) as caught:
        make(tmp_path)()
    message = str(caught.value)
    assert named.format(tmp=tmp_path) in message, message
    if isinstance(caught.value, safeio.InvalidOptionError):
        assert isinstance(caught.value, ValueError)
    if isinstance(caught.value, (safeio.UnsupportedSaveError, safeio.InvalidTypeError)):
        assert isinstance(caught.value, TypeError)  # what the framework (or Python) raised: still caught
