"""Coordination: who this process is in the job (``group``) and the one protocol spoken through the group's
store (``calls``: numbered calls, bounded waits, acknowledge-then-delete, values parsed as input), with its
two users: a replicated save's phases and outcome (``channel``) and a checkpoint's calls — entry check,
reports, verdict and decision (``checkpoint_call``), what the ranks share inside a save
(``checkpoint_shares``), where each rank is (``checkpoint_status``). Nothing outside this package talks to
the store."""
