"""The replicated flow: the body runs on every rank; only the writer's stage becomes the target.

On the writer: open the stage (a watchdog watching every phase), run the body, promote or discard, and
*publish* the outcome; the writer never waits for its peers, so code that already guards its save with
"rank 0 only" cannot hang. Elsewhere: the body writes into node-local scratch, then the rank waits
(bounded) for the writer's outcome and for the new version to be visible from it. The same flow serves
directories (``safeio.replicated``, ``save_pretrained``) and single files (``safeio.torch_save``): only
the promotion and the visibility check differ.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import stat
import tempfile
import time
from dataclasses import dataclass
from types import TracebackType
from typing import IO, Any, Literal, Protocol

from safeio._boundary import attach_cleanup_error, body_failure
from safeio._coordination.channel import Channel
from safeio._coordination.group import Group, resolve_group
from safeio._coordination.save_outcome import Outcome, decode_value, encode_value
from safeio._diagnostics.watchdog import Watchdog
from safeio._errors import UnsupportedSaveError
from safeio._options import LockSetting, Mode, SaveOptions
from safeio._promotion import active
from safeio._promotion.atomic_file import FilePromotion
from safeio._promotion.backends import backend_for
from safeio._promotion.base import Promoted
from safeio._saves.identity import save_identity
from safeio._saves.visibility import DirectoryVisibility, FileVisibility
from safeio._storage.dirfd import held_directory, walk_files
from safeio._storage.fsops import discard_tree
from safeio._who import who

logger = logging.getLogger("safeio")

Kind = Literal["directory", "file"]


@dataclass
class Stage:
    """Where the body writes. ``path`` is a local directory on every rank that runs the body (empty on
    a non-writer of a save only the writer makes, such as a tokenizer's ``save_pretrained``).

    A writer's body may set ``result`` (JSON-serialisable: str, numbers, lists, tuples, dicts); after
    the block every rank's ``stage.result`` holds the writer's value.
    """

    path: str
    target: str
    is_writer: bool
    group: Group
    nested: bool = False
    result: Any = None


class _Promoting(Protocol):
    def open_stage(self) -> str: ...
    def finish(self, stage: str, *, result: Any = None) -> Promoted: ...
    def discard(self, stage: str) -> None: ...


class _Visibility(Protocol):
    def landed(self) -> bool: ...
    def result(self) -> Any: ...


class ReplicatedSave:
    """Context manager returned by :func:`replicated` (``kind="file"``: ``stage.path`` is a file)."""

    def __init__(
        self,
        target: str | os.PathLike[str],
        options: SaveOptions,
        *,
        group: Any = None,
        kind: Kind = "directory",
        what: str | None = None,
        peer_body: bool = True,
    ) -> None:
        self.backend = backend_for(target)
        self.location = self.backend.location
        # Whether non-writers run the body too (SPMD). When only the writer does (a tokenizer's
        # save_pretrained), a peer makes no scratch directory: it only waits.
        self.peer_body = peer_body
        self.options = options
        self.kind = kind
        self.what = what  # the type of the object saved, when there is one (part of the save's identity)
        self._group_arg = group
        self._stage: Stage | None = None
        self._entry: active.ActiveStage | None = None
        self._channel: Channel | None = None
        self._watchdog: Watchdog | None = None

    @property
    def timeout(self) -> float:
        return self.options.timeout

    def __enter__(self) -> Stage:
        location = self.location
        target_key = location.url()  # a local target's absolute path, or its URL
        nested = active.redirect(target_key)
        group = resolve_group(self._group_arg)
        if self.options.writer is not None:
            group = group.with_writer(self.options.writer)
        if nested is not None:
            # A directory (or a file's directory) inside the open stage: made, as the stage itself is.
            os.makedirs(nested if self.kind == "directory" else os.path.dirname(nested), exist_ok=True)
            self._stage = Stage(nested, target_key, group.is_writer, group, nested=True)
            return self._stage
        channel = self._channel = Channel.open(group, target_key, save_identity(self.what))
        if group.is_writer:
            path = self._enter_writer(channel, group)
        else:
            if self.peer_body:
                # Bodies run on every rank (SPMD); a non-writer's output goes to node-local scratch.
                scratch = tempfile.mkdtemp(prefix="safeio-peer-")
                path = scratch if self.kind == "directory" else os.path.join(scratch, location.name or "data")
            else:
                path = ""  # no body runs here: nothing to write, no scratch to make
            self._visibility = self._make_visibility(channel)
        if path:  # a peer that runs no body has no stage for nested saves to write into
            self._entry = active.ActiveStage(target_key, path)
            active.push(self._entry)
        self._stage = Stage(path, target_key, group.is_writer, group)
        return self._stage

    def open_file(self) -> IO[bytes]:
        """For ``kind="file"`` on the writer: the staged file, open for binary writing."""
        promotion = self._promotion
        if not isinstance(promotion, FilePromotion):
            raise UnsupportedSaveError("open_file() is for the writer of a file save", self.location.url())
        file: IO[bytes] = promotion.open_file("wb")
        return file

    def _make_promotion(self, channel: Channel, group: Group) -> _Promoting:
        if self.kind == "file":
            return self.backend.file_promotion(
                exclusive=False, durable=self.options.durable, on_phase=channel.enter_phase
            )
        return self.backend.promotion(
            self.options,
            rank=group.rank,
            call_id=channel.call_id,
            on_phase=channel.enter_phase,
            check_files=functools.partial(refuse_sharded_state, target=self.location.url()),
        )

    def _make_visibility(self, channel: Channel) -> _Visibility:
        reader = self.backend.reader()
        if self.kind == "file":
            return FileVisibility(reader)
        return DirectoryVisibility(reader, call_id=channel.call_id, manifest=self.options.manifest)

    def _enter_writer(self, channel: Channel, group: Group) -> str:
        # Before the first phase: an uninterruptible mkdir on a hung mount must be reported too.
        watchdog = self._watchdog = Watchdog(channel, self.options.warn_after, rank=group.rank).start()
        channel.enter_phase("stage")
        try:
            self._promotion = self._make_promotion(channel, group)
            path = self._promotion.open_stage()
        except BaseException as exc:
            channel.publish(Outcome.failure(self.location.url(), group.rank, exc))
            watchdog.stop()
            raise
        channel.enter_phase("body")
        return path

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        stage = self._stage
        assert stage is not None, "__exit__ without __enter__"
        if stage.nested:
            return
        assert self._channel is not None
        try:
            if stage.is_writer:
                self._exit_writer(stage, self._channel, exc)
            else:
                self._exit_peer(stage, self._channel, exc)
        finally:
            # Saves nested in the body wrote into the stage; it is promoted or discarded by now.
            if self._entry is not None:
                active.pop(self._entry)
            if self._watchdog is not None:
                self._watchdog.stop()

    def _exit_writer(self, stage: Stage, channel: Channel, exc: BaseException | None) -> None:
        promotion = self._promotion
        error: BaseException | None = exc
        value = encode_value(stage.result)
        promoted = Promoted()
        if error is None:
            try:
                promoted = promotion.finish(stage.path, result=value)
            except BaseException as finish_error:
                error = finish_error
        if error is None:
            # Directories on local filesystems only: see Outcome.version.
            outcome = Outcome(
                True,
                stage.target,
                stage.group.rank,
                value=value,
                version=promoted.version,
                replaced=promoted.replaced,
            )
            channel.publish(outcome)
            channel.enter_phase("done")
            return
        try:
            promotion.discard(stage.path)
        except BaseException as cleanup_error:
            attach_cleanup_error(error, cleanup_error)
        # The body's own I/O failure (ENOSPC, EIO...) names the target and keeps errno and cause.
        mapped = body_failure(exc, stage.target, stage.group.rank) if exc is not None else None
        # Publish what this rank raises, so peers' RemoteWriterError names the same type.
        channel.publish(Outcome.failure(stage.target, stage.group.rank, mapped or error))
        if mapped is not None:
            raise mapped from exc
        if exc is not None:
            return  # the body's exception propagates unchanged
        raise error

    def _exit_peer(self, stage: Stage, channel: Channel, exc: BaseException | None) -> None:
        own: dict[str, int] = {}
        if stage.path:
            scratch = stage.path if self.kind == "directory" else os.path.dirname(stage.path)
            own = scratch_files(scratch) if self.kind == "directory" and exc is None else {}
            discard_tree(scratch)
        if exc is not None:
            return  # this rank's own error; the writer never waits for it
        started = time.monotonic()
        visibility = self._visibility
        outcome = channel.wait(
            self.timeout, visibility.landed, visibility.result, warn_after=self.options.warn_after
        )
        outcome.raise_if_failed(stage.group.rank)
        stage.result = decode_value(outcome.value)
        # NFS: this rank may be another client whose attribute/dentry cache still shows the old version
        # for a while after the writer promoted. Return only once this save is visible from here: one stat
        # of the manifest the writer named, unless this rank must compare its own files with it.
        landed = visibility.landed
        if outcome.version is not None and isinstance(visibility, DirectoryVisibility):
            landed = functools.partial(
                visibility.shows_version, outcome.version, outcome.replaced, read=bool(own)
            )
        channel.wait_visible(landed, started + self.timeout)
        if own and isinstance(visibility, DirectoryVisibility):
            check_against_landed(own, visibility.landed_files(), stage)


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
    Every option is checked here, before any body runs.
    """
    options = SaveOptions.of(
        mode=mode,
        durable=durable,
        lock=lock,
        manifest=manifest,
        timeout=timeout,
        writer=writer,
        warn_after=warn_after,
    )
    return ReplicatedSave(target, options, group=group)


def scratch_files(scratch: str) -> dict[str, int]:
    """What this peer's own body wrote (SPMD bodies write on every rank): relative name -> size."""
    found: dict[str, int] = {}
    with contextlib.suppress(OSError), held_directory(scratch, follow=True) as scratch_fd:
        for rel_dir, fd, name, st in walk_files(scratch_fd):
            if stat.S_ISLNK(st.st_mode) and _links_to_directory(fd, name):
                continue  # a directory, for the body
            found[f"{rel_dir}/{name}" if rel_dir else name] = st.st_size
    return found


def _links_to_directory(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


_DCP_SHARD = re.compile(r"__[0-9]+_[0-9]+\.distcp")


def refuse_sharded_state(files: list[str], target: str) -> None:
    """torch.distributed.checkpoint shards in a replicated stage (``files``: its relative names): every
    other rank's are about to be dropped (their stages are throwaway scratch), so the save is refused on
    the writer, and its peers hear the refusal, rather than promoting one rank's share of the state."""
    shards = sorted(name for name in (f.rpartition("/")[2] for f in files) if _DCP_SHARD.fullmatch(name))
    if shards:
        raise UnsupportedSaveError(
            f"{target}: the save holds torch.distributed.checkpoint shards ({shards[0]}); inside "
            "replicated() only the writer's files are kept and every other rank's shards would be "
            "dropped. Save sharded state with safeio.Checkpoints (dcp.save on every rank into "
            "ckpt.path)",
            target,
        )


def check_against_landed(own: dict[str, int], landed: dict[str, int] | None, stage: Stage) -> None:
    """Files this rank wrote that the writer did not are sharded data about to be dropped: an error.
    The same files at other sizes are a "replicated" object that differs between ranks: a WARNING."""
    if landed is None:
        return  # no manifest to compare with (manifest=False)
    dropped = sorted(rel for rel in own if rel not in landed)
    if dropped:
        raise UnsupportedSaveError(
            f"{who(stage.group.rank)}: this rank's body wrote {', '.join(dropped[:5])}"
            f"{f' and {len(dropped) - 5} more' if len(dropped) > 5 else ''}, which the writer's save of "
            f"{stage.target} does not contain: only the writer's files are kept, so this rank's would be "
            "lost. Per-rank (sharded) data belongs in safeio.Checkpoints",
            stage.target,
        )
    differ = sorted(rel for rel, size in own.items() if landed.get(rel) != size)
    if differ:
        logger.warning(
            "%s: this rank's save of %s would have written %s differently from the writer's (missing there "
            "or another size): the object saved is not the same on every rank; the writer's version is "
            "the one saved",
            who(stage.group.rank),
            stage.target,
            ", ".join(differ[:10]) + (f" and {len(differ) - 10} more" if len(differ) > 10 else ""),
        )
