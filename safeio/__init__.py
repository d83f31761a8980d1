"""safeio: replicated checkpoint files written safely to shared filesystems.

One writer, a private stage, one atomic promotion, every rank told the outcome, and never a wait
without a timeout. See README.md for the why, docs/architecture.md for the layout.

Only this module, ``safeio.frameworks`` and ``safeio.shares`` (what framework adapters and the command
line are built on), and the public subpackages ``safeio.testing``, ``safeio.cli`` and
``safeio.integrations`` are API; everything else is private and layered, each layer importing only the
ones before it:

    _errors, _who, _options, _boundary   the error tree, process names, options, the error mapping
    _storage/        where a target lives; names, manifests, locks, POSIX primitives; the reading side
    _promotion/      one class per storage behaviour (exchange, aside, merge, versioned, commit marker)
    _coordination/   the group and the channel that publishes a writer's phases and outcome
    _diagnostics/    the watchdog, writer-only sections, the audit sanitizer
    _saves/          the entry points: the replicated flow, save_pretrained and its patch, torch_save,
                     atomic_open
    _checkpoints/    whole checkpoints (every rank's files, one commit, latest, retention) on the above
"""

from __future__ import annotations

from safeio._checkpoints.checkpoints import Checkpoint, Checkpoints
from safeio._checkpoints.pointer import write_pointer
from safeio._coordination.group import Group, current_group
from safeio._diagnostics.audit import audit
from safeio._diagnostics.audit import install_at_import as _install_audit_from_environment
from safeio._diagnostics.collectives import writer_only_section
from safeio._errors import (
    CheckpointError,
    CollectiveInWriterSection,
    CollectiveMismatch,
    InvalidOptionError,
    InvalidTargetError,
    InvalidTypeError,
    LockTimeout,
    PeerTimeout,
    PromotionError,
    RemoteWriterError,
    SafeIOError,
    TargetExistsError,
    UnsafeWriteError,
    UnsupportedSaveError,
)
from safeio._saves.atomic import atomic_open
from safeio._saves.hf import save_pretrained
from safeio._saves.hf_patch import patch_save_pretrained
from safeio._saves.reading import is_complete, snapshot, verify
from safeio._saves.replicated import Stage, replicated
from safeio._saves.torch import torch_save

__version__ = "0.1.0"

# SAFEIO_AUDIT=<root> turns the sanitizer on for the whole process, for code you cannot edit.
_install_audit_from_environment()

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "Checkpoints",
    "CollectiveInWriterSection",
    "CollectiveMismatch",
    "Group",
    "InvalidOptionError",
    "InvalidTargetError",
    "InvalidTypeError",
    "LockTimeout",
    "PeerTimeout",
    "PromotionError",
    "RemoteWriterError",
    "SafeIOError",
    "Stage",
    "TargetExistsError",
    "UnsafeWriteError",
    "UnsupportedSaveError",
    "__version__",
    "atomic_open",
    "audit",
    "current_group",
    "is_complete",
    "patch_save_pretrained",
    "replicated",
    "save_pretrained",
    "snapshot",
    "torch_save",
    "verify",
    "write_pointer",
    "writer_only_section",
]
