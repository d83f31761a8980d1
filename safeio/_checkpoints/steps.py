"""What every kind of place holding a ``Checkpoints`` root shares: its settings, the names of its pointer
files, and which committed steps retention retires. One subclass per storage behaviour:
``LocalSteps`` (a stage directory and a rename) and ``ObjectSteps`` (in place, committed by its marker).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from safeio._checkpoints.naming import StepNames
from safeio._options import SaveOptions

LATEST = "latest"  # DeepSpeed's pointer file: the name of the newest checkpoint directory
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's: the newest iteration number


class StepStorage(ABC):
    """The steps of one checkpoint root. The writer opens a stage, commits it or abandons it; every rank
    waits (bounded) until a stage or a committed step is visible from it."""

    in_place_replicated: bool  # whether the writer's replicated files go straight into the stage
    root_url: str

    def __init__(
        self, names: StepNames, options: SaveOptions, keep: int | None, megatron_tracker: bool
    ) -> None:
        self.names = names
        self.options = options
        self.keep = keep
        self.megatron_tracker = megatron_tracker
        self.protected: set[str] = set()  # step names retention never removes (a Trainer's best model)

    def retired(self, committed: list[tuple[int, str]]) -> list[str]:
        """The committed steps retention removes: all but the newest ``keep`` (never the newest: keep
        >= 1), and never a protected one."""
        if self.keep is None or len(committed) <= self.keep:
            return []
        return [name for _, name in committed[: -self.keep] if name not in self.protected]

    @abstractmethod
    def url(self, name: str) -> str: ...

    @abstractmethod
    def committed(self) -> list[tuple[int, str]]:
        """(step, name) of every committed checkpoint, as this process sees the root (ascending)."""

    @abstractmethod
    def open_stage(self, step: int, final_name: str) -> str:
        """The writer: make the stage of ``step``; its name."""

    @abstractmethod
    def commit(self, stage_name: str, final_name: str, step: int, rank: int, replicated: str | None) -> None:
        """The writer: the marker, the step under its final name, ``latest``, then retention."""

    @abstractmethod
    def abandon(self, stage_name: str) -> None:
        """The writer: nothing is committed; the stage goes (best effort)."""

    @abstractmethod
    def wait_stage(self, stage_name: str, deadline: float, rank: int, what: str) -> None: ...

    @abstractmethod
    def wait_committed(self, name: str, deadline: float, rank: int, what: str) -> None: ...
