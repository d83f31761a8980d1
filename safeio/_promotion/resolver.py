"""Which behaviour promotes a target: one map from (location, mode, what the filesystem can do) to a class.

Like orbax's mode-to-class map, and the only place that decides: the flow in ``base`` never tests a mode.

| target | mode | behaviour |
| --- | --- | --- |
| object store (any non-local fsspec URL) | any but versioned | ``CommitMarker`` |
| a versioned target (symlink to a version), or mode ``versioned`` | any | ``Versioned`` |
| local | ``merge`` | ``Merge`` |
| local | ``replace``, ``error`` | ``Exchange``; ``RenameAside`` where exchange is refused |

(``SAFEIO_NO_EXCHANGE=1`` also picks ``RenameAside``.)
"""

from __future__ import annotations

import contextlib
import os

from safeio._options import SaveOptions, exchange_disabled
from safeio._promotion import capabilities
from safeio._promotion.aside import RenameAside
from safeio._promotion.base import PhaseHook, Promotion
from safeio._promotion.commit_marker import CommitMarker
from safeio._promotion.exchange import Exchange
from safeio._promotion.leftovers import recover_target
from safeio._promotion.local import LocalPromotion
from safeio._promotion.merge import Merge
from safeio._promotion.versioned import Versioned
from safeio._storage.location import Location
from safeio._storage.readers import is_version_link


def local_behaviour(location: Location, mode: str) -> type[LocalPromotion]:
    if mode == "versioned" or is_version_link(location.path):
        return Versioned
    if mode == "merge":
        return Merge
    if exchange_disabled() or _exchange_known_refused(location.parent):
        return RenameAside
    return Exchange


def _exchange_known_refused(parent: str) -> bool:
    with contextlib.suppress(OSError):
        return capabilities.exchange_refused(os.stat(parent).st_dev)
    return False  # the parent does not exist yet: Exchange measures once it does


def promotion_for(
    location: Location,
    options: SaveOptions,
    *,
    rank: int,
    call_id: str,
    on_phase: PhaseHook | None = None,
) -> Promotion:
    if not location.is_local:
        return CommitMarker(location, options, rank=rank, call_id=call_id, on_phase=on_phase)
    behaviour = local_behaviour(location, options.mode)
    return behaviour(location, options, rank=rank, call_id=call_id, recover=recover_target, on_phase=on_phase)
