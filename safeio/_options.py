"""The options of a save, validated once, and every default read from the environment, in one place.

A typo in an argument or an environment variable must fail before any body runs (a body may be a
minutes-long model save), with the name of the argument or variable at fault. Environment variables are
read when a save starts, never at import: a bad ``SAFEIO_*`` value must not break ``import safeio``.

Every timeout and duration is a finite positive number of seconds: ``nan`` would make a wait that never
times out (``remaining <= 0`` is never true), and ``inf`` or ``1e400`` a wait without a bound. The one
exception is ``warn_after``, where ``inf`` is the documented way to turn the stall warnings off (it bounds
nothing).

Each option is defined once, below (``OPTIONS``: its type, default, check and meaning), and so is which
entry point takes which (``ENTRY_POINTS``, with the reason for every gap). The public signatures stay
written out, so that ``help()`` and mypy see every keyword (``save_pretrained`` and ``torch_save`` pass
unknown keywords through to transformers and torch, so ``**kwargs: Unpack[...]`` cannot stand for them);
``tests/test_options_definition.py`` holds each signature to this definition, and
``tests/test_options_table.py`` holds docs/options.md to both.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar, get_args

from safeio._errors import InvalidOptionError

Mode = Literal["replace", "versioned", "merge", "error"]
LockKind = Literal["auto", "flock", "lease", "strict"]
LockSetting = bool | LockKind
# Spelled once, in the Literals above: the checks below read their values from them.
MODES: tuple[Mode, ...] = get_args(Mode)
LOCK_KINDS: tuple[LockKind, ...] = get_args(LockKind)

DEFAULT_TIMEOUT = 1800.0
DEFAULT_WARN_AFTER = 60.0
DEFAULT_VERSION_GRACE = 300.0
DEFAULT_LEASE_SECONDS = 30.0


def flag(value: object, name: str, path: str | None = None) -> bool:
    """``value`` when it is True or False; an InvalidOptionError naming ``name`` (and ``path``) else."""
    if not isinstance(value, bool):
        raise InvalidOptionError(f"{name} must be True or False, got {value!r}", path)
    return value


def seconds(value: object, name: str, *, allow_inf: bool = False, allow_zero: bool = False) -> float:
    """``value`` as a finite positive number of seconds, else InvalidOptionError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidOptionError(f"{name} must be a number of seconds, got {value!r}", None)
    number = float(value)
    too_small = number < 0 if allow_zero else number <= 0
    if math.isnan(number) or too_small or (math.isinf(number) and not allow_inf):
        finite = "" if allow_inf else "finite "
        sign = "non-negative" if allow_zero else "positive"
        raise InvalidOptionError(f"{name} must be a {finite}{sign} number of seconds, got {value!r}", None)
    return number


def _environment_seconds(
    variable: str, default: float, *, allow_inf: bool = False, allow_zero: bool = False
) -> float:
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return default
    try:
        number = float(raw)
    except ValueError:
        raise InvalidOptionError(f"{variable} must be a number of seconds, got {raw!r}", None) from None
    return seconds(number, variable, allow_inf=allow_inf, allow_zero=allow_zero)


def timeout_or_default(timeout: object) -> float:
    """``timeout`` if given, else ``SAFEIO_TIMEOUT``, else 30 minutes."""
    if timeout is None:
        return _environment_seconds("SAFEIO_TIMEOUT", DEFAULT_TIMEOUT)
    return seconds(timeout, "timeout")


def warn_after_or_default(warn_after: object) -> float:
    """``warn_after`` if given, else ``SAFEIO_WARN_AFTER``, else 60 s; ``inf`` turns the warnings off."""
    if warn_after is None:
        return _environment_seconds("SAFEIO_WARN_AFTER", DEFAULT_WARN_AFTER, allow_inf=True)
    return seconds(warn_after, "warn_after", allow_inf=True)


