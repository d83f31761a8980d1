"""Collective answers about a root (``latest()``, ``at()``, ``steps()``): the writer resolves, every rank
hears its answer (or its error) through the store, and returns once what it names is visible from it.

Ranks whose NFS caches disagree still get one answer; a value heard from the store is input (TCPStore
has no authentication): an answer that is not a list of this root's steps is refused, never followed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from safeio._checkpoints.steps import StepNames, StepStorage
from safeio._coordination.calls import MalformedValue, Progress, StoreGone, poll_until, text
from safeio._coordination.checkpoint_call import CheckpointCall
from safeio._coordination.checkpoint_status import DONE, OUTCOME, RESOLVE, advice
from safeio._coordination.group import Group
from safeio._diagnostics.watchdog import Watchdog
from safeio._errors import InvalidTargetError, PeerTimeout, RemoteWriterError
from safeio._options import SaveOptions
from safeio._stalls import Cadence, seconds
from safeio._who import who

logger = logging.getLogger("safeio")


class Agreement:
    """The collective reads of one root's steps, on the group ``group()`` gives."""

    def __init__(
        self, steps: StepStorage, names: StepNames, options: SaveOptions, group: Callable[[], Group]
    ) -> None:
        self._steps = steps
        self.names = names
        self.options = options
        self.root = steps.root_url
        self.group = group

    def agree(
        self,
        what: str,
        resolve_here: Callable[[], list[tuple[int, str]]],
        *,
        visible: Callable[[str], bool] | None = None,
    ) -> list[tuple[int, str]]:
        """The writer resolves, every rank gets its answer (or its error), visible from each (by
        ``visible``; default: committed)."""
        group = self.group()
        phase = RESOLVE if group.is_writer else OUTCOME
        call = CheckpointCall.enter(group, self.root, what, phase=phase, warn_after=self.options.warn_after)
        try:
            return self._answer(call, group, what, resolve_here, visible)
        finally:
            call.status.enter(DONE)

    def _answer(
        self,
        call: CheckpointCall,
        group: Group,
        what: str,
        resolve_here: Callable[[], list[tuple[int, str]]],
        visible: Callable[[str], bool] | None,
    ) -> list[tuple[int, str]]:
        deadline = time.monotonic() + self.options.timeout
        if group.is_writer:
            # Reading the root can hang on a mount that does not answer: the writer says so itself.
            with Watchdog(
                call.status, self.options.warn_after, rank=group.rank, role="this rank", advice=advice
            ):
                try:
                    found = [(int(s), str(n)) for s, n in resolve_here()]
                except InvalidTargetError as exc:
                    call.decide({"ok": False, "error": str(exc), "path": exc.path})
                    raise
                except BaseException as exc:  # every rank hears that there is no answer
                    call.decide({"ok": False, "error": f"{type(exc).__name__}: {exc}", "path": self.root})
                    raise
            call.decide({"ok": True, "found": found})
        elif call.shared:
            try:
                found = self._heard(call.hear_outcome(deadline), group, what)
            except StoreGone:
                # Rank 0, the store's host, answered and finished (the end of a run): the filesystem
                # is all that is left to ask.
                found = [(int(s), str(n)) for s, n in resolve_here()]
            except MalformedValue as exc:
                raise self._malformed_answer(group, what, str(exc)) from None
        else:
            found = [(int(s), str(n)) for s, n in resolve_here()]
        for _, entry in found:
            self.wait_visible(entry, deadline, group.rank, what, stage=False, visible=visible)
        return found

    def _heard(self, heard: dict[str, Any], group: Group, what: str) -> list[tuple[int, str]]:
        """The writer's answer to ``what``, or the error it answered with."""
        if not heard.get("ok"):
            path = heard.get("path")
            raise InvalidTargetError(text(heard.get("error")), path if isinstance(path, str) else self.root)
        answer = self._heard_steps(heard.get("found"))
        if answer is None:
            raise self._malformed_answer(group, what, f"not a list of committed steps: {text(heard)}")
        return answer

    def _heard_steps(self, found: object) -> list[tuple[int, str]] | None:
        """The writer's answer (input): (step, name) pairs where each name is that step's directory
        name; None when it is not (a name heard is joined to the root: never a path elsewhere)."""
        if not isinstance(found, list) or len(found) > 10**6:
            return None
        steps: list[tuple[int, str]] = []
        for entry in found:
            if not (isinstance(entry, list) and len(entry) == 2):
                return None
            step, name = entry
            if isinstance(step, bool) or not isinstance(step, int) or not isinstance(name, str):
                return None
            if self.names.parse(name) != step:
                return None
            steps.append((step, name))
        return steps

    def _malformed_answer(self, group: Group, what: str, problem: str) -> RemoteWriterError:
        return RemoteWriterError(
            f"rank {group.rank}: the answer of rank {group.writer} to {what} of {self.root} in the store is "
            f"malformed ({problem}); a value in the job's store is input (TCPStore has no authentication)",
            self.root,
            writer_rank=group.writer,
            error_type="MalformedValue",
            error_message=problem,
        )

    def wait_visible(
        self,
        name: str,
        deadline: float,
        rank: int,
        what: str,
        *,
        stage: bool,
        visible: Callable[[str], bool] | None = None,
    ) -> None:
        """Return once step (or stage) ``name`` is visible from this rank; bounded. NFS clients cache
        directory entries and attributes: a rank on another client may not see it for a while after
        the writer made it."""
        path = self._steps.url(name)
        if visible is None:
            visible = self._steps.stage_visible if stage else self._steps.step_visible
        cadence = Cadence(self.options.warn_after)

        def still_waiting(elapsed: float) -> None:
            logger.warning(
                "%s: still waiting after %s s to see %s at %s from this rank: the writer made it, and a "
                "network filesystem's client cache shows it late (NFS: the mount's attribute and lookup "
                "caches)",
                who(rank),
                seconds(elapsed),
                what,
                path,
            )

        poll_until(
            lambda: visible(name),
            deadline,
            expired=lambda: PeerTimeout(
                f"rank {rank}: {what} at {path} is still not visible from this rank after "
                f"{cadence.elapsed():.0f} s",
                path,
                phase="visibility",
                elapsed=cadence.elapsed(),
            ),
            progress=Progress(cadence, still_waiting),
        )
