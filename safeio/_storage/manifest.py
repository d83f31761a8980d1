"""``.safeio-manifest.json``: what a promoted directory holds, written last.

Sizes are always recorded (a stat per file, free next to the save); sha256 only when the save is
durable, because hashing a 1.3 MB ``tokenizer.json`` costs about as much as the save itself and the
non-durable path promises to cost no more than a plain save. ``safeio verify`` checks what is recorded.
In ``merge`` mode several objects share one directory, so a save updates the entries of the files it
wrote and keeps the others.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from typing import Any

MANIFEST_NAME = ".safeio-manifest.json"
MERGE_INTENT_NAME = ".safeio-merge-intent.json"
FORMAT = 1
# Files inside a stage that describe the stage itself and are never listed as content.
BOOKKEEPING = frozenset({MANIFEST_NAME, MERGE_INTENT_NAME})


def content_files(root: str) -> list[str]:
    """Relative POSIX paths of every regular file under ``root`` except safeio's bookkeeping."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            if rel not in BOOKKEEPING:
                found.append(rel)
    return found


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def describe_files(root: str, *, hashes: bool) -> dict[str, dict[str, Any]]:
    entries: dict[str, dict[str, Any]] = {}
    for rel in content_files(root):
        full = os.path.join(root, rel)
        entry: dict[str, Any] = {"size": os.lstat(full).st_size}
        if hashes:
            entry["sha256"] = sha256_file(full)
        entries[rel] = entry
    return entries


def build(
    files: dict[str, dict[str, Any]],
    *,
    rank: int,
    call: str,
    previous: dict[str, Any] | None = None,
    result: Any = None,
) -> dict[str, Any]:
    """A manifest for ``files``; with ``previous`` (merge mode) the other objects' entries are kept.

    ``call`` and ``result`` describe the save that wrote it, so that a rank without a store can tell
    its own save landed and return what the writer returned.
    """
    merged = dict(previous.get("files", {})) if previous else {}
    merged.update(files)
    record = {
        "format": FORMAT,
        "files": dict(sorted(merged.items())),
        "writer": {"host": socket.gethostname(), "pid": os.getpid(), "rank": rank},
        "call": call,
        "time": time.time(),
    }
    if result is not None:
        record["result"] = result
    return record


def dumps(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, indent=1, sort_keys=True).encode()


def write(directory: str, manifest: dict[str, Any], *, durable: bool) -> None:
    path = os.path.join(directory, MANIFEST_NAME)
    with open(path, "xb") as f:
        f.write(dumps(manifest))
        if durable:
            f.flush()
            os.fsync(f.fileno())


def read(directory: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(directory, MANIFEST_NAME), "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), dict) else None


def problems(directory: str, manifest: dict[str, Any], *, check_hashes: bool = True) -> list[str]:
    """What in ``directory`` disagrees with ``manifest`` (empty when the directory is complete)."""
    found: list[str] = []
    for rel, entry in manifest["files"].items():
        full = os.path.join(directory, *rel.split("/"))
        try:
            size = os.stat(full).st_size
        except OSError:
            found.append(f"missing: {rel}")
            continue
        if size != entry.get("size"):
            found.append(f"size mismatch: {rel} is {size} bytes, manifest says {entry.get('size')}")
        elif check_hashes and "sha256" in entry and sha256_file(full) != entry["sha256"]:
            found.append(f"sha256 mismatch: {rel}")
    return found
