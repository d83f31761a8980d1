"""Directory names of steps: ``name="step_{step}"`` (the default) or HF's ``"checkpoint-{step}"``."""

from __future__ import annotations

import re

from safeio._errors import InvalidOptionError
from safeio._storage.dirfd import is_component


class StepNames:
    """A name pattern with exactly one ``{step}``; formats a step and parses a directory name back."""

    def __init__(self, pattern: str, root: str) -> None:
        if not isinstance(pattern, str) or pattern.count("{step}") != 1:
            raise InvalidOptionError(f"name must contain '{{step}}' exactly once, got {pattern!r}", root)
        before, after = pattern.split("{step}")
        if not is_component(before + "0" + after) or pattern.startswith("."):
            raise InvalidOptionError(
                f"name must make one visible file name (no '/', not starting with '.'), got {pattern!r}", root
            )
        self.pattern = pattern
        self._regex = re.compile(re.escape(before) + r"(0|[1-9][0-9]{0,17})" + re.escape(after))

    def format(self, step: int) -> str:
        return self.pattern.replace("{step}", str(step))

    def parse(self, name: str) -> int | None:
        match = self._regex.fullmatch(name)
        return int(match[1]) if match else None


def check_step(step: object, root: str) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**18:
        raise InvalidOptionError(f"step must be an int from 0 to 10**18, got {step!r}", root)
    return step
