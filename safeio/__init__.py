"""safeio: replicated checkpoint files written safely to shared filesystems.

One writer, a private stage, one atomic promotion, every rank told the outcome, and never a wait
without a timeout. See README.md for the why and DESIGN.md for the how.
"""

from __future__ import annotations

from safeio.atomic import atomic_open
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
)
from safeio.group import Group, current_group
from safeio.readers import is_complete, snapshot, verify
from safeio.replicated import Stage, replicated
from safeio.torch import torch_save

__version__ = "0.1.0"

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
    "__version__",
    "atomic_open",
    "current_group",
    "is_complete",
    "replicated",
    "snapshot",
    "torch_save",
    "verify",
]
