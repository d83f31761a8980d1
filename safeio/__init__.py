"""safeio: replicated checkpoint files written safely to shared filesystems.

One writer, a private stage, one atomic promotion, every rank told the outcome, and never a wait
without a timeout. See README.md for the why and DESIGN.md for the how.
"""

from __future__ import annotations

from safeio.atomic import atomic_open
from safeio.audit import audit
from safeio.audit import install_from_environment as _install_audit_from_environment
from safeio.collectives import writer_only_section
from safeio.errors import (
    CollectiveInWriterSection,
    InvalidTargetError,
    LockTimeout,
    PeerTimeout,
    PromotionError,
    RemoteWriterError,
    SafeIOError,
    TargetExistsError,
    UnsafeWriteError,
    UnsupportedSaveError,
)
from safeio.group import Group, current_group
from safeio.hf import patch_save_pretrained, save_pretrained
from safeio.readers import is_complete, snapshot, verify
from safeio.replicated import Stage, replicated
from safeio.torch import torch_save

__version__ = "0.1.0"

# SAFEIO_AUDIT=<root> turns the sanitizer on for the whole process, for code you cannot edit.
_install_audit_from_environment()

__all__ = [
    "CollectiveInWriterSection",
    "Group",
    "InvalidTargetError",
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
    "writer_only_section",
]
