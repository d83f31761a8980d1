"""Removing a test's scratch directory, whatever the test left in it.

``shutil.rmtree`` (and ``os.walk`` in Python 3.11) recurse once per level: a test that failed half-way
through a tree deeper than the recursion limit (the hostile-share cases build 1,100 and 3,000 levels)
made the fixture's clean-up raise RecursionError in teardown, an error on a test that had nothing to do
with it (issue 37). This walks with an explicit stack (safeio's own ``walk``), makes every directory
writable and searchable for its owner first (a test may leave one at mode 0 for a non-root run), and
removes with safeio's own iterative removal. Links are never followed.
"""

from __future__ import annotations

import contextlib
import os
import stat

__all__ = ["remove_scratch"]


def remove_scratch(path: str | os.PathLike[str]) -> None:
    """Remove ``path`` and everything below it, at any depth; best effort (what cannot be removed stays)."""
    from safeio._storage.dirfd import DIRECTORY_FLAGS, walk
    from safeio._storage.fsops import remove_tree

    path = os.fspath(path)
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            os.chmod(path, 0o700)
        fd = os.open(path, DIRECTORY_FLAGS)
    except FileNotFoundError:
        return
    except OSError:
        fd = -1  # a link or a file: remove_tree removes it as one
    if fd >= 0:
        try:
            # Top-down: each directory's subdirectories are opened after it is listed, so they can be
            # made usable first.
            for listing in walk(fd, max_relative=None, onerror=lambda _error: None):
                for name in listing.subdirs:
                    with contextlib.suppress(OSError):
                        os.chmod(name, 0o700, dir_fd=listing.fd)
        except OSError:
            pass
        finally:
            os.close(fd)
    with contextlib.suppress(OSError):
        remove_tree(path, what="test scratch directory")
