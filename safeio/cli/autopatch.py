"""``safeio autopatch``: is ``SAFEIO_PATCH=1`` able to protect code you cannot edit, here?

Reports whether the start-up hook (``safeio-autopatch.pth``) is installed in this interpreter's
site-packages, what ``SAFEIO_PATCH`` is set to, and starts a fresh interpreter with ``SAFEIO_PATCH=1``
that imports transformers, to show the patch really arrives in a new process (as in a spawned worker).
"""

from __future__ import annotations

import argparse
import os
import site
import subprocess
import sys
from typing import Any

from safeio.cli._common import EXIT_OK, EXIT_PROBLEMS, print_json

PTH = "safeio-autopatch.pth"
_PROBE = "import os, transformers; print(os.environ.get('SAFEIO_PATCH_ACTIVE', ''))"


def add_parser(commands: Any, epilog: str) -> None:
    parser = commands.add_parser(
        "autopatch",
        help="check that SAFEIO_PATCH=1 patches save_pretrained in every new Python process",
        description="With SAFEIO_PATCH=1 in the environment, every Python process started with it "
        "(spawned workers included) routes transformers' save_pretrained through safeio from the moment "
        "transformers is imported (SAFEIO_PATCH=models: models too). This command checks that the "
        f"start-up hook ({PTH}) is installed and proves it in a fresh interpreter. Exit 0 when it works, "
        "1 when it does not.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print a machine-readable report")
    parser.set_defaults(run=run)


def hook_files() -> list[str]:
    """The installed start-up hooks of this interpreter's site-packages directories."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return [os.path.join(d, PTH) for d in dirs if os.path.isfile(os.path.join(d, PTH))]


def run(args: argparse.Namespace) -> int:
    hooks = hook_files()
    env = {**os.environ, "SAFEIO_PATCH": "1"}
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300
    )
    pid = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else ""
    works = probe.returncode == 0 and pid.isdigit()
    report = {
        "hook": hooks[0] if hooks else None,
        "SAFEIO_PATCH": os.environ.get("SAFEIO_PATCH"),
        "new_process_patched": works,
        "probe_error": None if works else (probe.stderr.strip()[-500:] or "no patch reported"),
    }
    if args.json:
        print_json(report)
    else:
        print(f"start-up hook: {report['hook'] or 'NOT installed (reinstall safeio with pip)'}")
        shown = report["SAFEIO_PATCH"]
        print(f"SAFEIO_PATCH here: {shown!r}" if shown is not None else "SAFEIO_PATCH here: unset (off)")
        if works:
            print(f"a new process with SAFEIO_PATCH=1 is patched: yes (pid {pid})")
        else:
            print(f"a new process with SAFEIO_PATCH=1 is patched: NO ({report['probe_error']})")
    return EXIT_OK if works else EXIT_PROBLEMS
