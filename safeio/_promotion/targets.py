"""What a directory save may replace: a directory, or a version link safeio made, and never the ground
the process stands on (``Behaviour.check_target``'s default)."""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

from safeio._errors import InvalidTargetError, TargetExistsError
from safeio._storage.readers import version_pointee

if TYPE_CHECKING:
    from safeio._promotion.local import LocalPromotion


def check_directory_target(p: LocalPromotion, st: os.stat_result | None, *, guard_own_ground: bool) -> None:
    """Refuse a foreign symlink, a file, an existing target with mode='error', and (``guard_own_ground``:
    behaviours that remove the old version) a target holding the working or home directory."""
    if st is not None:
        _check_existing(p, st)
    if guard_own_ground:
        refuse_protected_directories(p)


def _check_existing(p: LocalPromotion, st: os.stat_result) -> None:
    target = p.target
    dir_fd = p.parent_fd if p.parent_fd >= 0 else None
    shown = p.name if dir_fd is not None else target
    if stat.S_ISLNK(st.st_mode) and version_pointee(shown, dir_fd=dir_fd) is None:
        raise InvalidTargetError(
            f"target {target} is a symlink safeio did not create; safeio never writes through or "
            "replaces a foreign symlink (resolve it yourself and pass the real path)",
            target,
        )
    if not stat.S_ISLNK(st.st_mode) and not stat.S_ISDIR(st.st_mode):
        raise InvalidTargetError(
            f"target {target} exists and is not a directory: a replicated target is a directory "
            "(use safeio.atomic_open for a single file)",
            target,
        )
    if p.options.mode == "error":
        raise TargetExistsError(f"target {target} already exists and mode='error'", target)


def refuse_protected_directories(p: LocalPromotion) -> None:
    """Behaviours that remove the old version refuse a target that holds the process's own ground.

    ``replicated(".")`` in replace mode would otherwise empty the working directory it runs in.
    """
    if p.stage_fd >= 0:
        return  # checked before the stage was made; the working and home directories are the caller's
    target = p.target
    candidates = {target, os.path.realpath(target)}
    for what, path in (
        ("the working directory", _cwd()),
        ("the home directory", os.path.expanduser("~")),
    ):
        if (
            path
            and path != "/"
            and any(path == t or path.startswith(t.rstrip("/") + "/") for t in candidates)
        ):
            raise InvalidTargetError(
                f"refusing mode={p.options.mode!r} for {target}: it is or contains {what} {path}, "
                "which replacing it would delete (save into a subdirectory, or use mode='merge')",
                target,
            )


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # the working directory was removed
        return None
