"""Promotion: turning a finished stage into the target, one storage behaviour per way of replacing it,
and the one back end per kind of location that picks them.

``backends`` makes everything that differs by where a target lives (the only place that asks);
``base.Promotion`` owns the flow; ``local.LocalPromotion`` the POSIX steps, handed the behaviour — an
object with ``commit`` and ``recover`` from ``exchange``, ``aside``, ``merge`` or ``versioned`` — that
replaces an existing target; ``commit_marker`` is the object stores' promotion, with its recovery;
``atomic_file`` is the one-file counterpart (a checkpoint root's steps, whose commits are promotions
through the same flow, live with ``Checkpoints`` in ``safeio._checkpoints``); ``leftovers`` finds what
dead writers left and hands it to its behaviour; ``active`` lists the stages open in this process.
"""
