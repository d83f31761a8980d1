"""The ranks other than the writer in a checkpoint save: join the stage the writer announced, report,
sync a share of the stage's files when asked, hear the outcome, and return once the step is visible.

What a rank hears from the store is input (TCPStore has no authentication): a stage name that is not one
safeio gives, or an outcome that is malformed, is refused with a ``CheckpointError`` naming the writer,
never followed. A rank that waited its whole timeout agrees with the writer, through the call's verdict,
what it may assume (``gave_up``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from safeio._checkpoints.outcome import failure, note_warnings, outcome_problem
from safeio._coordination.calls import MalformedValue, StoreGone, text
from safeio._coordination.checkpoint_call import CheckpointCall
from safeio._coordination.checkpoint_shares import hear_fsync_share, report_sync_failed, report_synced
from safeio._coordination.checkpoint_status import FSYNC, OUTCOME
from safeio._errors import CheckpointError, PeerTimeout
from safeio._storage.dirfd import fsync_files, held_directory, is_relative_name

if TYPE_CHECKING:
    from safeio._checkpoints.save import CheckpointSave

logger = logging.getLogger("safeio")


def join_stage(save: CheckpointSave, call: CheckpointCall, deadline: float) -> None:
    """A rank other than the writer: the stage the writer announced, checked, once visible here."""
    group, steps = save.group, save.ckpts._steps
    try:
        heard = call.hear_announcement(deadline)
    except MalformedValue as exc:
        raise CheckpointError(
            f"rank {group.rank}: the announcement of rank {group.writer} for step {save.step} under "
            f"{save.ckpts.root} in the store is malformed ({exc}); step {save.step} is not committed "
            f"(this rank tells rank {group.writer}, which abandons it)",
            save.final,
            failed={group.writer: "a malformed announcement"},
        ) from None
    if not (isinstance(heard, dict) and heard.get("ok") is True and isinstance(heard.get("stage"), str)):
        error = text(heard.get("error")) if isinstance(heard, dict) else f"no stage: {text(heard)}"
        raise CheckpointError(
            f"rank {group.rank}: rank {group.writer} could not open the stage of step {save.step} "
            f"under {save.ckpts.root}: {error}",
            save.final,
            failed={group.writer: error},
        )
    save.stage_name = heard["stage"]
    save._syncs = heard.get("sync") is True
    if not steps.is_stage_of(save.stage_name, save.step):
        # Joined to the root, an absolute or dotted name would send this rank's shards elsewhere.
        raise CheckpointError(
            f"rank {group.rank}: the stage name heard from rank {group.writer} for step {save.step} "
            f"under {save.ckpts.root} is not one safeio gives: {text(save.stage_name)}",
            save.final,
            failed={group.writer: "an invalid stage name"},
        )
    try:
        what = f"the stage of step {save.step}"
        save.ckpts._agreement.wait_visible(save.stage_name, deadline, group.rank, what, stage=True)
    except PeerTimeout:
        decided = call.outcome_if_decided()  # the writer failed and removed it already?
        if decided is None or decided.get("ok"):
            raise
        raise failure(decided, group.rank, save.step, save.final) from None


def exit_peer(save: CheckpointSave, exc: BaseException | None) -> None:
    error = None if exc is None else f"{type(exc).__name__}: {exc}"
    save.call.report({"ok": exc is None, "error": error})
    if exc is not None:
        return  # this rank's own error propagates; the writer names it to the others
    # The writer may itself wait up to the timeout for the slowest rank's report before it decides.
    deadline = time.monotonic() + 2 * save.timeout
    rank, what = save.group.rank, f"step {save.step}"
    status = save.call.status
    try:
        if save._syncs:
            status.enter(FSYNC)
            sync_share(save, deadline)
        status.enter(OUTCOME)
        outcome = save.call.hear_outcome(deadline, outcome_problem)
    except StoreGone as gone:
        # The writer decided and its process (the store's host) finished: a committed step on disk
        # is the outcome; none means it failed (its failure left nothing to find).
        try:
            save.ckpts._agreement.wait_visible(save.final_name, deadline, rank, what, stage=False)
        except PeerTimeout:
            raise gone from None
        return
    except MalformedValue as malformed:
        raise malformed_error(save, f"its outcome ({malformed})") from None
    except PeerTimeout as waited:
        raise gave_up(save, waited) from None
    if not outcome.get("ok"):
        raise failure(outcome, rank, save.step, save.final)
    save.warnings = note_warnings(outcome.get("warnings"), rank)
    save.ckpts._agreement.wait_visible(save.final_name, deadline, rank, what, stage=False)


def gave_up(save: CheckpointSave, waited: PeerTimeout) -> PeerTimeout:
    """This rank waited its whole timeout in this save: what it may assume, agreed with the writer
    through the call's verdict (``CheckpointCall.give_up``), said in its error and ``.outcome``."""
    writer, step = save.group.writer, save.step
    phase = f", in {waited.phase}" if waited.phase else ""
    elapsed = f" {waited.elapsed:.0f} s" if waited.elapsed is not None else ""
    outcome = save.call.give_up(f"rank {save.group.rank} waited{elapsed} for rank {waited.waited_for}{phase}")
    if outcome == "not committed":
        said = (
            f"This rank gave up: step {step} is not committed (rank {writer} sees that this rank gave up "
            f"before its commit point and abandons the stage; latest is unchanged)."
        )
    elif outcome == "committing":
        said = (
            f"This rank gave up after rank {writer} had begun the commit of step {step} (its rename): "
            f"whether the step is committed is rank {writer}'s outcome; latest() tells."
        )
        outcome = "unknown"
    else:
        said = f"This rank gave up; whether step {step} is committed is unknown here: latest() tells."
    return PeerTimeout(
        f"{waited} {said}",
        waited.path,
        waited_for=waited.waited_for,
        phase=waited.phase,
        step=step,
        elapsed=waited.elapsed,
        outcome=outcome,
    )


