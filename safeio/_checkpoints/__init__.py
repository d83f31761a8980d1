"""Whole checkpoints: every rank's files staged in one directory, committed once, found by every rank.

``naming`` turns steps into directory names and back; ``pointer`` writes ``latest`` files atomically;
``exchange`` is the store protocol (every rank's report, the writer's outcome, bounded waits);
``committed`` says whether a step is committed and waits until it is visible from this rank;
``checkpoints`` is the public ``Checkpoints`` built on them.
"""
