"""Promotion: turning a finished stage into the target, one class per storage behaviour.

``base.Promotion`` owns the flow; ``local.LocalPromotion`` the POSIX steps every local behaviour shares;
the behaviours — ``exchange``, ``aside``, ``merge``, ``versioned`` and ``commit_marker`` (object stores) —
each hold their promotion and their crash recovery; ``atomic_file`` is the one-file counterpart;
``resolver`` picks the class; ``leftovers`` finds what dead writers left and hands it to its behaviour;
``active`` lists the stages open in this process.
"""
