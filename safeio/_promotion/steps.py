"""The steps of a ``safeio.Checkpoints`` root: their names, their pointer files, and what every kind of
place holding them shares (``StepStorage``). One subclass per storage behaviour, made by the root's back
end: ``LocalSteps`` (a stage directory and a rename, ``step_directories``) and ``ObjectSteps`` (in place
under the step's prefix, committed by its marker, ``step_prefixes``). A commit is a promotion of the
step's stage through ``Promotion.finish``, like any directory save; the checkpoint layer above says who
commits and when.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable

from safeio._errors import InvalidOptionError
from safeio._options import SaveOptions
from safeio._promotion.base import Promotion
from safeio._storage.dirfd import is_component

LATEST = "latest"  # DeepSpeed's pointer file: the name of the newest checkpoint directory
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's: the newest iteration number


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


class StepPromotion(Promotion):
    """The commit of one step: ``open_stage`` on the writer before the body, ``finish`` once every rank
    reported, ``discard`` when one failed. ``stage_name`` is what every rank writes under."""

    stage_name: str


class StepStorage(ABC):
    """The steps of one checkpoint root, as one kind of place holds them."""

    in_place_replicated: bool  # whether the writer's replicated files go straight into the stage
    root_url: str

    def __init__(
        self,
        names: StepNames,
        options: SaveOptions,
        *,
        keep: int | None,
        megatron_tracker: bool,
    ) -> None:
        self.names = names
        self.options = options
        self.keep = keep
        self.megatron_tracker = megatron_tracker

    def retired(self, committed: list[tuple[int, str]], protected: Iterable[str]) -> list[str]:
        """The committed steps retention removes: all but the newest ``keep`` (never the newest: keep
        >= 1), and never a ``protected`` one (step names: a Trainer's best model)."""
        if self.keep is None or len(committed) <= self.keep:
            return []
        kept = frozenset(protected)
        return [name for _, name in committed[: -self.keep] if name not in kept]

    @abstractmethod
    def url(self, name: str) -> str:
        """Where step (or stage) ``name`` is, as the user names it."""

    @abstractmethod
    def committed(self) -> list[tuple[int, str]]:
        """(step, name) of every committed checkpoint, as this process sees the root (ascending)."""

    @abstractmethod
    def promotion(self, step: int, *, rank: int, protect: Iterable[str] = ()) -> StepPromotion:
        """The writer: the commit of ``step`` (its stage is made by ``open_stage``); retention after it
        never removes a step named in ``protect``."""

    @abstractmethod
    def stage_visible(self, stage_name: str) -> bool:
        """Whether this process sees the stage the writer made (an NFS client may not yet)."""

    @abstractmethod
    def step_visible(self, name: str) -> bool:
        """Whether this process sees step ``name`` committed."""
