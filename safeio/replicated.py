"""``safeio.replicated``: the body runs on every rank; only the writer's stage becomes the target."""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from safeio import active
from safeio._settings import resolve_timeout
from safeio.channel import Channel, Outcome, decode_value, encode_value
from safeio.errors import PromotionError, SafeIOError
from safeio.group import Group, resolve_group
from safeio.locking import LockSetting
from safeio.promote import Mode, Promoter, promoter_for
from safeio.storage import Location, resolve
from safeio.watchdog import Watchdog, resolve_warn_after

logger = logging.getLogger("safeio")


@dataclass
class Stage:
    """Where the body writes. ``path`` is a local directory on every rank.

    A writer's body may set ``result`` (JSON-serialisable: str, numbers, lists, tuples, dicts); after
    the block every rank's ``stage.result`` holds the writer's value.
    """

    path: str
    target: str
    is_writer: bool
    group: Group
    nested: bool = False
    result: Any = None


def attach_cleanup_error(primary: BaseException, cleanup: BaseException) -> None:
    """Keep the first error the one raised, with the cleanup's failure attached to it."""
    if primary.__context__ is None:
        primary.__context__ = cleanup
    if hasattr(primary, "add_note"):
        primary.add_note(f"safeio: cleanup after this error also failed: {cleanup!r}")


# Rust writers (the `tokenizers` library writing tokenizer.json) raise a bare Exception carrying
# std::io::Error's text, e.g. "No space left on device (os error 28)".
_RUST_IO_ERROR = re.compile(r"\(os error (\d+)\)")


def _io_errno(error: BaseException) -> int | None:
    """The errno of an I/O failure raised by the body (Python OSError or a Rust io::Error), else None."""
    if isinstance(error, SafeIOError):
        return None
    if isinstance(error, OSError):
        return error.errno if error.errno is not None else 0
    # safetensors (model weights) raises its own SafetensorError with the same io::Error text: without
    # it, a full disk while saving a model reached the caller as a bare SafetensorError, no errno.
    rust = type(error) is Exception or type(error).__module__.startswith("safetensors")
    match = _RUST_IO_ERROR.search(str(error)) if rust else None
    return int(match.group(1)) if match else None