def version_grace() -> float:
    """How long an old version directory stays for readers that resolved the link before a swap (0: none)."""
    return _environment_seconds("SAFEIO_VERSION_GRACE", DEFAULT_VERSION_GRACE, allow_zero=True)


def lease_seconds() -> float:
    """How long a soft lease lives without its holder's heartbeat before a contender may take it."""
    return _environment_seconds("SAFEIO_LEASE_SECONDS", DEFAULT_LEASE_SECONDS)


def exchange_disabled() -> bool:
    """``SAFEIO_NO_EXCHANGE=1``: never try ``renameat2(RENAME_EXCHANGE)`` (replace by renaming aside)."""
    return os.environ.get("SAFEIO_NO_EXCHANGE", "").strip() not in ("", "0")


def mode_of(value: object) -> Mode:
    """``value`` when it is one of ``MODES``, else InvalidOptionError naming ``mode``."""
    for mode in MODES:
        if value == mode and isinstance(value, str):
            return mode
    raise InvalidOptionError(f"mode must be one of {', '.join(MODES)}; got {value!r}", None)


def lock_of(value: object) -> LockSetting:
    """``value`` when it is True, False or one of ``LOCK_KINDS``, else InvalidOptionError naming ``lock``."""
    if isinstance(value, bool):
        return value
    for kind in LOCK_KINDS:
        if value == kind and isinstance(value, str):
            return kind
    kinds = ", ".join(repr(kind) for kind in LOCK_KINDS)
    raise InvalidOptionError(f"lock must be True, False or one of {kinds}, got {value!r}", None)


def writer_of(value: object) -> int | None:
    """``value`` when it is a rank (an int >= 0) or None, else InvalidOptionError naming ``writer``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidOptionError(f"writer must be a rank (an int >= 0) or None, got {value!r}", None)
    return value


def _group_unchecked(value: object) -> object:
    return value  # resolved (and refused if it is no group) by resolve_group, when the call starts


T = TypeVar("T")


@dataclass(frozen=True)
class Option(Generic[T]):
    """One option shared by the save entry points: its name, the annotation and default every signature
    that takes it spells, the check a given value passes (the checked value, or InvalidOptionError
    naming the option), and one line saying what it does."""

    name: str
    annotation: object
    default: object
    check: Callable[[object], T]
    doc: str


GROUP: Option[object] = Option(
    "group",
    Any,
    None,
    _group_unchecked,
    "the ranks that save together (None: safeio.current_group())",
)
TIMEOUT: Option[float] = Option(
    "timeout",
    float | None,
    None,
    timeout_or_default,
    "bound on every wait (None: SAFEIO_TIMEOUT, else 1800 s)",
)
WARN_AFTER: Option[float] = Option(
    "warn_after",
    float | None,
    None,
    warn_after_or_default,
    "a phase longer than this logs a WARNING with its stack (None: SAFEIO_WARN_AFTER, else 60 s; inf: never)",
)
DURABLE: Option[bool] = Option(
    "durable", bool, True, lambda value: flag(value, "durable"), "fsync the files, the stage and the parent"
)
MODE: Option[Mode] = Option(
    "mode", Mode, "replace", mode_of, "what becomes of an existing target: replace, merge, versioned or error"
)
LOCK: Option[LockSetting] = Option(
    "lock", LockSetting, "auto", lock_of, "the lock beside the target while a save promotes over it"
)
MANIFEST: Option[bool] = Option(
    "manifest", bool, True, lambda value: flag(value, "manifest"), "write .safeio-manifest.json last"
)
WRITER: Option[int | None] = Option(
    "writer", int | None, None, writer_of, "the rank that writes (None: the group's writer, rank 0)"
)

OPTIONS: Mapping[str, Option[Any]] = {
    option.name: option for option in (GROUP, TIMEOUT, WARN_AFTER, DURABLE, MODE, LOCK, MANIFEST, WRITER)
}


@dataclass(frozen=True)
class EntryPoint:
    """A public entry point's share of ``OPTIONS``: which it takes, its own default where it differs from
    the option's, and why it does not take the others. Its extras (options of its own, such as
    ``Checkpoints``' ``keep``) are declared in its signature only."""

    name: str
    takes: tuple[str, ...]
    not_taken: Mapping[str, str]  # option -> why not
    defaults: Mapping[str, object] = field(default_factory=dict)

    def default(self, option: str) -> object:
        return self.defaults.get(option, OPTIONS[option].default)


