"""One walk of a finished stage: its modes put right, its files described and synced, its content listed.

A small save's fixed cost is mostly Python per entry visited, and the stage used to be walked four
times (permissions, manifest entries, the merge's list of files to move, the fsyncs); it is walked once,
and a durable save opens each file once to checksum and fsync it (its pages are still in the cache from
the body's write). Links the body wrote are kept as links: listed as content (a merge moves them), never
described, chmodded, synced or followed.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Any

from safeio._storage import digests
from safeio._storage.dirfd import Listing, open_regular_file, walk
from safeio._storage.manifest import BOOKKEEPING


@dataclass
class StageContents:
    """What a stage holds, in walk order (directories sorted, names sorted)."""

    entries: dict[str, dict[str, Any]] = field(default_factory=dict)  # regular files: manifest entries
    content: list[str] = field(default_factory=list)  # regular files and links, bookkeeping excluded


def settle_stage(
    stage_fd: int,
    dir_mode: int,
    *,
    describe: bool,
    hashes: bool,
    sync_files: bool = False,
    sync_dirs: bool = False,
) -> StageContents:
    """Give the stage the modes a plain mkdir/open would give, and describe it.

    ``dir_mode`` is what ``mkdir(stage, 0o777)`` gave the stage when it was made (the umask applied):
    every directory gets it, every file ``dir_mode & 0o666`` plus the execute bits it has that
    ``dir_mode`` allows. Tools write with their own modes (safetensors writes weights 0600 through
    mkstemp); a replicated checkpoint must be readable by whoever could read one written without safeio.
    A directory keeps its setgid bit (a setgid project share's group must stay on later writes there).
    Files are changed through a descriptor opened without following links. ``describe``: manifest entries
    (sizes, and a checksum with ``hashes``) for the regular files. ``sync_files``: fsync every regular file
    (a checkpoint's writer leaves them to the ranks' shares: ``StepRename``); ``sync_dirs``: every
    subdirectory; the stage itself is left to the caller, who adds the manifest to it first.
    """
    dir_mode &= 0o777
    settle = _Settle(dir_mode, dir_mode & 0o666, dir_mode & 0o111, describe, hashes, sync_files, sync_dirs)
    for listing in walk(stage_fd):  # no recursion: a body's 3,000-level tree is refused, not a crash
        settle.directory(listing)
    return settle.contents


@dataclass
class _Settle:
    dir_mode: int
    file_mode: int
    exec_bits: int  # the execute bits a file may keep
    describe: bool
    hashes: bool
    sync_files: bool
    sync_dirs: bool
    contents: StageContents = field(default_factory=StageContents)

    def directory(self, listing: Listing) -> None:
        """This directory's mode and files (the walk visits it before its subdirectories)."""
        fd, rel_dir = listing.fd, listing.rel
        mode = os.fstat(fd).st_mode
        wanted_dir = self.dir_mode | (mode & stat.S_ISGID)
        if stat.S_IMODE(mode) != wanted_dir:
            os.fchmod(fd, wanted_dir)
        for name, st in listing.entries:
            self.file(fd, f"{rel_dir}/{name}" if rel_dir else name, name, st)
        if self.sync_dirs and rel_dir:
            os.fsync(fd)  # its entries; the stage's own are synced with the manifest (seal_stage)

    def file(self, fd: int, rel: str, name: str, st: os.stat_result) -> None:
        if stat.S_ISREG(st.st_mode):
            wanted = self.file_mode | (st.st_mode & self.exec_bits)
            chmod = stat.S_IMODE(st.st_mode) != wanted
            counted = rel not in BOOKKEEPING
            entry: dict[str, Any] = {"size": st.st_size}
            hashes = counted and self.describe and self.hashes
            if chmod or hashes or self.sync_files:
                self._open_once(fd, name, wanted if chmod else None, entry if hashes else None, st.st_size)
            if not counted:
                return
            self.contents.content.append(rel)
            if self.describe:
                self.contents.entries[rel] = entry
        elif stat.S_ISLNK(st.st_mode) and rel not in BOOKKEEPING:
            self.contents.content.append(rel)

    def _open_once(
        self, dir_fd: int, name: str, mode: int | None, entry: dict[str, Any] | None, size: int
    ) -> None:
        """One open of a file for all it needs: its mode, its checksum, its fsync."""
        file_fd, _ = open_regular_file(dir_fd, name)
        try:
            if mode is not None:
                os.fchmod(file_fd, mode)
            if entry is not None:
                entry.update(digests.of_fd(file_fd, size=size))
            if self.sync_files:
                os.fsync(file_fd)
        finally:
            os.close(file_fd)
