"""Whole checkpoints: every rank's files staged in one directory, committed once, found by every rank.

``checkpoints`` is the public ``Checkpoints``: who commits and when, on the root's step storage (made by
its back end, ``safeio._promotion.backends``) and the store protocol of ``safeio._coordination``;
``pending`` runs an async save's commit; ``pointer`` writes ``latest`` files atomically.
"""