def malformed_error(save: CheckpointSave, what: str) -> CheckpointError:
    """A value the writer sets is malformed: this rank cannot know the outcome from it."""
    writer = save.group.writer
    return CheckpointError(
        f"rank {save.group.rank}: {what} heard from rank {writer} in the store for step {save.step} "
        f"is malformed; this rank does not know whether step {save.step} was committed: latest() "
        "decides (a value in the job's store is input: TCPStore has no authentication)",
        save.final,
        failed={writer: f"malformed {what}"},
    )


def sync_share(save: CheckpointSave, deadline: float) -> None:
    """This rank's share of the commit's fsyncs (see FsyncShares), at the same time as every other
    rank's; the files it cannot sync are named back, and the writer syncs them."""
    try:
        share = hear_fsync_share(save.call, deadline)
    except MalformedValue as exc:
        # The writer fails the commit naming this rank at once, rather than waiting for its answer;
        # the call's verdict tells this rank whether the writer may still commit.
        report_sync_failed(save.call, f"the fsync shares it heard are malformed ({exc})")
        if save.call.give_up(f"rank {save.group.rank} heard malformed fsync shares") == "not committed":
            raise CheckpointError(
                f"rank {save.group.rank}: the fsync shares heard from rank {save.group.writer} in the "
                f"store for step {save.step} are malformed ({exc}); step {save.step} is not committed "
                f"(this rank told rank {save.group.writer}, which abandons it)",
                save.final,
                failed={save.group.writer: "malformed fsync shares"},
            ) from None
        raise malformed_error(save, f"its fsync shares ({exc})") from None
    if share is None:
        return  # the writer decided first: nothing will be committed
    left = [rel for rel in share if not is_relative_name(rel)]  # input: never a path out of the stage
    wanted = [rel for rel in share if is_relative_name(rel)]
    try:
        with held_directory(save.ckpts._steps.url(save.stage_name)) as stage_fd:
            left += fsync_files(stage_fd, wanted)
    except OSError:
        left = share  # the stage cannot be opened from here (yet): the writer syncs them
    report_synced(save.call, left)
