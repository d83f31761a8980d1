"""``.safeio-manifest.json``: what a promoted directory holds, written last.

Sizes are always recorded (a stat per file, free next to the save); a checksum of each file only when
the save is durable, where the stage's files are opened anyway to fsync them (``safeio._storage.digests``:
format 2 records ``xxh3_128``, format 1 recorded ``sha256``; both are checked). The non-durable path
promises to cost no more than a plain save, and reads nothing back. ``safeio verify`` checks what is
recorded.
In ``merge`` mode several objects share one directory, so a save updates the entries of the files it
wrote and keeps the others. Only regular files are listed; reading a manifest goes through
``safeio._storage.metadata`` (bounded, validated), and checking one never follows a link.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from typing import Any

from safeio._storage import digests
from safeio._storage.dirfd import held_directory, open_regular_file, open_relative_directory, walk_files
from safeio._storage.metadata import Damaged, load_manifest

MANIFEST_NAME = ".safeio-manifest.json"
MERGE_INTENT_NAME = ".safeio-merge-intent.json"  # a merge's intent when it writes no manifest
# A merge's intent inside its stage's manifest (format 2): the manifest moves into the target last, so it
# leaves the stage only once every other file has, and one file (and one fsync) records both.
MERGE_INTENT_KEY = "merge_intent"
# 2: file checksums are xxh3_128 (1 recorded sha256; a merge keeps such entries, and both are checked).
FORMAT = 2
# Files inside a stage that describe the stage itself and are never listed as content.
BOOKKEEPING = frozenset({MANIFEST_NAME, MERGE_INTENT_NAME})


def _rel(rel_dir: str, name: str) -> str:
    return f"{rel_dir}/{name}" if rel_dir else name


def content_files(directory: int | str) -> list[str]:
    """Relative POSIX paths of every regular file or symlink below ``directory`` (a descriptor, or a path
    the caller gave) except safeio's bookkeeping."""
    if isinstance(directory, str):
        with held_directory(directory, follow=True) as fd:
            return content_files(fd)
    dir_fd = directory
    return [
        _rel(rel_dir, name)
        for rel_dir, _fd, name, st in walk_files(dir_fd)
        if (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)) and _rel(rel_dir, name) not in BOOKKEEPING
    ]


def digest_at(dir_fd: int, name: str) -> dict[str, str]:
    """A new manifest entry's checksum of ``name`` in ``dir_fd``: ``{digests.DIGEST: hex}``."""
    fd, st = open_regular_file(dir_fd, name)
    try:
        return digests.of_fd(fd, size=st.st_size)
    finally:
        os.close(fd)


def describe_files(dir_fd: int, *, hashes: bool) -> dict[str, dict[str, Any]]:
    """Manifest entries of the regular files below ``dir_fd`` (links the body wrote are not content)."""
    entries: dict[str, dict[str, Any]] = {}
    for rel_dir, fd, name, st in walk_files(dir_fd):
        rel = _rel(rel_dir, name)
        if not stat.S_ISREG(st.st_mode) or rel in BOOKKEEPING:
            continue
        entry: dict[str, Any] = {"size": st.st_size}
        if hashes:
            entry.update(digest_at(fd, name))
        entries[rel] = entry
    return entries


CALLS_RECORDED = 32


