"""Replace in one step: ``renameat2(RENAME_EXCHANGE)`` swaps the stage and the target.

Readers never see the name missing. The stage's name then holds the old version, which is removed.
Where the filesystem refuses the flag (NFS and FUSE answer EINVAL) this falls back to renaming aside,
remembers the refusal for the device and warns once.
"""

from __future__ import annotations

import logging
import os

from safeio._promotion import capabilities
from safeio._promotion.aside import RenameAside
from safeio._promotion.local import LocalPromotion
from safeio._storage.posix import EXCHANGE_UNSUPPORTED, RENAME_EXCHANGE, renameat2
from safeio._who import who

logger = logging.getLogger("safeio")


class ExchangeRename(RenameAside):
    def swap(self, p: LocalPromotion) -> None:
        device = os.fstat(p.parent_fd).st_dev
        if capabilities.exchange_refused(device):
            super().swap(p)
            return
        fd = p.parent_fd
        try:
            renameat2(p.stage_name, p.name, RENAME_EXCHANGE, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError as exc:
            if exc.errno not in EXCHANGE_UNSUPPORTED:
                raise
            capabilities.record_exchange_refused(device)
            logger.warning(
                "%s: the filesystem of %s refuses RENAME_EXCHANGE (%s): replacing by renaming the "
                "old version aside; readers may see the name missing for an instant (mode='versioned' "
                "avoids that)",
                who(p.rank),
                p.target,
                exc.strerror,
            )
            super().swap(p)
            return
        if not p.promoted_is_stage(p.name):
            # Exchanged with something put in the stage's place: exchange back, the old version returns.
            renameat2(p.stage_name, p.name, RENAME_EXCHANGE, src_dir_fd=fd, dst_dir_fd=fd)
            raise p.swapped_stage_error()
        p.behaviour.old_version(p, p.stage_name)  # the stage's name now holds the old version
