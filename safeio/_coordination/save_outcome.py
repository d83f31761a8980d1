"""The outcome of a replicated save as its writer publishes it and a peer hears it (``Outcome``), and
how a value is carried through the store (``encode_value``/``decode_value``). What a peer hears is input
(TCPStore has no authentication): a record that is not an outcome safeio publishes is refused with a
``RemoteWriterError`` naming the writer, never trusted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from safeio._coordination.calls import MalformedValue, parse_value
from safeio._errors import RemoteWriterError


def encode_value(value: Any) -> Any:
    """A JSON form of a save's return value (tuples survive, as HF returns tuples of paths)."""
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode_value(v) for k, v in value.items()}
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def decode_value(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(decode_value(v) for v in value["__tuple__"])
        return {k: decode_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    return value


@dataclass(frozen=True)
class Outcome:
    ok: bool
    target: str
    writer_rank: int
    error_type: str | None = None
    error_message: str | None = None
    value: Any = None  # the writer's result (encode_value form), handed to every rank
    # What identifies the promoted version on disk (a local manifest's inode and size), so that a peer
    # confirms it sees that version with one stat instead of reading the manifest and every file, and the
    # version it replaced (None: none), so that a peer can tell a rival's later version from a stale view.
    version: list[int] | None = None
    replaced: list[int] | None = None

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes, key: str, target: str, writer_rank: int) -> Outcome:
        """The outcome in ``raw`` (the value of ``key``: input); a failure naming the writer's value as
        malformed when it is not one."""
        try:
            record: Any = parse_value(raw, key)
        except MalformedValue as exc:
            record = {"malformed": str(exc)}
        return cls.from_record(record, target, writer_rank)

    @classmethod
    def from_record(cls, record: Any, target: str, writer_rank: int) -> Outcome:
        """``record`` (parsed from the store: input) as an Outcome, checked field by field; a failure
        saying the value is malformed when it is not one (``raise_if_failed`` raises it)."""
        problem = _outcome_problem(record)
        if problem is None:
            return cls(**record)
        return cls(
            False,
            target,
            writer_rank,
            "MalformedValue",
            f"its outcome in the store is malformed ({problem}): whether the save succeeded is unknown "
            f"here; `safeio verify {target}` tells whether the target is whole",
        )

    @classmethod
    def failure(cls, target: str, writer_rank: int, error: BaseException) -> Outcome:
        return cls(False, target, writer_rank, type(error).__name__, str(error))

    def raise_if_failed(self, rank: int) -> None:
        if self.ok:
            return
        raise RemoteWriterError(
            f"rank {rank}: the writer (rank {self.writer_rank}) failed to save {self.target}: "
            f"{self.error_type}: {self.error_message}",
            self.target,
            writer_rank=self.writer_rank,
            error_type=self.error_type,
            error_message=self.error_message,
        )


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: value is None or check(value)


def _is_version(value: object) -> bool:
    return isinstance(value, list) and len(value) <= 8 and all(is_int(n) for n in value)


# What each field of an outcome heard from the store must be (input: TCPStore has no authentication).
_OUTCOME_FIELDS: dict[str, Callable[[object], bool]] = {
    "ok": lambda value: isinstance(value, bool),
    "target": lambda value: isinstance(value, str),
    "writer_rank": is_int,
    "error_type": _optional(lambda value: isinstance(value, str)),
    "error_message": _optional(lambda value: isinstance(value, str)),
    "value": lambda value: True,  # the save's return value: any JSON (decode_value keeps it as it is)
    "version": _optional(_is_version),
    "replaced": _optional(_is_version),
}


def _outcome_problem(record: Any) -> str | None:
    """What is wrong with an outcome heard from the store, or None."""
    if not isinstance(record, dict):
        return f"not a mapping but a {type(record).__name__}"
    if set(record) == {"malformed"}:
        return str(record["malformed"])[:2000]
    unknown = sorted(str(name)[:40] for name in set(record) - set(_OUTCOME_FIELDS))
    if unknown:
        return f"unknown fields {unknown[:5]}"
    for name in ("ok", "target", "writer_rank"):
        if name not in record:
            return f"no {name}"
    wrong = [name for name, valid in _OUTCOME_FIELDS.items() if name in record and not valid(record[name])]
    return f"{', '.join(wrong)} of the wrong type" if wrong else None
