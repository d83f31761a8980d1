"""Storage: where a target lives and the primitives every behaviour builds on.

``location`` resolves paths and fsspec URLs; ``mounts`` and ``posix`` know the local filesystem; ``names``
names everything safeio creates beside a target; ``manifest`` describes a directory; ``fsops`` fixes
permissions and removes trees; ``locking`` is the promotion lock; ``readers`` is the reading side of a
target (complete? which version?). Nothing here knows about ranks or promotion.
"""
