"""The commit of an async checkpoint (``dcp.async_save``): run once the save's future completes.

``ckpt.commit_after(future)`` hands the end of the save to a background thread: it waits for this
rank's future (bounded by the timeout), then reports, and on the writer collects every rank's report and
commits — never at dispatch, so ``latest`` and retention move only once every rank's shards are
written. A job that ends without ``ckpts.wait()`` still commits (or fails) before the process exits: the
exit waits for the thread, bounded as ``wait()`` is (``safeio._threads``), never for ever. ``wait()``
joins it, bounded, and raises what it raised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from safeio._errors import InvalidOptionError, PeerTimeout
from safeio._threads import start_background


def check_future(future: Any) -> None:
    """Refuse, before anything is deferred, what ``wait_for_future`` could not wait for."""
    inner = getattr(future, "upload_completion", future)
    if not (hasattr(inner, "result") and hasattr(inner, "done")) and not hasattr(inner, "wait"):
        raise InvalidOptionError(
            f"commit_after() needs a future (dcp.async_save's result), got {type(future)!r}", None
        )


def wait_for_future(future: Any, timeout: float) -> None:
    """Wait for a ``concurrent.futures.Future``, a DCP ``AsyncSaveResponse`` (its upload) or a
    ``torch.futures.Future``; raise what the save raised."""
    upload = getattr(future, "upload_completion", None)
    if upload is not None:
        future = upload
    if hasattr(future, "result") and hasattr(future, "done"):
        future.result(timeout=timeout)  # concurrent.futures: TimeoutError when it takes too long
    elif hasattr(future, "wait"):
        future.wait()  # torch.futures.Future has no timeout of its own
    else:
        raise InvalidOptionError(
            f"commit_after() needs a future (dcp.async_save's result), got {type(future)!r}", None
        )


class PendingCommit:
    """One async save's end (report, commit, outcome), running on its own thread."""

    def __init__(
        self, future: Any, finish: Callable[[BaseException | None], None], timeout: float, what: str
    ) -> None:
        self.timeout = timeout
        self.what = what
        self.error: BaseException | None = None
        self._thread = start_background(
            lambda: self._run(future, finish), name=f"safeio-commit {what}", bound=self.bound
        )

    def _run(self, future: Any, finish: Callable[[BaseException | None], None]) -> None:
        own: BaseException | None = None
        try:
            wait_for_future(future, self.timeout)
        except BaseException as exc:  # this rank's part failed: reported, so every rank hears of it
            own = exc
        try:
            finish(own)
        except BaseException as exc:
            self.error = exc
            return
        self.error = own

    @property
    def bound(self) -> float:
        # The thread's own waits are bounded: the future (timeout), the reports (timeout), the outcome
        # (twice the timeout); this is their sum and a margin.
        return 4 * self.timeout + 60

    def wait(self) -> None:
        self._thread.join(self.bound)
        if self._thread.is_alive():
            raise PeerTimeout(f"the commit of {self.what} did not finish within the timeout", self.what)
        if self.error is not None:
            raise self.error
