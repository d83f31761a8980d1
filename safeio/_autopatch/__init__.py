"""``SAFEIO_PATCH=1``: ``patch_save_pretrained()`` and ``patch_trainer()`` in every Python process started
with the variable (its values: ``startup.parts``).

``safeio-autopatch.pth`` (installed at the top of site-packages, see setup.py) runs one line at every
interpreter start: with the variable unset it reads one environment variable and stops. With it set, it
runs ``startup.py`` from this directory *without importing safeio*, which registers an import hook: each
patch is installed the moment ``transformers`` (or its Trainer's modules) finishes importing (importing
transformers at start-up would cost every process seconds). Spawned workers (``mp.spawn``, Lightning's
``ddp_spawn``, Ray) are fresh interpreters that inherit the environment, so they are patched too, which
a patch installed in the parent process never reaches. Nothing here may break start-up: failures are
reported on stderr.
"""
