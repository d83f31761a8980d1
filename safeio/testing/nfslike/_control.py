"""The daemon's control channel: one JSON request and one JSON reply per connection.

An abstract Unix socket (Linux) has no path, so no length limit (pytest's tmp paths easily pass the
108 bytes of sun_path) and nothing to clean up; its name is given to the daemon by the parent.
Counters are served from memory on request rather than rewritten to disk on every operation, so
counting costs nothing measurable per operation and a reading is exact once the syscalls returned.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("safeio.testing.nfslike")

Handler = Callable[[dict[str, Any]], Any]


class ControlError(RuntimeError):
    """The daemon refused a control request or could not be reached."""


def _address(name: str) -> str:
    return "\0" + name


def _read_line(conn: socket.socket) -> bytes:
    chunks = []
    while True:
        chunk = conn.recv(65536)
        if not chunk:
            break
        chunks.append(chunk)
        if chunk.endswith(b"\n"):
            break
    return b"".join(chunks)


class ControlServer:
    def __init__(self, name: str, handlers: dict[str, Handler]) -> None:
        self._handlers = handlers
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(_address(name))
        self._sock.listen(16)
        self._thread = threading.Thread(target=self._serve, name="nfslike-control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._sock.close()

    def _serve(self) -> None:
        # libfuse ends its loop only when the main thread sees SIGTERM/SIGINT/SIGHUP; a signal
        # delivered to this thread instead would be lost for the mount's shutdown.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(5.0)
                try:
                    self._handle(conn)
                except OSError as exc:
                    logger.warning("control connection failed: %s", exc)

    def _handle(self, conn: socket.socket) -> None:
        try:
            request = json.loads(_read_line(conn))
            handler = self._handlers[request["cmd"]]
            reply = {"ok": True, "result": handler(request.get("args", {}))}
        except Exception as exc:
            logger.exception("control request failed")
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        conn.sendall((json.dumps(reply) + "\n").encode())


def request(name: str, cmd: str, *, timeout: float = 10.0, **args: Any) -> Any:
    """Send one command to the daemon listening on `name` and return its result."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(_address(name))
            sock.sendall((json.dumps({"cmd": cmd, "args": args}) + "\n").encode())
            raw = _read_line(sock)
        except OSError as exc:
            raise ControlError(f"nfslike daemon control {cmd!r} failed: {exc}") from exc
    if not raw:
        raise ControlError(f"nfslike daemon control {cmd!r}: connection closed without a reply")
    reply = json.loads(raw)
    if not reply["ok"]:
        raise ControlError(f"nfslike daemon control {cmd!r}: {reply['error']}")
    return reply["result"]
