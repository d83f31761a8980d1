"""The options of a save, validated once, and every default read from the environment, in one place.

A typo in an argument or an environment variable must fail before any body runs (a body may be a
minutes-long model save), with the name of the argument or variable at fault. Environment variables are
read when a save starts, never at import: a bad ``SAFEIO_*`` value must not break ``import safeio``.

Every timeout and duration is a finite positive number of seconds: ``nan`` would make a wait that never
times out (``remaining <= 0`` is never true), and ``inf`` or ``1e400`` a wait without a bound. The one
exception is ``warn_after``, where ``inf`` is the documented way to turn the stall warnings off (it bounds
nothing).
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from typing import Literal

from safeio._errors import InvalidOptionError

Mode = Literal["replace", "versioned", "merge", "error"]
MODES: tuple[str, ...] = ("replace", "versioned", "merge", "error")
LockSetting = bool | Literal["auto", "flock", "lease", "strict"]

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
        mode: object = "replace",
        durable: object = True,
        lock: object = "auto",
        manifest: object = True,
        timeout: object = None,
        writer: object = None,
        warn_after: object = None,
    ) -> SaveOptions:
        if mode not in MODES:
            raise InvalidOptionError(f"mode must be one of {', '.join(MODES)}; got {mode!r}", None)
        if not isinstance(lock, bool) and lock not in ("auto", "flock", "lease", "strict"):
            raise InvalidOptionError(
                f"lock must be True, False, 'auto', 'flock', 'lease' or 'strict', got {lock!r}", None
            )
        for name, value in (("durable", durable), ("manifest", manifest)):
            flag(value, name)
        if writer is not None and (isinstance(writer, bool) or not isinstance(writer, int) or writer < 0):
            raise InvalidOptionError(f"writer must be a rank (an int >= 0) or None, got {writer!r}", None)
        return cls(
            mode=mode,  # type: ignore[arg-type]
            durable=bool(durable),
            lock=lock,
            manifest=bool(manifest),
            timeout=timeout_or_default(timeout),
            writer=writer,
            warn_after=warn_after_or_default(warn_after),
            lease_seconds=lease_seconds(),
            version_grace=version_grace(),
        )
