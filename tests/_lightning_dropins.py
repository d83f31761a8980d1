"""Lightning with safeio's drop-ins as a user would have them everywhere: every ``ModelCheckpoint`` a
`SafeModelCheckpoint`, and ``SafeCheckpointIO`` where a strategy would make its default ``TorchCheckpointIO``.

The least that does it: the name ``lightning.pytorch.callbacks.ModelCheckpoint`` (what user code and
Lightning's tests import), the callback connector's name for the Trainer's default callback, and the
strategy module's name for its default checkpoint IO (``Strategy.checkpoint_io`` makes it when no
plugin gave one, also inside an ``AsyncCheckpointIO`` without one). A ``CheckpointIO`` a test passes
itself is left alone, as is Lightning's own module ``lightning.pytorch.callbacks.model_checkpoint``
(its code refers to its own class, which `SafeModelCheckpoint` subclasses).
"""

from __future__ import annotations


def install() -> None:
    from lightning.pytorch import callbacks
    from lightning.pytorch.strategies import strategy
    from lightning.pytorch.trainer.connectors import callback_connector

    from safeio.integrations.lightning import SafeCheckpointIO, SafeModelCheckpoint

    callbacks.ModelCheckpoint = SafeModelCheckpoint
    callback_connector.ModelCheckpoint = SafeModelCheckpoint
    strategy.TorchCheckpointIO = SafeCheckpointIO
