"""The one vocabulary of states that ``safeio ls``, ``safeio verify`` and ``safeio gc`` report.

Every entry these commands report carries one word of this fixed set (``state`` in ``--json``), the prose
about that entry apart from it (``detail``), and, when the state is a problem, what fixes it (``fix``,
naming the command). The same thing gets the same word in every command: ``ls`` once called a damaged
step "partial" where ``verify`` said "damaged", and gave its states as prose (issue 36).

``docs/cli.md`` documents this table (``tests/test_cli_states.py`` checks that the page lists exactly these
words with these meanings).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class State(StrEnum):
    """What an entry under a checkpoint directory is; its value is the word shown and put in JSON."""

    COMMITTED = "committed"
    DAMAGED = "damaged"
    UNCOMMITTED = "uncommitted"
    UNMARKED_COMPLETE = "written-without-safeio-complete"
    UNMARKED_INCOMPLETE = "written-without-safeio-incomplete"
    IN_PROGRESS = "in-progress"
    IN_USE = "in-use"
    STALE = "stale"
    OTHER_HOST = "other-host"
    ANOTHER_USERS = "another-users"


@dataclass(frozen=True)
class About:
    meaning: str  # one line, as docs/cli.md's table gives it
    fix: str | None  # what fixes an entry in this state ({root}: the path the command was given)


ABOUT: dict[State, About] = {
    State.COMMITTED: About(
        "safeio's commit marker is there and every file it lists is there at its size (`verify` also "
        "compares the checksums): a checkpoint `latest()` may resume from",
        None,
    ),
    State.DAMAGED: About(
        "safeio's marker is there but does not hold: a file it lists is missing or differs (size, "
        "checksum), the marker cannot be read, or it names no step; never resumed from",
        "save it again (a checkpoint step: move it away first; `latest()` skips it meanwhile)",
    ),
    State.UNCOMMITTED: About(
        "objects under an object-store prefix without the commit marker safeio writes last: an upload "
        "still running, or one that stopped; never resumed from",
        "wait for the save to finish, or save it again",
    ),
    State.UNMARKED_COMPLETE: About(
        "no safeio marker, and its framework's own marker says it is complete (the Trainer's "
        "`trainer_state.json` with the weights, DCP's `.metadata`, accelerate's random states of every "
        "rank); safeio has no list of its files to check them against",
        None,
    ),
    State.UNMARKED_INCOMPLETE: About(
        "no safeio marker, and no framework marker safeio knows says it is complete: a save without "
        "safeio that was killed midway, most likely; never resumed from",
        "move it away or remove it (`latest()` skips it meanwhile)",
    ),
    State.IN_PROGRESS: About(
        "a stage (or temporary file, or lock) of a save whose process is alive on this host",
        None,
    ),
    State.IN_USE: About(
        "a version directory that a link points at, or one kept for readers within its grace period",
        None,
    ),
    State.STALE: About(
        "left by a safeio save whose process is gone (a stage, temporary file, old version or lock "
        "marker): nothing reads it",
        "`safeio gc {root}` removes it (an old version it puts back, an interrupted merge it completes)",
    ),
    State.OTHER_HOST: About(
        "left by a safeio save on another host, whose process cannot be asked from here",
        "`safeio gc {root} --older-than 1d` removes it once it is older than that (choose an age no save "
        "of yours lasts)",
    ),
    State.ANOTHER_USERS: About(
        "belongs to another user (its uid in the detail): nothing in it is read, resumed from, retired or "
        "removed",
        None,
    ),
}


def fix(state: State, root: str) -> str | None:
    """What fixes an entry in ``state`` under ``root`` (None: nothing to fix)."""
    template = ABOUT[state].fix
    return template.format(root=root) if template is not None else None
