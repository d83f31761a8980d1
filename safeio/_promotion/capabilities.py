"""What each filesystem was measured to support, remembered per device for the life of the process.

``renameat2(RENAME_EXCHANGE)`` is refused by NFS and FUSE (EINVAL); after the first refusal on a
device, saves there go straight to renaming aside instead of asking again (and warning again).
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_no_exchange: set[int] = set()


def exchange_refused(device: int) -> bool:
    with _lock:
        return device in _no_exchange


def record_exchange_refused(device: int) -> None:
    with _lock:
        _no_exchange.add(device)
