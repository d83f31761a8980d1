"""The mount options: one dataclass shared by the `mount()` API, the command line and the daemon.

Every behaviour is off by default; `Options()` is a plain passthrough filesystem.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from typing import Any


def _default_allow_other() -> bool:
    # Root may always pass allow_other; other users only when /etc/fuse.conf says user_allow_other.
    if os.geteuid() == 0:
        return True
    try:
        with open("/etc/fuse.conf", encoding="utf-8") as conf:
            return any(line.strip() == "user_allow_other" for line in conf)
    except OSError:
        return False


def _opt(default: Any, help: str, kind: type, *, flag: bool = False) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, "kind": kind, "flag": flag})


@dataclasses.dataclass(frozen=True)
class Options:
    """What the NFS-like filesystem emulates. Field names are the keyword arguments of `mount()`."""

    hazard_timeout: float | None = _opt(
        None,
        "enable the inode interlock: a truncation of a file another process has open waits this long, "
        "then fails with EDEADLK (and I/O blocked behind it with EIO) and a hazard is logged",
        float,
    )
    direct_io: bool | None = _opt(
        None, "bypass the page cache (default: on when the interlock is on, so every read is seen)", bool
    )
    entry_timeout: float | None = _opt(
        None, "seconds the kernel caches a name lookup (libfuse default 1)", float
    )
    negative_timeout: float | None = _opt(
        None, "seconds the kernel caches a failed lookup (libfuse default 0)", float
    )
    attr_timeout: float | None = _opt(None, "seconds the kernel caches attributes (libfuse default 1)", float)
    silly_rename: bool = _opt(
        False, "unlinking or renaming over an open file renames it to .nfsXXXX until closed", bool, flag=True
    )
    no_symlinks: bool = _opt(
        False,
        "symlink() fails with EPERM, as on an SMB/CIFS or FAT share without symlink support",
        bool,
        flag=True,
    )
    enospc_after: int | None = _opt(None, "ENOSPC once this many bytes have been written", int)
    eio_on_fsync: str | None = _opt(None, "EIO on fsync of paths matching this glob", str)
    latency: float = _opt(0.0, "seconds added to every operation", float)
    hang: str | None = _opt(
        None, "operations on paths matching this glob block until released (Mount.release())", str
    )
    hang_timeout: float | None = _opt(None, "a hung operation fails with EIO after this many seconds", float)
    hang_after_bytes: int | None = _opt(
        None, "with hang: only writes starting this many bytes or more into a file hang", int
    )
    allow_other: bool | None = _opt(None, "let other users use the mount (default: when permitted)", bool)
    default_permissions: bool = _opt(True, "let the kernel enforce file modes, as an NFS server does", bool)
    auto_unmount: bool = _opt(True, "unmount when the daemon dies (fusermount3 --auto-unmount)", bool)

    def __post_init__(self) -> None:
        for name in ("hazard_timeout", "entry_timeout", "negative_timeout", "attr_timeout", "hang_timeout"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"nfslike option {name} must be >= 0, got {value!r}")
        if self.latency < 0:
            raise ValueError(f"nfslike option latency must be >= 0, got {self.latency!r}")
        for name in ("enospc_after", "hang_after_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"nfslike option {name} must be >= 0, got {value!r}")

    @property
    def use_direct_io(self) -> bool:
        # With the page cache the kernel serves and retries reads itself and hides most of the
        # interlock's EIOs; direct_io makes every read and write reach the daemon.
        return self.direct_io if self.direct_io is not None else self.hazard_timeout is not None

    def fuse_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `mfusepy.FUSE` (libfuse `-o` options and fuse_config fields)."""
        kwargs: dict[str, Any] = {
            "foreground": True,
            # /proc/self/mountinfo shows fstype "fuse.nfslike"; safeio treats fuse* as a network fs.
            "fsname": "nfslike",
            "subtype": "nfslike",
            # Not hard_remove: it makes fstat() of an open, unlinked file fail with ESTALE. libfuse's
            # ".fuse_hidden" names are translated instead (see _hidden.py).
            "hard_remove": False,
            # st_ino is the backing inode, as an NFS fileid is the server's inode number.
            "use_ino": True,
            "readdir_ino": True,
            "direct_io": self.use_direct_io,
            "default_permissions": self.default_permissions,
            "auto_unmount": self.auto_unmount,
        }
        allow_other = self.allow_other if self.allow_other is not None else _default_allow_other()
        if allow_other:
            kwargs["allow_other"] = True
        for name in ("entry_timeout", "negative_timeout", "attr_timeout"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        return kwargs

    def to_argv(self) -> list[str]:
        """Command-line flags that reproduce these options (inverse of `from_namespace`)."""
        argv: list[str] = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value == field.default:
                continue
            flag = "--" + field.name.replace("_", "-")
            if field.metadata["kind"] is bool:
                argv.append(flag if value else "--no-" + field.name.replace("_", "-"))
            else:
                argv += [flag, str(value)]
        return argv

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("emulated NFS behaviours (all off by default)")
        for field in dataclasses.fields(cls):
            flag = "--" + field.name.replace("_", "-")
            kind = field.metadata["kind"]
            help_text = field.metadata["help"]
            if kind is bool and field.metadata["flag"]:
                group.add_argument(flag, action="store_true", default=field.default, help=help_text)
            elif kind is bool:
                group.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=field.default, help=help_text
                )
            else:
                group.add_argument(flag, type=kind, default=field.default, help=help_text)

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> Options:
        return cls(**{field.name: getattr(namespace, field.name) for field in dataclasses.fields(cls)})

    @classmethod
    def names(cls) -> Sequence[str]:
        return [field.name for field in dataclasses.fields(cls)]
