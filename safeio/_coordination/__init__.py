"""Coordination: who this process is in the job (``group``) and the one protocol spoken through the group's
store (``calls``: numbered calls, bounded waits, acknowledge-then-delete), with its two users: a
replicated save's phases and outcome (``channel``) and a checkpoint's reports and decision
(``checkpoint_call``). Nothing outside this package talks to the store."""
