"""The commit of an async checkpoint (``dcp.async_save``): run once the save's future completes.

``ckpt.commit_after(future)`` hands the end of the save to a background thread: it waits for this
rank's future (bounded by the timeout: ``wait_for_future``), then reports, and on the writer collects
every rank's report and commits — never at dispatch, so ``latest`` and retention move only once every
rank's shards are written. A job that ends without ``ckpts.wait()`` still commits (or fails, with a
WARNING) before the process exits: the exit waits for the thread, bounded as ``wait()`` is
(``safeio._threads``), never for ever. ``wait()`` joins it, bounded, and raises what it raised.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from safeio._coordination.calls import poll_until
from safeio._coordination.checkpoint_status import ASYNC_SAVE, advice
from safeio._diagnostics.watchdog import PhaseSource
from safeio._errors import InvalidOptionError, PeerTimeout
from safeio._stalls import Cadence, seconds
from safeio._threads import start_background
from safeio._who import who

logger = logging.getLogger("safeio")


def check_future(future: Any) -> None:
    """Refuse, before anything is deferred, what ``wait_for_future`` could not wait for."""
    inner = getattr(future, "upload_completion", future)
    if not (hasattr(inner, "result") and hasattr(inner, "done")) and not hasattr(inner, "wait"):
        raise InvalidOptionError(
            f"commit_after() needs a future (dcp.async_save's result), got {type(future)!r}", None
        )


def wait_for_future(future: Any, timeout: float, what: str) -> None:
    """Wait for a ``concurrent.futures.Future``, a DCP ``AsyncSaveResponse`` (its upload) or a
    ``torch.futures.Future``, at most ``timeout`` seconds (then a PeerTimeout in phase "async save");
    raise what the save raised."""
    upload = getattr(future, "upload_completion", None)
    if upload is not None:
        future = upload

    def expired() -> PeerTimeout:
        return PeerTimeout(
            f"{who()}: this rank's async save of {what} (the future given to commit_after) did not finish "
            f"within the timeout ({timeout:g} s): {advice(ASYNC_SAVE)}",
            what,
            phase=ASYNC_SAVE,
            elapsed=timeout,
        )

    if hasattr(future, "result") and hasattr(future, "done"):
        try:
            future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            if not future.done():
                raise expired() from None
            raise
    elif hasattr(future, "wait") and hasattr(future, "done"):
        # torch.futures.Future has no timeout of its own: bounded by polling done(), then wait() raises
        # what the save raised.
        poll_until(future.done, time.monotonic() + timeout, expired=expired)
        future.wait()
    elif hasattr(future, "wait"):
        future.wait()
    else:
        raise InvalidOptionError(
            f"commit_after() needs a future (dcp.async_save's result), got {type(future)!r}", None
        )


class PendingCommit:
    """One async save's end (``run``: wait for the future, report, commit, hear the outcome), running on
    its own thread. ``status`` is that rank's place in the save's call (its phase), told by ``wait()``
    and at exit while they wait for it."""

    def __init__(
        self,
        run: Callable[[], None],
        timeout: float,
        what: str,
        *,
        status: PhaseSource | None = None,
        warn_after: float = math.inf,
    ) -> None:
        self.timeout = timeout
        self.what = what
        self.status = status
        self.warn_after = warn_after
        self.error: BaseException | None = None
        self._thread = start_background(
            lambda: self._run(run),
            name=f"safeio-commit {what}",
            bound=self.bound,
            describe=self.describe,
            warn_after=warn_after,
        )

    def describe(self) -> str:
        """Where the commit's thread is, for a line of whoever waits for it."""
        if self.status is None:
            return f"the commit of the async save of {self.what}"
        return (
            f"the commit of the async save of {self.what} is in {self.status.phase} for "
            f"{time.time() - self.status.phase_since:.0f} s"
        )

    def _run(self, run: Callable[[], None]) -> None:
        try:
            run()
        except BaseException as exc:
            self.error = exc
            # Said now: a job that ends without ckpts.wait() would otherwise never hear of it.
            logger.warning("%s: the commit of the async save of %s failed: %s", who(), self.what, exc)

    @property
    def bound(self) -> float:
        # The thread's own waits are bounded: the future (timeout), the reports (timeout), the outcome
        # (twice the timeout); this is their sum and a margin.
        return 4 * self.timeout + 60

    def wait(self) -> None:
        """Join the commit's thread, bounded; raise what it raised. While it lasts, a WARNING on the
        stall cadence says where the commit is (its own thread warns with its stack)."""
        cadence = Cadence(self.warn_after)
        while self._thread.is_alive() and cadence.elapsed() < self.bound:
            self._thread.join(min(cadence.due_in(), self.bound - cadence.elapsed()))
            elapsed = cadence.take() if self._thread.is_alive() else None
            if elapsed is not None:
                logger.warning(
                    "%s: still waiting after %s s for %s", who(), seconds(elapsed), self.describe()
                )
        if self._thread.is_alive():
            phase = self.status.phase if self.status is not None else None
            raise PeerTimeout(
                f"{who()}: the commit of {self.what} did not finish within its bound "
                f"({self.bound:g} s): {self.describe()}",
                self.what,
                phase=phase,
                elapsed=cadence.elapsed(),
            )
        if self.error is not None:
            raise self.error
