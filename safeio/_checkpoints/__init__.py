"""Whole checkpoints: every rank's files staged in one directory, committed once, found by every rank.

``naming`` turns steps into directory names and back; ``pointer`` writes ``latest`` files atomically;
``exchange`` is the store protocol (every rank's report, the writer's outcome, bounded waits);
``committed`` says whether a step is committed and waits until it is visible from this rank;
``steps`` is what every storage behaviour shares, ``local_steps`` (a stage and a rename) and
``object_steps`` (in place, marker last) are the behaviours; ``pending`` runs an async save's commit;
``checkpoints`` is the public ``Checkpoints`` built on them.
"""
