"""``safeio autopatch``: is ``SAFEIO_PATCH`` able to protect code you cannot edit, here?

Reports whether the start-up hook (``safeio-autopatch.pth``) is installed in this interpreter's
site-packages, what ``SAFEIO_PATCH`` is set to, and starts a fresh interpreter with that value (``1``
when it is unset or off) that imports transformers, its Trainer and accelerate, to show which parts of
the patch really arrive in a new process (as in a spawned worker).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import site
import subprocess
import sys
from typing import Any

from safeio.cli._common import EXIT_OK, EXIT_PROBLEMS, CliError, print_json
from safeio.frameworks import PATCH_ALL, PATCH_PARTS, patch_parts

PTH = "safeio-autopatch.pth"
_PROBE = (
    "import os, transformers, transformers.trainer\n"
    "try:\n    import accelerate\nexcept ImportError:\n    pass\n"
    "print(os.environ.get('SAFEIO_PATCH_ACTIVE', ''))"
)


def add_parser(commands: Any, epilog: str) -> None:
    parser = commands.add_parser(
        "autopatch",
        help="check that SAFEIO_PATCH patches save_pretrained, the Trainer and accelerate in every new "
        "Python process",
        description="With SAFEIO_PATCH=1 in the environment, every Python process started with it "
        "(spawned workers included) routes transformers' save_pretrained through safeio from the moment "
        "transformers is imported, and stages and commits every Trainer's checkpoint-N (resuming, and "
        "transformers' get_last_checkpoint, only from committed ones) from the moment the Trainer is, and "
        "commits accelerate's save_state into a directory named with a step number (epoch_3) from the "
        "moment accelerate is. Values, a comma-separated list: 1 or all (save_pretrained, trainer and "
        "accelerate), models (that and models' save_pretrained too), save_pretrained, trainer, accelerate, "
        "-PART to leave one out (models,-trainer), 0 off; "
        "an unknown word is reported on stderr. This command checks that the "
        f"start-up hook ({PTH}) is installed and shows the parts a fresh interpreter gets with this "
        "SAFEIO_PATCH (1 when unset or off). Exit 0 when it works, 1 when it does not.",
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
    if importlib.util.find_spec("transformers") is None:  # as the demo's missing dependencies: bad input
        raise CliError(
            "transformers is not installed, so SAFEIO_PATCH has nothing to patch: pip install transformers"
        )
    hooks = hook_files()
    here = os.environ.get("SAFEIO_PATCH")
    # Off (or unset) here: show what 1 does; otherwise this value, an unknown word reported as the NO.
    value = here if here is not None and patch_parts(here) != ([], []) else "1"
    chosen, unknown = patch_parts(value)
    if chosen:
        pid, parts, error = _probe(value)
    else:  # words only, none of them a part: no process is patched, and no need to start one to see it
        pid, parts = "", ""
        error = (
            f"SAFEIO_PATCH={value!r} names no part (unknown: {', '.join(unknown)}); the parts are "
            f"{', '.join(PATCH_PARTS)}, and 1 for {', '.join(PATCH_ALL)}"
        )
    works = error is None
    report = {
        "hook": hooks[0] if hooks else None,
        "SAFEIO_PATCH": here,
        "probed_with": value,
        "new_process_patched": works,
        "parts": parts.split(",") if works else [],
        "probe_error": error,
    }
    if args.json:
        print_json(report)
    else:
        print(f"start-up hook: {report['hook'] or 'NOT installed (reinstall safeio with pip)'}")
        shown = report["SAFEIO_PATCH"]
        print(f"SAFEIO_PATCH here: {shown!r}" if shown is not None else "SAFEIO_PATCH here: unset (off)")
        if works:
            print(f"a new process with SAFEIO_PATCH={value} is patched: yes (pid {pid}): {parts}")
        else:
            print(f"a new process with SAFEIO_PATCH={value} is patched: NO ({report['probe_error']})")
    return EXIT_OK if works else EXIT_PROBLEMS


def _probe(value: str) -> tuple[str, str, str | None]:
    """A fresh interpreter with ``SAFEIO_PATCH=value``: its pid, the parts it reports patched, and what
    went wrong when none (None when patched)."""
    env = {**os.environ, "SAFEIO_PATCH": value}
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300
    )
    active = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else ""
    pid, _, parts = active.partition(":")  # <pid>:<part>,<part> (see safeio/_autopatch/startup.py)
    if probe.returncode == 0 and pid.isdigit() and parts:
        return pid, parts, None
    return pid, parts, probe.stderr.strip()[-500:] or "no patch reported"