def build(
    files: dict[str, dict[str, Any]],
    *,
    rank: int,
    call: str,
    previous: dict[str, Any] | None = None,
    result: Any = None,
    marker: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A manifest for ``files``; with ``previous`` (merge mode) the other objects' entries are kept;
    ``marker`` fields (a checkpoint's step and sequence) are recorded in it.

    ``call`` and ``result`` describe the save that wrote it, so that a rank without a store can tell
    its own save landed and return what the writer returned.
    """
    merged = dict(previous.get("files", {})) if previous else {}
    merged.update(files)
    this_call: dict[str, Any] = {"call": call}
    if result is not None:
        this_call["result"] = result
    # The recent saves whose files this version holds (a merge keeps the others'): a peer waiting for
    # one of them finds it here even after another save of the directory came after it.
    calls = [*(previous.get("calls", []) if previous else []), this_call][-CALLS_RECORDED:]
    record = {
        "format": FORMAT,
        "files": dict(sorted(merged.items())),
        "writer": {"host": socket.gethostname(), "pid": os.getpid(), "rank": rank, "uid": os.geteuid()},
        "call": call,
        "calls": calls,
        "time": time.time(),
    }
    if result is not None:
        record["result"] = result
    record.update(marker or {})
    return record


def dumps(manifest: dict[str, Any]) -> bytes:
    # Compact: without indent, json uses its C encoder (an indented manifest cost 0.3 ms per merge save).
    return json.dumps(manifest, separators=(",", ":"), sort_keys=True).encode()


def write(dir_fd: int, manifest: dict[str, Any], *, durable: bool) -> list[int]:
    """Write the manifest into ``dir_fd``; returns its ``version_of`` (inode and size)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(MANIFEST_NAME, flags, 0o666, dir_fd=dir_fd)
    try:
        data = dumps(manifest)
        size = len(data)
        while data:
            data = data[os.write(fd, data) :]
        if durable:
            os.fsync(fd)
        return [os.fstat(fd).st_ino, size]
    finally:
        os.close(fd)


def version_of(st: os.stat_result) -> list[int]:
    """What tells one promoted version's manifest from another's, as every client of a share sees it.

    Each save creates its manifest while the previous one still exists, so two versions' manifests never
    share an inode; the size guards a number reused much later. (Not the mtime: an NFS client's own view
    of a file it wrote can differ from the server's until the file is closed.)
    """
    return [st.st_ino, st.st_size]


def load(directory: str, *, follow: bool = True) -> dict[str, Any] | Damaged | None:
    """The manifest of ``directory`` (a path the caller gave, or with ``follow=False`` one whose last
    component must not be a link), validated; Damaged or None otherwise."""
    try:
        with held_directory(directory, follow=follow) as fd:
            return load_manifest(fd, MANIFEST_NAME)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return Damaged(f"{directory} cannot be opened as a directory ({exc.strerror or exc})")


def read(directory: str, *, follow: bool = True) -> dict[str, Any] | None:
    """The manifest of ``directory``, or None when it is absent or damaged (see ``load``)."""
    record = load(directory, follow=follow)
    return None if isinstance(record, Damaged) else record


def problems(
    directory: str, manifest: dict[str, Any], *, check_hashes: bool = True, follow: bool = True
) -> list[str]:
    """What in ``directory`` disagrees with ``manifest`` (empty when the directory is complete).

    ``manifest`` is validated (every name inside the directory); each entry is reached without following
    a link and must be a regular file, so a crafted entry cannot make this read anything elsewhere.
    """
    with held_directory(directory, follow=follow) as root:
        return problems_at(root, manifest, check_hashes=check_hashes)


def problems_at(root: int, manifest: dict[str, Any], *, check_hashes: bool = True) -> list[str]:
    """``problems`` of the directory held open as ``root``."""
    found: list[str] = []
    for rel, entry in manifest["files"].items():
        *dirs, name = rel.split("/")
        try:
            fd = open_relative_directory(root, "/".join(dirs))
        except OSError:
            found.append(f"missing: {rel}")
            continue
        try:
            found.extend(_entry_problems(fd, name, rel, entry, check_hashes))
        finally:
            os.close(fd)
    return found


def _entry_problems(fd: int, name: str, rel: str, entry: dict[str, Any], check_hashes: bool) -> list[str]:
    try:
        file_fd, st = open_regular_file(fd, name)
    except FileNotFoundError:
        return [f"missing: {rel}"]
    except OSError:
        return [f"not a regular file: {rel}"]
    try:
        if st.st_size != entry.get("size"):
            return [f"size mismatch: {rel} is {st.st_size} bytes, manifest says {entry.get('size')}"]
        if check_hashes:
            return [f"{digest} mismatch: {rel}" for digest in digests.mismatches(file_fd, entry)]
    finally:
        os.close(file_fd)
    return []
