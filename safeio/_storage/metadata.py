"""Reading safeio's metadata files (manifests, merge intents) as the untrusted input they are.

Anyone who can write a shared directory can put anything under ``.safeio-manifest.json``: a FIFO (an
open would wait for a writer forever), a link to ``/dev/zero`` or a huge file (read whole: out of memory),
JSON nested 100,000 deep (a RecursionError), entries naming ``../../etc`` or of the wrong type. Every read
here opens with ``O_NOFOLLOW|O_NONBLOCK``, requires a regular file, caps the size, parses within a depth
bound and a memory bound, and validates the schema. What fails is ``Damaged``: reported by ``verify``,
never complete, replaced by the next save, listed by ``gc`` — never a traceback, never a hang, never a
path outside the directory.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from safeio._storage import digests
from safeio._storage.dirfd import is_component, is_relative_name, open_regular_file

MANIFEST_CAP = 16 << 20  # a manifest of 100,000 files is about 10 MB
INTENT_CAP = 16 << 20
MAX_DEPTH = 64  # manifests nest 4 deep; a save's result value may nest a little more
# What parsing may cost, estimated from the text before parsing (``_parse_cost``): json.loads builds a
# Python object of up to 150 bytes for each value, so a 16 MiB file of nested lists ([[],[],...]) took
# 469 MiB (issue 34). A manifest of 100,000 files, or the HF Trainer's trainer_state.json with 100,000
# log entries (16 MiB, 47 MiB parsed), stays within it.
PARSE_BUDGET = 128 << 20
_VALUE_COST = 80  # bytes per value separator (``[ { , :``), measured on the worst shapes: 34-74
# A JSON string, written as an unrolled loop: 4-5 times faster than an alternation per character (the
# scan below ran 0.2 ms on a 7 KB manifest, most of a 1 MB merge save's allowance, issue 26).
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


@dataclass(frozen=True)
class Damaged:
    """A metadata file that exists but cannot be trusted; ``reason`` says why, for reports."""

    reason: str


def read_json(dir_fd: int, name: str, cap: int, *, owner: int | None = None) -> object | Damaged | None:
    """The parsed JSON of ``name`` in ``dir_fd``; None when absent; Damaged for anything unusable. With
    ``owner``, a file of any other uid is not read (another user's, planted where ``owner``'s is read)."""
    try:
        fd, st = open_regular_file(dir_fd, name)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return Damaged(f"{name} cannot be opened as a regular file ({exc.strerror or exc})")
    try:
        if owner is not None and st.st_uid != owner:
            return Damaged(f"{name} is owned by uid {st.st_uid}, not uid {owner}: another user's, not read")
        if st.st_size > cap:
            return Damaged(f"{name} is {st.st_size} bytes, over the {cap}-byte limit")
        if 2 * st.st_size > PARSE_BUDGET:  # the text and its decoded copy alone
            return Damaged(f"{name} is {st.st_size} bytes, too large to parse within {PARSE_BUDGET} bytes")
        # What fstat said, plus one byte to see it grew: os.read allocates all it is asked for first
        # (cap + 1: 256 MiB for every trainer_state.json judged).
        data = os.read(fd, st.st_size + 1)
    except OSError as exc:
        return Damaged(f"{name} cannot be read ({exc.strerror or exc})")
    finally:
        os.close(fd)
    return parse_json(data, name, cap)


def parse_json(data: bytes, name: str, cap: int) -> object | Damaged:
    """``data`` (the content of ``name``) parsed as JSON within the size cap and depth bound."""
    if len(data) > cap:
        return Damaged(f"{name} is over the {cap}-byte limit")
    cost = _parse_cost(data)
    if cost > PARSE_BUDGET:
        return Damaged(f"{name} holds too many values to parse within {PARSE_BUDGET} bytes (about {cost})")
    if _depth(data) > MAX_DEPTH:
        return Damaged(f"{name} nests deeper than {MAX_DEPTH} levels")
    try:
        # Decoded here as the UTF-8 safeio writes: json.loads(bytes) would guess UTF-16/32 from the
        # first bytes and import a codec for it.
        parsed: object = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        return Damaged(f"{name} is not valid JSON ({exc})")
    return parsed


def _parse_cost(data: bytes) -> int:
    """An upper bound of the memory ``json.loads(data)`` takes (text, its decoded copy, one object per
    value), from four byte counts (no scan in Python, no copy; a bracket or comma inside a string is
    counted too, which only overestimates). Checked before ``_depth``, whose string removal copies."""
    if (_VALUE_COST + 2) * (len(data) + 1) <= PARSE_BUDGET:
        return 0  # within the budget even if every byte were a separator (every manifest a save reads)
    separators = sum(data.count(c) for c in (b"[", b"{", b",", b":"))
    return 2 * len(data) + _VALUE_COST * (separators + 1)


def _depth(data: bytes) -> int:
    """The bracket depth of JSON text, strings skipped: checked before parsing, so no RecursionError."""
    if data.count(b"[") + data.count(b"{") <= MAX_DEPTH:
        return 0  # cannot nest deeper than it has brackets (the usual manifest: no scan needed)
    depth = deepest = 0
    for bracket in _STRINGS.sub(b"", data).translate(None, _NOT_BRACKETS):
        if bracket in b"[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_DEPTH:
                    break
        else:
            depth -= 1
    return deepest


def validate_manifest(record: object) -> dict[str, Any] | Damaged:
    """A manifest whose ``files`` map normalised relative names to ``{"size": int, <digest>?: hex}``, where
    a digest is any of ``safeio._storage.digests.ALGORITHMS`` (format 2's xxh3_128, format 1's sha256)."""
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        return Damaged("the manifest has no files table")
    for rel, entry in record["files"].items():
        if not is_relative_name(rel):
            return Damaged(f"the manifest lists an entry that is not a name inside the directory: {rel!r}")
        if not isinstance(entry, dict):
            return Damaged(f"the manifest entry of {rel!r} is not a table")
        size = entry.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            return Damaged(f"the manifest entry of {rel!r} has no valid size")
        for name in digests.recorded(entry):
            if not digests.is_valid(name, entry[name]):
                return Damaged(f"the manifest entry of {rel!r} has an invalid {name}")
    call = record.get("call")
    if call is not None and not isinstance(call, str):
        return Damaged("the manifest's call id is not a string")
    calls = record.get("calls", [])
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("call"), str) for c in calls
    ):
        return Damaged("the manifest's list of calls is not a list of call records")
    return record


def validate_intent(record: object, target_name: str) -> dict[str, Any] | Damaged:
    """A merge intent naming exactly ``target_name`` (the stage's own target) and normalised files."""
    if not isinstance(record, dict):
        return Damaged("the merge intent is not a table")
    named = record.get("target_name")
    if not is_component(named) or named != target_name:
        return Damaged(f"the merge intent names {named!r}, not the stage's own target {target_name!r}")
    files = record.get("files")
    if not isinstance(files, list) or not all(is_relative_name(f) for f in files):
        return Damaged("the merge intent's file list holds something that is not a name inside the stage")
    return record


def load_manifest(dir_fd: int, name: str) -> dict[str, Any] | Damaged | None:
    parsed = read_json(dir_fd, name, MANIFEST_CAP)
    if parsed is None or isinstance(parsed, Damaged):
        return parsed
    return validate_manifest(parsed)
