"""An NFS-like FUSE filesystem for tests: a passthrough of a backing directory that emulates, each
switchable, the NFS client behaviours that break checkpoint code.

- inode interlock (`hazard_timeout`): truncating a file another process holds open blocks, and so
  does that process's I/O, until the bound fires (EDEADLK / EIO) and a hazard is logged;
- client caches (`entry_timeout`, `negative_timeout`, `attr_timeout`): two mounts of one backing
  directory are two clients that see each other's changes late;
- silly rename (`silly_rename`): removing an open file renames it to `.nfsXXXX` until closed;
- renameat2 flags are refused with EINVAL, as the NFS client does;
- no symbolic links (`no_symlinks`): symlink() fails with EPERM, as on SMB/CIFS or FAT shares;
- faults: `enospc_after`, `eio_on_fsync`, `latency`, `hang` / `hang_timeout` / `hang_after_bytes`
  (`Mount.hung()` names the processes held);
- operation counters per client process.

The daemon runs as a separate process (`python -m safeio.testing.nfslike --help`); this module does
not import mfusepy.
"""

from __future__ import annotations

from safeio.testing.nfslike._availability import fuse_unavailable_reason
from safeio.testing.nfslike._control import ControlError
from safeio.testing.nfslike._counters import OPS
from safeio.testing.nfslike._faults import FAULT_NAMES
from safeio.testing.nfslike._interlock import IO_BLOCKED, TRUNCATE_BLOCKED
from safeio.testing.nfslike._mount import Mount, NfsLikeError, OpCounts, mount
from safeio.testing.nfslike._options import Options

__all__ = [
    "FAULT_NAMES",
    "IO_BLOCKED",
    "OPS",
    "TRUNCATE_BLOCKED",
    "ControlError",
    "Mount",
    "NfsLikeError",
    "OpCounts",
    "Options",
    "fuse_unavailable_reason",
    "mount",
]
