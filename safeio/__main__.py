"""``python -m safeio``: the ``safeio`` command."""

from __future__ import annotations

import sys

from safeio.cli import main

if __name__ == "__main__":
    sys.exit(main())
