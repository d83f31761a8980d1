"""Adapters for the frameworks users run: one module each, the framework an optional extra.

- ``safeio.integrations.lightning``: ``SafeCheckpointIO`` (``Trainer(plugins=[SafeCheckpointIO()])``) and
  ``SafeModelCheckpoint`` (an atomic ``last.ckpt`` link).
- ``safeio.integrations.accelerate``: ``save_state`` / ``load_state`` through ``safeio.Checkpoints``.
- ``safeio.integrations.transformers``: ``CheckpointsTrainerMixin``, ``get_last_checkpoint`` and
  ``patch_trainer`` (what ``SAFEIO_PATCH`` installs).

Importing this package imports no framework; each module imports its own.
"""
