"""Can this machine mount the NFS-like filesystem? If not, say precisely why."""

from __future__ import annotations

import ctypes.util
import functools
import importlib.util
import os
import shutil
import sys
import tempfile


def _static_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"the NFS-like filesystem needs Linux FUSE (platform is {sys.platform})"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist (no FUSE kernel module, or a container without the device)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (apt-get install fuse3)"
    if ctypes.util.find_library("fuse3") is None:
        return "libfuse3 is not installed (apt-get install fuse3)"
    if importlib.util.find_spec("mfusepy") is None:
        return "the mfusepy package is not installed (pip install 'safeio-ckpt[testing]')"
    return None


@functools.lru_cache(maxsize=1)
def _probe_reason() -> str | None:
    # Everything may be installed and mounting still be refused (a container without
    # CAP_SYS_ADMIN, a seccomp profile): one real mount settles it, once per process.
    from safeio.testing.nfslike._mount import Mount, NfsLikeError

    with tempfile.TemporaryDirectory(prefix="nfslike-probe-") as tmp:
        backing, mountpoint = os.path.join(tmp, "backing"), os.path.join(tmp, "mnt")
        os.mkdir(backing)
        os.mkdir(mountpoint)
        try:
            with Mount(backing, mountpoint, state_dir=os.path.join(tmp, "state")):
                pass
        except NfsLikeError as exc:
            return f"a probe FUSE mount failed: {exc}"
    return None


def fuse_unavailable_reason(*, probe: bool = True) -> str | None:
    """None if the NFS-like filesystem can be mounted here, else the precise reason it cannot.

    With `probe` (the default) a real mount is tried once per process after the static checks.
    """
    reason = _static_reason()
    if reason is None and probe:
        reason = _probe_reason()
    return reason
