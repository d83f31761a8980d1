"""What ``/proc/self/mountinfo`` says about the filesystem holding a path, in terms a cluster user can act on.

The mount options that matter for replicated checkpoints are the ones that decide whether a rank can
hang (NFS ``hard``), whether locks exclude across nodes (NFS ``nolock``/``local_lock``, Lustre
``flock``/``localflock``, CIFS ``nobrl``) and how long another node can see a stale directory
(NFS ``ac*``/``actimeo``/``lookupcache``, FUSE ``entry_timeout``/``attr_timeout``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from safeio.shares import MountInfo, mount_of

LOCAL_DISK_TYPES = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "jfs", "reiserfs", "bcachefs"}
)
MEMORY_TYPES = frozenset({"tmpfs", "ramfs", "devtmpfs"})
# nfs(5) defaults when the option is absent.
NFS_AC_DEFAULTS = {"acregmin": 3.0, "acregmax": 60.0, "acdirmin": 30.0, "acdirmax": 60.0}
FUSE_TIMEOUT_NAMES = ("entry_timeout", "negative_timeout", "attr_timeout")


@dataclass
class FsInfo:
    """The filesystem holding a path, classified, with the settings a user should know about."""

    path: str
    mount_point: str
    fs_type: str
    source: str
    options: tuple[str, ...]
    kind: str  # local, memory, overlay, nfs, lustre, gpfs, cifs, fuse, network, unknown
    label: str
    is_network: bool
    settings: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # The longest time another client may see a stale entry or attributes, when the options say.
    cache_window: float | None = None
    # Whether flock/POSIX locks reach other clients: "cluster", "local", or "unknown" (one host: "n/a").
    lock_scope: str = "unknown"

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "mount_point": self.mount_point,
            "fs_type": self.fs_type,
            "source": self.source,
            "options": list(self.options),
            "kind": self.kind,
            "label": self.label,
            "is_network": self.is_network,
            "settings": dict(self.settings),
            "notes": list(self.notes),
            "cache_window": self.cache_window,
            "lock_scope": self.lock_scope,
        }


def options_dict(options: tuple[str, ...]) -> dict[str, str]:
    """Mount options as a dict; flags map to "" (the last occurrence wins, as for the kernel)."""
    out: dict[str, str] = {}
    for option in options:
        key, _, value = option.partition("=")
        out[key] = value
    return out


def _seconds(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "") else None
    except ValueError:
        return None


def inspect(path: str) -> FsInfo:
    mount = mount_of(path)
    if mount is None:
        return FsInfo(
            path, "?", "unknown", "?", (), "unknown", "unknown (not in /proc/self/mountinfo)", False
        )
    return classify(path, mount)


def classify(path: str, mount: MountInfo) -> FsInfo:
    fs_type = mount.fs_type
    base = fs_type.split(".")[0]
    info = FsInfo(
        path, mount.mount_point, fs_type, mount.source, mount.options, "unknown", fs_type, mount.is_network
    )
    opts = options_dict(mount.options)
    if base in ("nfs", "nfs4"):
        _nfs(info, opts)
    elif base == "lustre":
        _lustre(info, opts)
    elif base == "gpfs":
        info.kind, info.label, info.lock_scope = "gpfs", "GPFS (IBM Storage Scale)", "cluster"
        info.notes.append(
            "GPFS keeps metadata coherent across nodes with tokens and its locks are cluster-wide"
        )
    elif base in ("cifs", "smb3", "smbfs"):
        _cifs(info, opts)
    elif base in ("fuse", "fuseblk"):
        _fuse(info, opts)
    elif fs_type == "overlay":
        info.kind, info.label, info.lock_scope = "overlay", "overlay (container filesystem, local)", "n/a"
        info.notes.append("overlay is node-local: other nodes cannot see this directory at all")
    elif fs_type in MEMORY_TYPES:
        info.kind, info.label, info.lock_scope = "memory", f"{fs_type} (in memory, node-local)", "n/a"
        info.notes.append(
            "node-local and lost at reboot: other nodes cannot see it; nothing survives a crash"
        )
    elif fs_type in LOCAL_DISK_TYPES:
        info.kind, info.label, info.lock_scope = "local", f"{fs_type} (local disk)", "n/a"
    elif mount.is_network:
        info.kind, info.label = "network", f"{fs_type} (network filesystem)"
    return info


def _nfs(info: FsInfo, opts: dict[str, str]) -> None:
    version = opts.get("vers") or opts.get("nfsvers") or ("4" if info.fs_type == "nfs4" else "3")
    info.kind, info.label = "nfs", f"NFS v{version}"
    info.settings["version"] = version
    if "soft" in opts or "softerr" in opts:
        info.settings["hard/soft"] = "soft" if "soft" in opts else "softerr"
        info.notes.append(
            "soft mount: a stalled server turns into I/O errors after timeo*retrans instead of a hang, "
            "and a write can be lost silently"
        )
    else:
        info.settings["hard/soft"] = "hard"
        info.notes.append(
            "hard mount: while the server (or an inode lock) stalls, I/O waits in the kernel forever, "
            "uninterruptibly: the 35-hour hang was on a hard mount"
        )
    for name in ("timeo", "retrans", "proto", "sync"):
        if name in opts:
            info.settings[name] = opts[name] or "on"
    _nfs_locks(info, opts)
    _nfs_cache(info, opts)


def _nfs_locks(info: FsInfo, opts: dict[str, str]) -> None:
    local_lock = opts.get("local_lock", "none")
    if "nolock" in opts:
        info.settings["locks"] = "nolock"
        info.lock_scope = "local"
        info.notes.append(
            "nolock: flock and POSIX locks are local to this client and exclude nothing on other nodes"
        )
    elif local_lock in ("all", "flock", "posix"):
        info.settings["locks"] = f"local_lock={local_lock}"
        info.lock_scope = "local"
        kinds = "flock and POSIX" if local_lock == "all" else local_lock
        info.notes.append(f"local_lock={local_lock}: {kinds} locks are local to this client")
    else:
        info.settings["locks"] = "lock (server-side)" + (
            f", local_lock={local_lock}" if "local_lock" in opts else ""
        )
        # Linux emulates flock on NFS with whole-file POSIX locks, so both reach the server.
        info.lock_scope = "cluster"


def _nfs_cache(info: FsInfo, opts: dict[str, str]) -> None:
    lookupcache = opts.get("lookupcache", "all")
    info.settings["lookupcache"] = lookupcache + ("" if "lookupcache" in opts else " (default)")
    if "noac" in opts:
        info.settings["attribute cache"] = "noac (off)"
        info.cache_window = 0.0
        return
    ac = dict(NFS_AC_DEFAULTS)
    actimeo = _seconds(opts.get("actimeo"))
    if actimeo is not None:
        ac = dict.fromkeys(ac, actimeo)
    explicit = {name for name in ac if name in opts}
    for name in ac:
        value = _seconds(opts.get(name))
        if value is not None:
            ac[name] = value
    source = "actimeo" if actimeo is not None else ("mount options" if explicit else "nfs(5) defaults")
    info.settings["attribute cache"] = (
        f"files {ac['acregmin']:g}-{ac['acregmax']:g} s, directories {ac['acdirmin']:g}-{ac['acdirmax']:g} s "
        f"({source})"
    )
    info.cache_window = max(ac.values())
    if lookupcache in ("all", "pos", "positive"):
        what = "a missing name" if lookupcache == "all" else "a removed name"
        info.notes.append(
            f"lookupcache={lookupcache}: another node may keep seeing {what} until the directory's cached "
            f"attributes expire (up to {ac['acdirmax']:g} s)"
        )


def _lustre(info: FsInfo, opts: dict[str, str]) -> None:
    info.kind, info.label = "lustre", "Lustre"
    if "flock" in opts:
        info.settings["locks"] = "flock (coherent across clients)"
        info.lock_scope = "cluster"
    elif "localflock" in opts:
        info.settings["locks"] = "localflock (local to this client)"
        info.lock_scope = "local"
        info.notes.append("localflock: flock and POSIX locks exclude nothing on other clients")
    elif "noflock" in opts:
        info.settings["locks"] = "noflock (flock fails)"
        info.lock_scope = "local"
    else:
        info.settings["locks"] = "no flock option shown: the client's default applies (see the probes below)"


def _cifs(info: FsInfo, opts: dict[str, str]) -> None:
    info.kind, info.label = "cifs", f"CIFS/SMB{(' ' + opts['vers']) if opts.get('vers') else ''}"
    info.settings["cache"] = opts.get("cache", "strict (default)")
    actimeo = _seconds(opts.get("actimeo"))
    info.cache_window = actimeo if actimeo is not None else 1.0
    info.settings["attribute cache"] = f"actimeo {info.cache_window:g} s" + (
        "" if actimeo is not None else " (default)"
    )
    if "nobrl" in opts:
        info.settings["locks"] = "nobrl (byte-range locks not sent to the server)"
        info.lock_scope = "local"
    else:
        info.lock_scope = "cluster"


def _fuse(info: FsInfo, opts: dict[str, str]) -> None:
    subtype = info.fs_type.partition(".")[2] or info.source
    info.kind, info.label = "fuse", f"FUSE ({subtype})"
    info.settings["daemon"] = subtype
    for name in ("allow_other", "default_permissions"):
        if name in opts:
            info.settings[name] = "on"
    info.notes.append(
        "FUSE: locking, caching and rename semantics are whatever the daemon implements; "
        "safeio treats it as a network filesystem"
    )
    daemon = find_fuse_daemon(info.mount_point)
    if daemon is None:
        info.settings["cache timeouts"] = (
            "not visible (no daemon on this host names the mount point on its command line)"
        )
        return
    pid, timeouts = daemon
    info.settings["daemon pid"] = str(pid)
    if timeouts:
        shown = ", ".join(f"{name} {value:g} s" for name, value in sorted(timeouts.items()))
        info.settings["cache timeouts"] = f"{shown} (from the daemon's command line)"
        info.cache_window = max(timeouts.values())
    else:
        info.settings["cache timeouts"] = (
            "not on the daemon's command line (libfuse defaults: entry and attributes 1 s, negative 0 s)"
        )


def find_fuse_daemon(mount_point: str) -> tuple[int, dict[str, float]] | None:
    """The process serving a FUSE mount (found by the mount point on its command line) and the cache
    timeouts it was started with (``-o entry_timeout=N`` or ``--entry-timeout N``), if any."""
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return None
    for pid in sorted(pids):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode("utf-8", "surrogateescape") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if mount_point in argv and pid != os.getpid() and _may_serve_fuse(pid):
            return pid, _timeouts_from_argv(argv)
    return None


def _may_serve_fuse(pid: int) -> bool:
    # A FUSE daemon holds /dev/fuse open; a shell or a tool that merely names the mount point does not.
    # Other users' descriptors are unreadable without privileges: then the command line has to do.
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return True
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == "/dev/fuse":
                return True
        except OSError:
            continue
    return False


def _timeouts_from_argv(argv: list[str]) -> dict[str, float]:
    found: dict[str, float] = {}
    for index, arg in enumerate(argv):
        option_lists = []
        if arg == "-o" and index + 1 < len(argv):
            option_lists.append(argv[index + 1])
        elif arg.startswith("-o") and len(arg) > 2:
            option_lists.append(arg[2:])
        for options in option_lists:
            for key, value in options_dict(tuple(options.split(","))).items():
                if key in FUSE_TIMEOUT_NAMES and _seconds(value) is not None:
                    found[key] = float(value)
        flag, _, inline = arg.partition("=")
        name = flag.lstrip("-").replace("-", "_")
        if flag.startswith("--") and name in FUSE_TIMEOUT_NAMES:
            value = inline if inline else (argv[index + 1] if index + 1 < len(argv) else "")
            seconds = _seconds(value)
            if seconds is not None:
                found[name] = seconds
    return found
