"""Every entry point's signature is its share of the one definition of the options (issue 35).

The options are defined once, in ``safeio._options`` (``OPTIONS``: annotation, default, check, meaning;
``ENTRY_POINTS``: which entry point takes which, its own default where it differs, why it takes no
other). The public signatures stay written out for ``help()`` and mypy; an entry point that gains, loses
or retypes an option, or changes a default, without the definition saying so fails here.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from pathlib import Path
from typing import Any, get_args

import pytest

import safeio
from safeio._options import ENTRY_POINTS, LOCK_KINDS, MODES, OPTIONS, LockKind, Mode, SaveOptions
from safeio._saves.hf_patch import SaveRouting
from safeio.testing.ranks import run_ranks
from tests._bounds import PATIENT, RUN

PACKAGE = Path(safeio.__file__).resolve().parent
# Parameters that are what is saved or where, not how: not options.
NOT_OPTIONS = {"obj", "target", "path", "root", "args", "hf_kwargs", "save_kwargs", "self"}
# Options of one entry point's own, declared in its signature only (the docs table lists them too).
EXTRAS = {
    "patch_save_pretrained": {"include_models"},
    "Checkpoints": {"keep", "name", "pointer", "megatron_tracker"},
}


def _parameters(entry_point: str) -> dict[str, inspect.Parameter]:
    signature = inspect.signature(getattr(safeio, entry_point), eval_str=True)
    return {
        name: parameter
        for name, parameter in signature.parameters.items()
        if name not in NOT_OPTIONS and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    }


def test_the_definition_covers_every_public_save_entry_point_and_accounts_for_every_option() -> None:
    assert list(ENTRY_POINTS) == [
        "save_pretrained",
        "replicated",
        "torch_save",
        "patch_save_pretrained",
        "Checkpoints",
    ]
    for entry in ENTRY_POINTS.values():
        assert entry.name in safeio.__all__
        assert set(entry.takes) | set(entry.not_taken) == set(OPTIONS), entry.name
        assert not set(entry.takes) & set(entry.not_taken), entry.name
        assert all(reason.strip() for reason in entry.not_taken.values()), entry.name
        assert set(entry.defaults) <= set(entry.takes), entry.name


@pytest.mark.parametrize("entry_point", list(ENTRY_POINTS))
def test_each_signature_is_the_definitions_share_plus_its_declared_extras(entry_point: str) -> None:
    entry = ENTRY_POINTS[entry_point]
    parameters = _parameters(entry_point)
    assert set(parameters) == set(entry.takes) | EXTRAS.get(entry_point, set()), entry_point
    for name in entry.takes:
        parameter, option = parameters[name], OPTIONS[name]
        assert parameter.kind is parameter.KEYWORD_ONLY, f"{entry_point}({name}=) must be keyword-only"
        assert parameter.annotation == option.annotation, (
            f"{entry_point}({name}: {parameter.annotation}) is not the definition's {option.annotation}"
        )
        assert parameter.default == entry.default(name), (
            f"{entry_point}({name}={parameter.default!r}) is not the definition's {entry.default(name)!r}"
        )


def test_save_options_checks_every_option_but_the_group_with_the_definitions_defaults() -> None:
    parameters = inspect.signature(SaveOptions.of).parameters
    assert set(parameters) == set(OPTIONS) - {"group"}
    for name, parameter in parameters.items():
        assert parameter.default == OPTIONS[name].default, name


def test_save_options_fields_default_to_the_definition_where_no_environment_variable_stands_in() -> None:
    # timeout and warn_after default to None in every signature: the field holds the environment's value.
    fields = {field.name: field.default for field in dataclasses.fields(SaveOptions)}
    for name in ("mode", "durable", "lock", "manifest", "writer"):
        assert fields[name] == OPTIONS[name].default, name


def test_a_patched_call_may_override_exactly_the_options_the_patch_takes() -> None:
    routing = SaveRouting()
    assert set(routing.options) == set(ENTRY_POINTS["patch_save_pretrained"].takes) - {"group"}


def test_the_modes_and_lock_kinds_are_spelled_once() -> None:
    # They were spelled twice (a Literal and a tuple the check read), free to drift apart.
    assert get_args(Mode) == MODES == ("replace", "versioned", "merge", "error")
    assert get_args(LockKind) == LOCK_KINDS == ("auto", "flock", "lease", "strict")
    for values in ('"replace", "versioned", "merge", "error"', '"auto", "flock", "lease", "strict"'):
        spelled = [
            (str(path.relative_to(PACKAGE)), text.count(values))
            for path in sorted(PACKAGE.rglob("*.py"))
            if values in (text := path.read_text(encoding="utf-8"))
        ]
        assert spelled == [("_options.py", 1)], f"{values} spelled in {spelled}"


@pytest.mark.parametrize(
    ("option", "bad"),
    [
        ("mode", "overwrite"),
        ("mode", None),
        ("lock", "yes"),
        ("lock", 1),
        ("durable", 1),
        ("manifest", "no"),
        ("writer", -1),
        ("writer", True),
        ("timeout", float("nan")),
        ("warn_after", 0),
    ],
)
def test_every_entry_point_refuses_a_bad_value_of_each_option_it_takes_naming_it(
    option: str, bad: Any
) -> None:
    # The check is the definition's, reached through SaveOptions.of by every entry point that takes it.
    with pytest.raises(safeio.InvalidOptionError, match=option):
        OPTIONS[option].check(bad)
    for entry in ENTRY_POINTS.values():
        if option in entry.takes and entry.name in ("replicated", "patch_save_pretrained", "Checkpoints"):
            call = getattr(safeio, entry.name)
            args = ("/tmp/safeio-options-never-written",) if entry.name != "patch_save_pretrained" else ()
            with pytest.raises(safeio.InvalidOptionError, match=option):
                call(*args, **{option: bad})


def _saves_with_writer_one(rank: int, world: int, root: str, config_dir: str) -> str:
    from safeio.testing import hf_objects

    group = safeio.current_group().with_writer(1)
    ckpts = safeio.Checkpoints(root, group=group, timeout=PATIENT)
    with ckpts.save(1) as ckpt, open(os.path.join(ckpt.path, f"part-{rank}.txt"), "w") as f:
        f.write(str(rank))  # every rank writes its own file
    with safeio.patch_save_pretrained(group=group, timeout=PATIENT):
        hf_objects.config().save_pretrained(config_dir)  # every rank calls it; rank 1 writes
    latest = ckpts.latest()
    assert latest is not None
    return latest.path


def test_checkpoints_and_the_patch_take_their_writer_from_the_group(tmp_path: Path) -> None:
    # What docs/options.md tells a user who wants another writer where these two take no writer=.
    root, config_dir = tmp_path / "ckpts", tmp_path / "config"
    results = run_ranks(_saves_with_writer_one, 2, str(root), str(config_dir), timeout=RUN)
    step = Path(results[0].value)
    assert results[1].value == str(step) and sorted(p.name for p in step.glob("part-*")) == [
        "part-0.txt",
        "part-1.txt",
    ]
    for directory in (step, config_dir):
        manifest = json.loads((directory / ".safeio-manifest.json").read_text(encoding="utf-8"))
        assert manifest["writer"]["rank"] == 1, directory
