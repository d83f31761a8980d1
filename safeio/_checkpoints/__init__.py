"""Whole checkpoints: every rank's files staged in one directory, committed once, found by every rank.

``checkpoints`` is the public ``Checkpoints``: who commits and when, on the root's step storage and the
store protocol of ``safeio._coordination``. The steps themselves live here too: ``steps`` (their names,
the pointer files, what every kind of storage shares: reading, commit order, retention),
``step_directories`` (POSIX: a stage directory and a rename) and ``step_prefixes`` (object stores: in
place, a marker written last), chosen for the root's back end by ``storage``; ``pending`` runs an async
save's commit; ``pointer`` writes ``latest`` files atomically.
"""