class ReplicatedSave:
    """Context manager returned by :func:`replicated`."""

    def __init__(
        self,
        target: str | os.PathLike[str],
        *,
        group: Any = None,
        timeout: float | None = None,
        mode: Mode = "replace",
        durable: bool = True,
        lock: LockSetting = "auto",
        manifest: bool = True,
        writer: int | None = None,
        warn_after: float | None = None,
    ) -> None:
        self.location: Location = resolve(target)
        self.timeout = resolve_timeout(timeout)
        self._mode, self._durable, self._lock, self._manifest = mode, durable, lock, manifest
        self._group_arg = group
        self._writer = writer
        self._stage: Stage | None = None
        self._entry: active.ActiveStage | None = None
        self._channel: Channel | None = None
        self._promoter: Promoter | None = None
        self._warn_after = resolve_warn_after(warn_after)
        self._watchdog: Watchdog | None = None

    def __enter__(self) -> Stage:
        target_key = self.location.url()
        nested = active.redirect(self.location.path if self.location.is_local else target_key)
        group = resolve_group(self._group_arg)
        if self._writer is not None:
            group = group.with_writer(self._writer)
        if nested is not None:
            self._stage = Stage(nested, target_key, group.is_writer, group, nested=True)
            return self._stage
        channel = self._channel = Channel.open(group, target_key)
        self._promoter = promoter_for(
            self.location,
            timeout=self.timeout,
            rank=group.rank,
            call_id=channel.call_id,
            on_phase=channel.enter_phase if group.is_writer else None,
            mode=self._mode,
            durable=self._durable,
            lock=self._lock,
            write_manifest=self._manifest,
        )
        if group.is_writer:
            # Before the first phase: an uninterruptible mkdir on a hung mount must be reported too.
            watchdog = self._watchdog = Watchdog(channel, self._warn_after, rank=group.rank).start()
            channel.enter_phase("stage")
            try:
                path = self._promoter.open_stage()
            except BaseException as exc:
                channel.publish(Outcome.failure(target_key, group.rank, exc))
                watchdog.stop()
                raise
            channel.enter_phase("body")
        else:
            # Bodies run on every rank (SPMD); a non-writer's output goes to node-local scratch.
            path = tempfile.mkdtemp(prefix="safeio-peer-")
            if self._manifest:
                self._promoter.seen_at_start = self._promoter.current_call()
        self._entry = active.ActiveStage(self.location.path if self.location.is_local else target_key, path)
        active.push(self._entry)
        self._stage = Stage(path, target_key, group.is_writer, group)
        return self._stage

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        stage = self._stage
        assert stage is not None, "__exit__ without __enter__"
        if stage.nested:
            return
        assert self._entry is not None
        assert self._channel is not None
        assert self._promoter is not None
        try:
            if stage.is_writer:
                self._exit_writer(stage, self._channel, self._promoter, exc)
            else:
                self._exit_peer(stage, self._channel, self._promoter, exc)
        finally:
            # Only now: until the stage is promoted or discarded, recovery must see it as in use.
            active.pop(self._entry)
            if self._watchdog is not None:
                self._watchdog.stop()

    def _exit_writer(
        self, stage: Stage, channel: Channel, promoter: Promoter, exc: BaseException | None
    ) -> None:
        error: BaseException | None = exc
        value = encode_value(stage.result)
        if error is None:
            try:
                promoter.result = value
                promoter.finish(stage.path)
            except BaseException as finish_error:
                error = finish_error
        if error is None:
            channel.publish(Outcome(True, stage.target, stage.group.rank, value=value))
            channel.enter_phase("done")
            return
        try:
            promoter.discard(stage.path)
        except BaseException as cleanup_error:
            attach_cleanup_error(error, cleanup_error)
        mapped: PromotionError | None = None
        if exc is not None:
            io_errno = _io_errno(exc)
            if io_errno is not None:
                # The body's own I/O failed (ENOSPC, EIO...): say which target, keep errno and the cause.
                mapped = PromotionError(
                    f"rank {stage.group.rank}: writing the stage of {stage.target} failed: {exc}",
                    stage.target,
                    errno=io_errno,
                )
                mapped.__cause__ = exc
        # Publish what this rank raises, so peers' RemoteWriterError names the same type (they saw
        # "OSError" while the writer raised PromotionError).
        channel.publish(Outcome.failure(stage.target, stage.group.rank, mapped or error))
        if mapped is not None:
            raise mapped from exc
        if exc is not None:
            return  # the body's exception propagates unchanged
        raise error

    def _exit_peer(
        self, stage: Stage, channel: Channel, promoter: Promoter, exc: BaseException | None
    ) -> None:
        shutil.rmtree(stage.path, ignore_errors=True)
        if exc is not None:
            return  # this rank's own error; the writer never waits for it
        started = time.monotonic()
        outcome = channel.wait(self.timeout, promoter.landed, promoter.recorded_result)
        outcome.raise_if_failed(stage.group.rank)
        stage.result = decode_value(outcome.value)
        # NFS: this rank may be another client whose attribute/dentry cache still shows the old version
        # for a while after the writer promoted. Return only once this save is visible from here.
        channel.wait_visible(promoter.landed, started + self.timeout)


def replicated(
    target: str | os.PathLike[str],
    *,
    group: Any = None,
    timeout: float | None = None,
    mode: Mode = "replace",
    durable: bool = True,
    lock: LockSetting = "auto",
    manifest: bool = True,
    writer: int | None = None,
    warn_after: float | None = None,
) -> ReplicatedSave:
    """Write a replicated directory once, atomically, and tell every rank the outcome.

    The body runs on every rank and writes into ``stage.path``: on the writer (``writer``, default rank
    0 of ``group``) a private stage beside the target, promoted on success by ``mode``; elsewhere a
    throwaway local directory. Non-writers return only once the writer's outcome is known, and raise
    ``RemoteWriterError`` if it failed or ``PeerTimeout`` after ``timeout`` seconds. While the writer
    spends more than ``warn_after`` seconds (default ``SAFEIO_WARN_AFTER``, else 60) in one phase, it
    logs a WARNING with its stack, repeated with backoff; the save itself is never interrupted.
    """
    return ReplicatedSave(
        target,
        group=group,
        timeout=timeout,
        mode=mode,
        durable=durable,
        lock=lock,
        manifest=manifest,
        writer=writer,
        warn_after=warn_after,
    )
