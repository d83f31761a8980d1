"""Promotion: turning a finished stage into the target, one class per storage behaviour, and the one back
end per kind of location that picks them.

``backends`` makes everything that differs by where a target lives (the only place that asks);
``base.Promotion`` owns the flow; ``local.LocalPromotion`` the POSIX steps every local behaviour shares;
the behaviours — ``exchange``, ``aside``, ``merge``, ``versioned`` and ``commit_marker`` (object stores) —
each hold their promotion and their crash recovery; ``atomic_file`` is the one-file counterpart (a
checkpoint root's steps, whose commits are promotions through the same flow, live with ``Checkpoints`` in
``safeio._checkpoints``); ``leftovers`` finds what dead writers left and hands it to its
behaviour; ``active`` lists the stages open in this process.
"""