_ONE_FILE = "one file, renamed into place over the old one (on an object store, one upload): "
_GROUP_WRITER = "the group's writer (rank 0, or k with group=safeio.current_group().with_writer(k))"
ENTRY_POINTS: Mapping[str, EntryPoint] = {
    entry.name: entry
    for entry in (
        EntryPoint(
            "save_pretrained",
            ("group", "timeout", "warn_after", "durable", "mode", "lock", "manifest", "writer"),
            {},
            # A checkpoint directory holds a model, its tokenizer and its config: replacing it whole when
            # the tokenizer is saved would delete the model.
            {"mode": "merge"},
        ),
        EntryPoint(
            "replicated",
            ("group", "timeout", "warn_after", "durable", "mode", "lock", "manifest", "writer"),
            {},
        ),
        EntryPoint(
            "torch_save",
            ("group", "timeout", "warn_after", "durable", "writer"),
            {
                "mode": _ONE_FILE + "there is nothing to merge or version",
                "lock": _ONE_FILE + "the rename replaces it atomically, with no lock to take",
                "manifest": _ONE_FILE + "the file is the unit",
            },
        ),
        EntryPoint(
            "patch_save_pretrained",
            ("group", "timeout", "warn_after", "durable", "mode", "lock", "manifest"),
            {
                "writer": "code that guards its save with 'main process only' calls save_pretrained on "
                "rank 0 alone, and any other writer would leave rank 0 waiting for a save no one makes; the "
                "patched saves write on " + _GROUP_WRITER,
            },
            {"mode": "merge"},
        ),
        EntryPoint(
            "Checkpoints",
            ("group", "timeout", "warn_after", "durable", "lock"),
            {
                "mode": "a step is committed whole, never merged or replaced in place",
                "manifest": "a step's manifest is its commit marker: always written",
                "writer": "every rank writes its own files; the commit (stage, manifest, rename, latest, "
                "retention) is made by " + _GROUP_WRITER,
            },
        ),
    )
}


@dataclass(frozen=True)
class SaveOptions:
    """How one save behaves; build it with :meth:`SaveOptions.of`, which validates every field."""

    mode: Mode = "replace"
    durable: bool = True
    lock: LockSetting = "auto"
    manifest: bool = True
    timeout: float = DEFAULT_TIMEOUT
    writer: int | None = None
    warn_after: float = DEFAULT_WARN_AFTER
    # Read from the environment with the rest, so that a bad value is refused before any body runs.
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    version_grace: float = DEFAULT_VERSION_GRACE

    @classmethod
    def of(
        cls,
        *,
        mode: object = MODE.default,
        durable: object = DURABLE.default,
        lock: object = LOCK.default,
        manifest: object = MANIFEST.default,
        timeout: object = TIMEOUT.default,
        writer: object = WRITER.default,
        warn_after: object = WARN_AFTER.default,
    ) -> SaveOptions:
        """Every option checked by its definition's check (an entry point passes what it takes; the
        others keep their definition's default)."""
        return cls(
            mode=MODE.check(mode),
            durable=DURABLE.check(durable),
            lock=LOCK.check(lock),
            manifest=MANIFEST.check(manifest),
            timeout=TIMEOUT.check(timeout),
            writer=WRITER.check(writer),
            warn_after=WARN_AFTER.check(warn_after),
            lease_seconds=lease_seconds(),
            version_grace=version_grace(),
        )
