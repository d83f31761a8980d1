"""Close-to-open on a replaced file: an open of a name whose file was replaced on another client fails
with ESTALE, as an NFS client's stale file handle does, so that the kernel looks the name up again.

The kernel keeps a node per name for ``entry_timeout`` and its attributes (the size among them) for
``attr_timeout``, and opens the node without asking again. This filesystem serves a node by its path,
so such an open reads the file that replaced it, cut to the size the kernel still holds: another client
read the first 1,772 bytes of a 1,829-byte ``tokenizer.json`` that had replaced one of 1,772 bytes, and
the JSON did not parse (tests/test_identity.py). An NFS client revalidates on open (close-to-open) and
gets ESTALE for the replaced file's handle; the kernel then redoes the lookup (``LOOKUP_REVAL``), which
here reports the new file, and retries. What a ``stat`` without an open shows stays as stale as before:
that is NFS's attribute cache.
"""

from __future__ import annotations

import errno
import threading


class ToldInodes:
    """The backing inode this mount last reported to the kernel for each path (by GETATTR, which is
    also how libfuse answers a lookup), followed through this mount's own renames and unlinks."""

    def __init__(self) -> None:
        self._told: dict[str, int] = {}
        self._lock = threading.Lock()

    def told(self, path: str, ino: int) -> None:
        with self._lock:
            self._told[path] = ino

    def check_open(self, path: str, ino: int) -> None:
        """Raise ESTALE when the file at ``path`` (inode ``ino``) is not the one the kernel was told of.
        Recorded as told first: the kernel's retry, after its new lookup, then opens it."""
        with self._lock:
            before = self._told.get(path)
            self._told[path] = ino
        if before is not None and before != ino:
            raise OSError(errno.ESTALE, "nfslike: the file was replaced since this client looked it up", path)

    def renamed(self, old: str, new: str) -> None:
        """This mount renamed ``old`` to ``new``: the kernel moved its node to the new name."""
        with self._lock:
            moved = self._told.pop(old, None)
            if moved is None:
                self._told.pop(new, None)
            else:
                self._told[new] = moved

    def forgot(self, path: str) -> None:
        with self._lock:
            self._told.pop(path, None)
