"""How safeio names a process in its messages: ``rank 0 (host-a pid 1533)``.

A stalled job is debugged from a merged log of many ranks on many hosts: a message that lacks the
rank, host and pid cannot be traced back to the process that has to be inspected (py-spy, /proc).
"""

from __future__ import annotations

import os
import socket
import sys

_HOST = socket.gethostname()


def current_rank() -> int | None:
    """This process's rank: torch.distributed's if initialized, else the launcher's, else None."""
    dist = sys.modules.get("torch.distributed")  # never import torch just to name a process
    if dist is not None:
        try:
            if dist.is_available() and dist.is_initialized():
                return int(dist.get_rank())
        except Exception:  # a half-torn-down process group must not break a log line
            pass
    for var in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(var)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


def who(rank: int | None = None) -> str:
    """``rank R (host pid P)``; ``rank ?`` when the rank is unknown."""
    shown = current_rank() if rank is None else rank
    return f"rank {'?' if shown is None else shown} ({_HOST} pid {os.getpid()})"


def host() -> str:
    return _HOST
