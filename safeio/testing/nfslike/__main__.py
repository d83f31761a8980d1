"""`python -m safeio.testing.nfslike BACKING MOUNTPOINT [options]`: run the NFS-like daemon.

It stays in the foreground until unmounted (`fusermount3 -u MOUNTPOINT`) or signalled. The
`mount()` API starts exactly this command in a child process.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Sequence

from safeio.testing.nfslike._options import Options
from safeio.testing.nfslike._state import StateDir

logger = logging.getLogger("safeio.testing.nfslike")

_PR_SET_PDEATHSIG = 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m safeio.testing.nfslike",
        description="Mount BACKING at MOUNTPOINT through FUSE, emulating NFS client behaviours "
        "that break checkpoint code. With no options it is a plain passthrough.",
    )
    parser.add_argument("backing", help="directory to mirror")
    parser.add_argument("mountpoint", help="empty directory to mount on")
    parser.add_argument(
        "--state-dir",
        help="directory (outside the mount) for hazards.jsonl, ops.json and daemon.log "
        "(default: a new temporary directory, printed at start)",
    )
    parser.add_argument(
        "--control",
        help="abstract Unix socket name of the control channel (default: safeio-nfslike-<pid>)",
    )
    parser.add_argument(
        "--parent-pid",
        type=int,
        help="die with this process: the daemon is killed when its parent exits",
    )
    parser.add_argument("--debug", action="store_true", help="log every operation (libfuse -d)")
    Options.add_arguments(parser)
    return parser


def _die_with_parent(parent_pid: int) -> None:
    # SIGKILL rather than SIGTERM: a graceful libfuse exit joins worker threads, which can sit in
    # a hang or interlock wait; a killed daemon closes /dev/fuse at once and auto_unmount's
    # fusermount3 helper removes the mount. Either way a killed test leaves no mount behind.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    options = Options.from_namespace(args)
    if args.parent_pid is not None:
        _die_with_parent(args.parent_pid)
    state_path = args.state_dir or tempfile.mkdtemp(prefix="nfslike-state-")
    state = StateDir(state_path)
    control = args.control or f"safeio-nfslike-{os.getpid()}"
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s %(process)d %(threadName)s %(name)s %(levelname)s %(message)s",
    )
    if not args.state_dir or not args.control:
        print(f"nfslike: state directory {state_path}, control socket @{control}", file=sys.stderr)
    # The kernel already applied the caller's umask to every mode it sends; the daemon's own
    # umask must not mask it a second time.
    os.umask(0)
    # Prefer libfuse3 when libfuse2 is installed as well (mfusepy would pick "fuse" first).
    os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")
    from safeio.testing.nfslike._daemon import serve

    serve(
        os.path.realpath(args.backing),
        os.path.realpath(args.mountpoint),
        options,
        state,
        control,
        debug=args.debug,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
