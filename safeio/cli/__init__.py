"""The ``safeio`` command (also ``python -m safeio``): doctor, gc, verify, ls, demo, audit report, autopatch.

Each subcommand lives in its own module with ``add_parser(subparsers)`` and ``run(args) -> int``; the
modules import nothing heavy at import time (torch, transformers and FUSE only inside ``run``), so
``safeio --help`` and ``safeio gc`` start fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from safeio._errors import SafeIOError
from safeio.cli import audit as audit
from safeio.cli import autopatch as autopatch
from safeio.cli import demo as demo
from safeio.cli import doctor as doctor
from safeio.cli import gc as gc
from safeio.cli import ls as ls
from safeio.cli import verify as verify
from safeio.cli._common import EXIT_INTERRUPTED, EXIT_USAGE, CliError

__all__ = ["build_parser", "main"]

EPILOG = """\
exit codes:
  0    success: doctor printed its report, gc finished (also when nothing was removable),
       verify found the target complete, ls listed a root whose latest is committed, demo's safeio
       pattern ran clean, audit found no conflicts, autopatch saw a new process patched
  1    problems found: verify found the target incomplete, damaged or missing; ls found latest naming
       something not committed; gc could not remove
       something; doctor found the filesystem breaks a guarantee safeio relies on (atomic rename,
       exclusive create); demo's safeio pattern failed; audit found conflicts; autopatch
       saw no patch in a new process
  2    usage error or bad input (missing path, a file where a directory is needed, no permission)
  130  interrupted (Ctrl-C); whatever the command had created is removed first
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="safeio",
        description="Safe replicated checkpoint files on shared filesystems: probe a filesystem, clean "
        "up after crashes, check a checkpoint, and see the problem and the fix.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log safeio's debug messages to stderr")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    for module in (doctor, gc, verify, ls, demo, audit, autopatch):
        module.add_parser(commands, EPILOG)
    return parser


def _version() -> str:
    from safeio import __version__

    return __version__


def _log_to_stderr() -> None:
    # Only on request: without -v safeio's warnings still reach stderr through logging's last resort.
    logger = logging.getLogger("safeio")
    if not any(getattr(h, "_safeio_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("safeio: %(levelname)s: %(message)s"))
        handler._safeio_cli = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``) and return its exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.verbose:
        _log_to_stderr()
    name = f"safeio {args.command}"
    try:
        code: int = args.run(args)
    except CliError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return exc.code
    except SafeIOError as exc:  # bad input that safeio itself refused (an empty path, a NUL byte)
        print(f"{name}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `safeio gc --dry-run | head`: the reader went away, nothing to report
        return 0
    return code
