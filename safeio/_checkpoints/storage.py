"""Which step storage a ``Checkpoints`` root gets, by its back end: registered here, in the checkpoint
layer, because the back ends (``safeio._promotion.backends``) sit below it and know nothing of steps.

| back end | steps |
| --- | --- |
| ``PosixBackend`` | ``LocalSteps``: a stage directory beside the step, one rename (``step_directories``) |
| ``ObjectStoreBackend`` | ``ObjectSteps``: in place under the step's prefix, a marker (``step_prefixes``) |

A back end that refines another (a test's marker-directory back end refines ``ObjectStoreBackend``) gets
its parent's steps unless it registers its own with ``register_steps``.
"""

from __future__ import annotations

from typing import Protocol

from safeio._checkpoints.step_directories import LocalSteps
from safeio._checkpoints.step_prefixes import ObjectSteps
from safeio._checkpoints.steps import StepNames, StepStorage
from safeio._options import SaveOptions
from safeio._promotion.backends import Backend, ObjectStoreBackend, PosixBackend
from safeio._storage.location import Location


class StepsKind(Protocol):
    """A ``StepStorage`` subclass, made for a root at ``location``."""

    def __call__(
        self,
        location: Location,
        names: StepNames,
        options: SaveOptions,
        *,
        keep: int | None,
        megatron_tracker: bool,
        pointer: bool,
    ) -> StepStorage: ...


_STEPS: dict[type[Backend], StepsKind] = {}


def register_steps(backend: type[Backend], steps: StepsKind) -> None:
    """The steps of a root whose back end is ``backend`` (or a subclass registering none) are ``steps``."""
    _STEPS[backend] = steps


register_steps(PosixBackend, LocalSteps)
register_steps(ObjectStoreBackend, ObjectSteps)


def steps_for(
    backend: Backend,
    names: StepNames,
    options: SaveOptions,
    *,
    keep: int | None,
    megatron_tracker: bool = False,
    pointer: bool = True,
) -> StepStorage:
    """The steps of the ``Checkpoints`` root at ``backend``'s location."""
    kind = next((_STEPS[k] for k in type(backend).__mro__ if k in _STEPS), None)
    if kind is None:
        raise TypeError(f"no step storage is registered for {type(backend).__name__} (see register_steps)")
    return kind(
        backend.location, names, options, keep=keep, megatron_tracker=megatron_tracker, pointer=pointer
    )
