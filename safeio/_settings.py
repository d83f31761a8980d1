"""Defaults read from the environment, in one place."""

from __future__ import annotations

import os

DEFAULT_TIMEOUT = 1800.0


def default_timeout() -> float:
    """Seconds every wait may last: ``SAFEIO_TIMEOUT`` if set, else 30 minutes."""
    raw = os.environ.get("SAFEIO_TIMEOUT")
    if raw is None or raw.strip() == "":
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"SAFEIO_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"SAFEIO_TIMEOUT must be positive, got {raw!r}")
    return value


def resolve_timeout(timeout: float | None) -> float:
    if timeout is None:
        return default_timeout()
    if timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)
