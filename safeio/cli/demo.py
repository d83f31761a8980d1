"""``safeio demo``: the hang pattern and the safeio pattern, side by side, on N real ranks.

N ranks on torch.distributed (gloo over loopback) save one tokenizer into a shared directory, first as
unmodified training code does (every rank ``save_pretrained`` into it, then loads it back), then through
safeio, while a separate reader process loads it in a loop. On the NFS-like FUSE mount (when FUSE is
available) a truncating open of a file another process holds open blocks and then fails, as NFS's inode
interlock does, and the mount counts every process's operations; on a local temporary directory the
failures are readers loading half-written files. Everything the demo creates lives under one temporary
directory, removed (after unmounting) however the demo ends, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from typing import Any

from safeio.cli import _demo_table
from safeio.cli._common import EXIT_OK, EXIT_PROBLEMS, CliError, existing_directory, positive_int, print_json
from safeio.cli._demo_env import Workspace, terminate_as_interrupt
from safeio.cli._demo_run import DemoFailed, Run

DEFAULT_RANKS = 4
DEFAULT_ITERATIONS = 5
DEFAULT_HAZARD_TIMEOUT = 0.5


def add_parser(commands: Any, epilog: str) -> None:
    parser = commands.add_parser(
        "demo",
        help="see the problem and the fix: N ranks save a tokenizer unguarded, then through safeio",
        description="Spawn N ranks on torch.distributed (gloo over loopback) and run, against one shared "
        "directory, first the unguarded pattern (every rank calls tokenizer.save_pretrained(dir), then "
        "loads it back) and then the safeio pattern (every rank calls safeio.save_pretrained(tokenizer, "
        "dir)), while a reader process loads the tokenizer in a loop. The shared directory is an NFS-like "
        "FUSE mount when FUSE is available (a truncation of a file another process has open blocks, "
        "then fails, like NFS's inode interlock), else a local temporary directory. Prints hazards, "
        "failed saves, failed loads, shared-filesystem writes per rank and wall time per pattern. "
        "Exit 0 when the safeio pattern ran clean.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--ranks", type=positive_int, default=DEFAULT_RANKS, help=f"number of ranks (default {DEFAULT_RANKS})"
    )
    parser.add_argument(
        "--iterations",
        type=positive_int,
        default=DEFAULT_ITERATIONS,
        help=f"saves per rank and pattern (default {DEFAULT_ITERATIONS})",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--nfslike",
        dest="backend",
        action="store_const",
        const="nfslike",
        help="require the NFS-like FUSE mount",
    )
    where.add_argument(
        "--local", dest="backend", action="store_const", const="local", help="use a local temporary directory"
    )
    parser.add_argument(
        "--hazard-timeout",
        type=float,
        default=DEFAULT_HAZARD_TIMEOUT,
        metavar="SECONDS",
        help="NFS-like mount: how long a blocked truncation waits before it fails "
        f"(default {DEFAULT_HAZARD_TIMEOUT:g}; a real NFS client waits forever)",
    )
    parser.add_argument("--tmpdir", metavar="DIR", help="where to create the demo's temporary directory")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON instead of the table")
    parser.set_defaults(run=run, backend=None)


def run(args: argparse.Namespace) -> int:
    if not 0 < args.hazard_timeout <= 30:
        raise CliError("--hazard-timeout must be between 0 and 30 seconds")
    if args.ranks > 64:
        raise CliError("--ranks: at most 64 ranks on one machine")
    if args.tmpdir is not None:
        existing_directory(args.tmpdir, what="--tmpdir")
    missing = [
        name for name in ("torch", "transformers", "tokenizers") if importlib.util.find_spec(name) is None
    ]
    if missing:
        raise CliError(f"the demo needs {', '.join(missing)}: pip install 'safeio-ckpt[torch,hf]' tokenizers")
    backend, why = _choose_backend(args.backend)
    say = _Progress()
    started = time.monotonic()
    with terminate_as_interrupt(), Workspace(backend, args.tmpdir, args.hazard_timeout) as workspace:
        say(
            f"safeio demo: {args.ranks} rank(s) x {args.iterations} save(s) per pattern; "
            "a reader loads in a loop"
        )
        say(f"shared directory: {workspace.shared} ({workspace.describe()}){why}")
        try:
            result = Run(workspace, args.ranks, args.iterations, say).run()
        except DemoFailed as exc:
            raise CliError(f"the demo could not run: {exc}", EXIT_PROBLEMS) from None
    result["backend_reason"] = why.strip(" ;()") or None
    result["total_seconds"] = round(time.monotonic() - started, 2)
    if args.json:
        print_json(result)
    else:
        print(_demo_table.render(result))
    problems = _demo_table.safeio_problems(result)
    if problems:
        print(f"safeio demo: the safeio pattern was not clean: {'; '.join(problems)}", file=sys.stderr)
        return EXIT_PROBLEMS
    return EXIT_OK


def _choose_backend(requested: str | None) -> tuple[str, str]:
    if requested == "local":
        return "local", ""
    from safeio.testing.nfslike import fuse_unavailable_reason

    reason = fuse_unavailable_reason()
    if reason is None:
        return "nfslike", ""
    if requested == "nfslike":
        raise CliError(f"--nfslike: the NFS-like FUSE filesystem cannot be mounted here: {reason}")
    return "local", f"; FUSE unavailable ({reason}), so the hazards cannot be shown"


class _Progress:
    """Progress lines on stderr, so that stdout holds only the table (or the JSON)."""

    def __call__(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)
