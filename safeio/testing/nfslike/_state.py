"""The mount's state directory, outside the mount: hazard log, counters snapshot, daemon log.

Both sides use it: the daemon appends hazards and writes snapshots, the parent reads them. Keeping
it outside the mount means reading it never goes through (or hangs in) the filesystem under test.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

HAZARDS = "hazards.jsonl"
OPS = "ops.json"
DAEMON_LOG = "daemon.log"


class StateDir:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._append_lock = threading.Lock()

    @property
    def hazards_file(self) -> Path:
        return self.path / HAZARDS

    @property
    def ops_file(self) -> Path:
        return self.path / OPS

    @property
    def daemon_log(self) -> Path:
        return self.path / DAEMON_LOG

    def clear(self) -> None:
        """Forget a previous mount's hazards and counters (the files describe one mount)."""
        for path in (self.hazards_file, self.ops_file):
            path.unlink(missing_ok=True)

    def append_hazard(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        # One write(2) per record on an O_APPEND descriptor: a reader never sees half a line
        # from concurrent hazards.
        with self._append_lock:
            fd = os.open(self.hazards_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)

    def read_hazards(self) -> list[dict[str, Any]]:
        try:
            text = self.hazards_file.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def write_ops(self, snapshot: dict[int, dict[str, int]]) -> None:
        tmp = self.ops_file.with_name(f".{OPS}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps({str(pid): ops for pid, ops in snapshot.items()}, sort_keys=True))
        os.replace(tmp, self.ops_file)

    def read_ops(self) -> dict[int, dict[str, int]]:
        try:
            raw = json.loads(self.ops_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        return {int(pid): dict(ops) for pid, ops in raw.items()}
