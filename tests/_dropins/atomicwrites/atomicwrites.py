"""python-atomicwrites' ``atomic_write`` on ``safeio.atomic_open``: the mapping docs/getting-started.md
documents ("From python-atomicwrites"), put first on the path so that atomicwrites' own tests import it.

``overwrite=True`` is ``atomic_open``'s replace mode (``"w"``/``"wb"``); atomicwrites' default,
``overwrite=False``, its exclusive mode (``"x"``/``"xb"``): TargetExistsError, an OSError with errno
EEXIST, when the target exists at the commit.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import IO, Any

import safeio

__version__ = "1.4.1 on safeio.atomic_open"


def atomic_write(
    path: str | os.PathLike[str], mode: str = "w", overwrite: bool = False, **open_kwargs: Any
) -> AbstractContextManager[IO[Any]]:
    return safeio.atomic_open(path, mode if overwrite else mode.replace("w", "x"), **open_kwargs)
