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

from safeio._errors import InvalidTypeError, SafeIOError
from safeio.cli import audit as audit
from safeio.cli import autopatch as autopatch
from safeio.cli import demo as demo
from safeio.cli import doctor as doctor
from safeio.cli import gc as gc
from safeio.cli import ls as ls
from safeio.cli import verify as verify
from safeio.cli._common import EXIT_INTERRUPTED, EXIT_PROBLEMS, EXIT_USAGE, CliError
from safeio.cli._exit_codes import epilog

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="safeio",
        description="Safe replicated checkpoint files on shared filesystems: probe a filesystem, clean "
        "up after crashes, check a checkpoint, and see the problem and the fix.",
        epilog=epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log safeio's debug messages to stderr")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    for module in (doctor, gc, verify, ls, demo, audit, autopatch):
        name = module.__name__.rsplit(".", 1)[-1]
        module.add_parser(commands, epilog("audit report" if name == "audit" else name))
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


def _where(exc: OSError) -> str:
    return f"{exc.filename}: " if exc.filename is not None else ""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``) and return its exit code."""
    if argv is not None and (isinstance(argv, (str, bytes)) or not all(isinstance(a, str) for a in argv)):
        # A whole command line as one string was split into letters: "invalid choice: 'l'".
        raise InvalidTypeError(f"argv must be a list of str, got {type(argv).__name__} {argv!r}", None)
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
    except BrokenPipeError:  # `safeio gc --dry-run | head`: the reader went away, nothing to report
        return 0
    except PermissionError as exc:  # a directory under PATH this user may not list: as for PATH itself
        print(f"{name}: error: {_where(exc)}permission denied (cannot read it as this user)", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # the filesystem failed (EIO, ESTALE): a problem found, never a traceback
        print(f"{name}: error: {_where(exc)}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_PROBLEMS
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return code
