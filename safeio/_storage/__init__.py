"""Storage: the primitives every behaviour builds on.

``location`` parses paths and fsspec URLs (what differs by kind is the back end's, in
``safeio._promotion.backends``); ``mounts`` and ``posix`` know the local filesystem; ``names`` names
everything safeio creates beside a target; ``manifest`` describes a directory; ``fsops`` fixes permissions
and removes trees; ``locking`` is the promotion lock; ``readers`` is the reading side of a target
(complete? which version? a committed step?). Nothing here knows about ranks or promotion.
"""
