"""How a rank that did not write sees, on the filesystem, that the writer's save has landed.

Used when there is no store to hear the outcome from (``RANK``/``WORLD_SIZE`` only), when the store has
gone (rank 0 hosts it and may exit as soon as it has published), and after a successful outcome, to
return only once the new version is visible from this rank (NFS client caches lag behind the writer).
A save is recognised by the call id its writer recorded in the manifest (the save's identity and
number).
"""

from __future__ import annotations

import os
from typing import Any

from safeio._storage.readers import TargetReader


def call_covers(recorded: object, awaited: str) -> bool:
    """Whether a manifest written by save ``recorded`` shows that save ``awaited`` has happened.

    Call ids are ``job/target-digest/identity-digest/sequence``. A later save with the same identity in
    the same job also counts: the writer may have saved twice and exited before a slow peer looked (its
    store gone).
    """
    if not isinstance(recorded, str):
        return False
    if recorded == awaited:
        return True
    job, _, seq = recorded.rpartition("/")
    awaited_job, _, awaited_seq = awaited.rpartition("/")
    return job == awaited_job and seq.isdigit() and awaited_seq.isdigit() and int(seq) >= int(awaited_seq)


class DirectoryVisibility:
    """A directory target, recognised by its manifest (or by existing, when the manifest is off)."""

    def __init__(self, reader: TargetReader, *, call_id: str, manifest: bool) -> None:
        self.call_id = call_id
        self.manifest = manifest or reader.marker_required  # on object stores it is the commit marker
        self._reader = reader
        self._landed: dict[str, Any] | None = None
        self._landed_call: dict[str, Any] | None = None

    def _covering(self, record: dict[str, Any], newer: bool = False) -> dict[str, Any] | None:
        """The call record of ``record`` that shows this save landed, if any: only a version naming this
        save (or a later one of the same job and identity: the writer saved again before a slow peer
        looked), written by this user. ``newer``: the writer's outcome, heard through the store, named
        a version, and ``record`` was promoted after it (a rival job's): ours landed before it (see
        ``shows_version``). Without that outcome a rival's version never ends the wait: a peer with no
        store must not take another job's save (another user's) for its own."""
        owner = self._reader.owner(record)
        if owner is not None and owner != os.geteuid():
            return None
        calls = record.get("calls") or [{"call": record.get("call"), "result": record.get("result")}]
        for call in reversed(calls):
            if call_covers(call.get("call"), self.call_id):
                return dict(call)
        recorded = record.get("call")
        if newer and isinstance(recorded, str) and _job(recorded) != _job(self.call_id):
            return {"call": recorded, "result": record.get("result")}
        return None

    def landed(self, *, newer: bool = False) -> bool:
        if not self.manifest:
            return self._reader.exists()
        record = self._reader.manifest()
        if record is None:
            return False
        call = self._covering(record, newer)
        if call is None or self._reader.problems(record, check_hashes=False):
            return False
        self._landed, self._landed_call = record, call
        return True

    def shows_version(self, version: list[int], replaced: list[int] | None, *, read: bool = False) -> bool:
        """Whether this rank sees the version the writer promoted (``manifest.version_of``) or a later one.

        One stat of the manifest, which is all it takes unless this rank's view differs. Then the full
        ``landed`` check: a later save of this job covers this one; a rival job's version that is neither
        the one promoted nor the one it replaced was promoted after it (a stale view shows the replaced).
        ``read``: read the manifest even when the stat matches (for ``landed_files``).
        """
        current = self._reader.manifest_version() if self.manifest else None
        if current is not None and current == list(version) and not read:
            return True
        expected = (list(version), list(replaced) if replaced is not None else None)
        return self.landed(newer=current is not None and current not in expected)

    def landed_files(self) -> dict[str, int] | None:
        """The files (name -> size) of the version ``landed`` last saw, or None without a manifest."""
        if self._landed is None:
            return None
        return {rel: entry["size"] for rel, entry in self._landed["files"].items()}

    def result(self) -> Any:
        return self._landed_call.get("result") if self._landed_call else None


def _job(call_id: str) -> str:
    return call_id.split("/", 1)[0]


class FileVisibility:
    """A single file: it carries no manifest, so "landed" can only mean it is there."""

    def __init__(self, reader: TargetReader) -> None:
        self._reader = reader

    def landed(self) -> bool:
        return self._reader.file_exists()

    def result(self) -> Any:
        return None
