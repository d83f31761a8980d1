"""Inspecting and tidying a share: what ``safeio ls``, ``verify``, ``gc`` and ``doctor`` are built on.

The command line (``safeio.cli``) uses this module, ``safeio.frameworks`` and ``safeio`` only, never
safeio's private modules; so can a tool of your own that inspects what safeio wrote.

- **A target** (``Target``): a promoted directory or object-store prefix, its commit marker, its
  manifest and what differs from it (``verify``), the files it does not list.
- **A checkpoint root**: the step names it may use (``StepNames``), what its ``latest`` pointer names
  (``read_latest``), and whether a directory safeio did not write is complete by its framework's own
  marker (``framework_marker``: the HF Trainer's, accelerate's, DCP's).
- **Leftovers** of saves that were killed, recognised by name only (``parse_leftover``), judged as a
  writer judges them before it promotes (``staleness``, ``LeftoverOwners``) and recovered the same way
  (``recover_leftovers``); the soft locks a dead holder left (``read_lock_marker``,
  ``remove_lock_marker_if_unchanged``).
- **The audit sanitizer's records** (``safeio.audit``, ``SAFEIO_AUDIT``) merged into one report
  (``merge_audit_records``, ``format_audit_report``).
- **A share walked without following links** (``walk``, ``lstat_at``), and what the filesystem under a
  path is (``mount_of``) and can do (``exchange``).

Everything found in a share is untrusted input: nothing here follows a link planted there, opens a
FIFO, or reads past a bound, and another user's entries are named as theirs, never read.
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import Any

from safeio._checkpoints.steps import StepNames
from safeio._diagnostics.audit_report import AuditReport
from safeio._diagnostics.audit_report import format_report as format_audit_report
from safeio._diagnostics.audit_report import merge_reports as merge_audit_records
from safeio._promotion.backends import backend_for
from safeio._promotion.leftovers import TargetOwners as LeftoverOwners
from safeio._promotion.leftovers import recover_directory as recover_leftovers
from safeio._promotion.leftovers import staleness
from safeio._promotion.recovery_records import Action
from safeio._storage import digests
from safeio._storage.dirfd import Listing, lstat_at, walk
from safeio._storage.fsops import remove_tree
from safeio._storage.lock_markers import Marker as LockMarker
from safeio._storage.lock_markers import read_marker as read_lock_marker
from safeio._storage.lock_markers import remove_if_unchanged as remove_lock_marker_if_unchanged
from safeio._storage.manifest import MANIFEST_NAME
from safeio._storage.mounts import MountInfo, mount_of
from safeio._storage.names import LATEST, LOCK_SUFFIX, Sibling, sibling_name
from safeio._storage.names import parse as parse_leftover
from safeio._storage.posix import EXCHANGE_UNSUPPORTED, RENAME_EXCHANGE, renameat2
from safeio._storage.readers import NOT_A_DIRECTORY, TargetReader, read_pointer, why_not_a_directory
from safeio.frameworks import open_shared_directory
from safeio.integrations._accelerate_files import ranks_written
from safeio.integrations.transformers import TRAINER_STATE, is_complete_by_trainer

__all__ = [
    "EXCHANGE_UNSUPPORTED",
    "LATEST",
    "LOCK_SUFFIX",
    "MANIFEST_NAME",
    "NOT_A_DIRECTORY",
    "Action",
    "AuditReport",
    "LeftoverOwners",
    "Listing",
    "LockMarker",
    "MountInfo",
    "Sibling",
    "StepNames",
    "Target",
    "checksum_kinds",
    "exchange",
    "format_audit_report",
    "framework_marker",
    "lstat_at",
    "merge_audit_records",
    "mount_of",
    "parse_leftover",
    "read_latest",
    "read_lock_marker",
    "recover_leftovers",
    "remove_lock_marker_if_unchanged",
    "remove_tree",
    "staleness",
    "temporary_name",
    "walk",
    "why_not_a_directory",
]

DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's, written last by its save
ACCELERATE = "accelerate's random_states_<rank>.pkl"


class Target:
    """A promoted directory (a local path) or object-store prefix (an fsspec URL), read as ``verify``
    reads it. InvalidTargetError when ``path`` names nothing a target could be (empty, a NUL byte).

    ``owner``: the uid a local entry was judged to belong to (by its ``lstat``, in a directory others may
    write): it is then read only as a directory of that uid, each read through one descriptor, never
    through a link at its name; anything else there is reported (a problem, no manifest, not committed)
    and not read. Ignored on object stores."""

    def __init__(self, path: str | os.PathLike[str], *, owner: int | None = None) -> None:
        self._backend = backend_for(path)
        self._reader: TargetReader = self._backend.reader(owner=owner)

    @property
    def url(self) -> str:
        """The target as safeio names it in messages."""
        return self._backend.url()

    @property
    def path(self) -> str:
        """Its local path (for an object store, the path within the store)."""
        return self._backend.location.path

    @property
    def marker_required(self) -> bool:
        """Whether the target is complete only with its commit marker (an object-store prefix)."""
        return self._reader.marker_required

    def holds_checkpoints(self) -> bool:
        """Whether it is a ``safeio.Checkpoints`` root rather than one promoted target."""
        return self._backend.holds_checkpoints()

    def absence(self) -> str | None:
        """Why nothing is there to check (the words of the problem), or None when something is."""
        return self._reader.absence()

    def manifest(self) -> dict[str, Any] | None:
        """Its manifest when there is one that can be trusted (read within safeio's bounds), else None."""
        return self._reader.manifest()

    def committed_marker(self) -> dict[str, Any] | None:
        """The commit marker of a checkpoint step, when it is one with every listed file at its size."""
        return self._reader.committed_marker()

    def marker_owner(self, record: dict[str, Any]) -> int | None:
        """The uid that wrote ``record`` (its manifest), when known."""
        return self._reader.owner(record)

    def problems(self, record: dict[str, Any], *, check_hashes: bool) -> list[str]:
        """What differs from ``record``: files missing, of another size, or (``check_hashes``) content."""
        return self._reader.problems(record, check_hashes=check_hashes)

    def verify(self, *, check_hashes: bool = True) -> list[str]:
        """Every problem of the target against its manifest ([] when complete)."""
        return self._reader.verify(check_hashes=check_hashes)

    def unlisted(self, record: dict[str, Any]) -> list[str]:
        """Its files that ``record`` does not list (OSError when the tree cannot be listed)."""
        return self._reader.unlisted(record)

    def no_manifest_problem(self) -> str:
        """The words for a target without a manifest it can be checked against."""
        return self._reader.no_manifest_problem()

    def describe_missing_manifest(self) -> str:
        """The words for an object-store prefix without its commit marker."""
        return self._reader.describe_missing_manifest()


def checksum_kinds(record: dict[str, Any]) -> list[str]:
    """The kinds of checksum a manifest's entries hold (a merge may keep older sha256 entries)."""
    return sorted({name for entry in record["files"].values() for name in digests.recorded(entry)})


def read_latest(root: str) -> str | None:
    """The step name the ``latest`` pointer of a checkpoint root names; None without a pointer.
    InvalidTargetError naming it when it is no small regular file (a link, a FIFO, a huge file: never
    followed or read)."""
    return read_pointer(os.path.join(root, LATEST))


def framework_marker(path: str) -> tuple[str | None, int | None]:
    """The framework's own completion marker of a checkpoint directory safeio did not write, when it is
    there: the HF Trainer's ``trainer_state.json`` (with the weights), accelerate's random states of every
    rank (written last by each; with the number of ranks), or ``torch.distributed.checkpoint``'s
    ``.metadata`` (written last by its save). (None, None): no marker safeio knows says it is complete."""
    if is_complete_by_trainer(path):
        return TRAINER_STATE, None
    ranks = ranks_written(path)
    if ranks is not None:
        return f"{ACCELERATE} of {ranks} rank{'s' if ranks > 1 else ''}", ranks
    with contextlib.suppress(OSError), open_shared_directory(path) as directory:
        found = directory.lstat(DCP_METADATA)
        if found is not None and stat.S_ISREG(found.st_mode):
            return f"torch.distributed.checkpoint's {DCP_METADATA}", None
    return None, None


def temporary_name(name: str) -> str:
    """A name for a temporary entry beside ``name`` that ``safeio gc`` recognises as this process's
    (removed as a leftover once the process is gone)."""
    return sibling_name(name, "tmp")


def exchange(a: str, b: str) -> None:
    """Swap the entries ``a`` and ``b`` in one step (``renameat2(RENAME_EXCHANGE)``); OSError whose errno
    is in ``EXCHANGE_UNSUPPORTED`` where the filesystem cannot."""
    renameat2(a, b, RENAME_EXCHANGE)
