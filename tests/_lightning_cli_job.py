"""A Lightning job written the way LightningCLI's users write one, from Lightning's own classes: the model
and data are ``lightning.pytorch.demos.boring_classes``' ``DemoModel`` and ``BoringDataModule`` (installed
with lightning; random data, nothing to download). Nothing here mentions safeio: checkpointing is chosen
on the command line, as LightningCLI users choose it, plain::

    torchrun ... tests/_lightning_cli_job.py fit --trainer.callbacks+=ModelCheckpoint ...

or through safeio, with the two class paths docs/frameworks/lightning.md names::

    --trainer.callbacks+=safeio.integrations.lightning.SafeModelCheckpoint
    --trainer.plugins=safeio.integrations.lightning.SafeCheckpointIO

(Lightning's example scripts are not shipped in its package; a copy taken from its repository could not be
kept here, so the job is built from what the package ships.)
"""

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, DemoModel

if __name__ == "__main__":
    # A restarted job writes its config again: overwrite it (as Lightning's own examples do).
    LightningCLI(
        DemoModel, BoringDataModule, seed_everything_default=1234, save_config_kwargs={"overwrite": True}
    )
