"""A directory chain deeper than PATH_MAX allows by name, for the tests of walks and clean-up."""

from __future__ import annotations

import os
from pathlib import Path


def make_chain(top: Path, levels: int) -> None:
    """``top/d/d/.../d/f`` (``top`` exists), made relative to a held descriptor, one level at a time."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(levels):
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    os.close(fd)
