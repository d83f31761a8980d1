"""``safeio demo``'s surroundings: its temporary directory (and mount), and signal handling that makes
``kill`` clean up like Ctrl-C and keeps a second Ctrl-C from interrupting the cleanup."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    # `kill PID` (SIGTERM) must clean up like Ctrl-C does: unmount, remove the temporary directory.
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Workspace:
    """The demo's temporary directory and, on the NFS-like backend, the mount inside it."""

    def __init__(self, backend: str, tmpdir: str | None, hazard_timeout: float) -> None:
        self.backend = backend
        self.hazard_timeout = hazard_timeout
        self.root = tempfile.mkdtemp(prefix="safeio-demo-", dir=tmpdir)
        os.chmod(self.root, 0o755)
        self.mount: Any = None
        self.shared = os.path.join(self.root, "shared")
        # The same directory written around the mount, for seeding (invisible to counters and hazards).
        self.beneath = self.shared

    def describe(self) -> str:
        if self.mount is not None:
            return f"NFS-like FUSE mount, a blocked truncation fails after {self.hazard_timeout:g} s"
        return "local temporary directory"

    def __enter__(self) -> Workspace:
        try:
            if self.backend == "nfslike":
                from safeio.testing.nfslike import mount

                self.beneath = os.path.join(self.root, "backing")
                os.mkdir(self.beneath, 0o755)
                self.mount = mount(
                    self.beneath,
                    self.shared,
                    state_dir=os.path.join(self.root, "state"),
                    hazard_timeout=self.hazard_timeout,
                ).start()
            else:
                os.mkdir(self.shared, 0o755)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        # Shielded from a second Ctrl-C: an interrupted teardown would leave a mount behind. Every step
        # below is bounded (Mount.stop unmounts lazily and kills its daemon when needed).
        with signals_deferred():
            if self.mount is not None:
                self.mount.stop()
            shutil.rmtree(self.root, ignore_errors=True)

    def target(self, pattern: str) -> str:
        return os.path.join(self.shared, pattern, "tokenizer")

    def seed(self, pattern: str) -> str:
        return os.path.join(self.beneath, pattern, "tokenizer")


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
