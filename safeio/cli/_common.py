"""What every subcommand shares: the user-error exception, exit codes, durations, sizes, JSON output."""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
from typing import Any

from safeio.cli._exit_codes import EXIT_INTERRUPTED, EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE
from safeio.shares import NOT_A_DIRECTORY, why_not_a_directory

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PROBLEMS",
    "EXIT_USAGE",
    "CliError",
    "columns",
    "existing_directory",
    "human_bytes",
    "human_seconds",
    "not_a_directory",
    "parse_duration",
    "positive_int",
    "print_json",
    "write_error",
]

_DURATION = re.compile(r"\s*(?P<value>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>s|m|h|d|w)?\s*", re.IGNORECASE)
_UNIT_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


class CliError(Exception):
    """A problem with the user's input or environment: printed as one line, never as a traceback."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def parse_duration(text: str) -> float:
    """``"90"``, ``"45s"``, ``"30m"``, ``"2h"``, ``"1.5d"``, ``"1w"`` -> seconds (an argparse ``type``)."""
    match = _DURATION.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"not a duration: {text!r} (use seconds, or a number with s, m, h, d or w: 90, 30m, 2h, 1d)"
        )
    unit = (match["unit"] or "s").lower()
    return float(match["value"]) * _UNIT_SECONDS[unit]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_seconds(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def existing_directory(path: str, *, what: str = "PATH") -> str:
    """``path`` made absolute, or a CliError saying precisely why it cannot be used as a directory."""
    if path.strip() == "":
        raise CliError(f"{what} is empty")
    full = os.path.abspath(os.path.expanduser(path))
    why = why_not_a_directory(full)
    if why is not None:
        raise not_a_directory(path, why, what)
    return full


def not_a_directory(path: str, why: str, what: str = "PATH") -> CliError:
    """The error of every command given a ``path`` that names no directory (exit 2, the same words)."""
    return CliError(f"{path}: {why}" + (f" ({what} must be a directory)" if why == NOT_A_DIRECTORY else ""))


def write_error(exc: OSError, path: str) -> CliError:
    """A CliError for a failure to create something in ``path``."""
    if exc.errno in (errno.EACCES, errno.EPERM):
        return CliError(f"{path}: no write permission for this user (uid {os.geteuid()})")
    if exc.errno == errno.EROFS:
        return CliError(f"{path}: the filesystem is mounted read-only")
    if exc.errno == errno.ENOSPC:
        return CliError(f"{path}: no space left on the device")
    return CliError(f"{path}: cannot create files here: {exc.strerror or exc}")


def columns(rows: list[list[str]], *, right: frozenset[int] = frozenset()) -> list[str]:
    """``rows`` of cells as aligned lines: every column but the last as wide as its widest cell (the
    columns in ``right`` aligned right), two spaces apart; the last one unpadded, so that a long detail
    never widens the table."""
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row[:-1], widths, strict=True))
        ]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return lines


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")
    sys.stdout.flush()
