"""Every Python process of the run that has this directory on its path uses safeio's Lightning drop-ins.

A ``sitecustomize`` rather than a pytest plugin: Lightning's ``ddp_spawn`` tests run the Trainer in
spawned processes, which load no pytest plugin but do run ``sitecustomize``.
"""

from tests._lightning_dropins import install

install()
