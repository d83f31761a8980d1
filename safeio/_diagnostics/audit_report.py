"""Merging the audit sanitizer's per-rank records and finding the conflicts between ranks.

``safeio audit report DIR`` prints ``format_report(merge_reports(DIR))``: two ranks writing one path, and a
rank truncating a path another rank opened (the NFS interlock this library exists for).
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from safeio._diagnostics.audit import (
    _RECORD_GLOB_PREFIX,
    _RECORD_SUFFIX,
    LIMIT_NOTE,
    OPEN,
    TRUNCATING,
    AuditRecord,
)
from safeio._storage.dirfd import held_directory, open_regular_file


@dataclass(frozen=True)
class Conflict:
    """``multiple-writers``: two processes wrote (truncated, renamed, removed) one path.
    ``truncate-while-open``: a process truncated a path that another process opened."""

    kind: str
    path: str
    processes: tuple[str, ...]
    records: tuple[AuditRecord, ...]

    def describe(self) -> str:
        if self.kind == "multiple-writers":
            return f"{self.path} is written by {len(self.processes)} processes: {', '.join(self.processes)}"
        return f"{self.path} is truncated while other processes have it open: {', '.join(self.processes)}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": self.path,
            "processes": list(self.processes),
            "records": [r.to_dict() for r in self.records],
        }


@dataclass
class AuditReport:
    """The merged records of every process that wrote to one record directory."""

    record_dir: str
    records: list[AuditRecord] = field(default_factory=list)
    conflicts: list[Conflict] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    unreadable_lines: int = 0  # a process killed mid-write leaves a partial last line
    refused: list[str] = field(default_factory=list)  # named as record files, not read: why, each

    @property
    def unsafe(self) -> list[AuditRecord]:
        return [r for r in self.records if r.unsafe]

    def to_dict(self) -> dict[str, Any]:
        return {
            "record_dir": self.record_dir,
            "files": list(self.files),
            "records": [r.to_dict() for r in self.records],
            "unsafe": len(self.unsafe),
            "conflicts": [c.to_dict() for c in self.conflicts],
            "unreadable_lines": self.unreadable_lines,
            "refused": list(self.refused),
            "note": LIMIT_NOTE,
        }


def merge_reports(record_dir: str | os.PathLike[str]) -> AuditReport:
    """Merge every ``audit-rank*.jsonl`` in ``record_dir`` and find the conflicts between processes."""
    directory = os.path.abspath(os.fspath(record_dir))
    report = AuditReport(directory)
    names = sorted(
        n for n in os.listdir(directory) if n.startswith(_RECORD_GLOB_PREFIX) and n.endswith(_RECORD_SUFFIX)
    )
    with held_directory(directory, follow=True) as dir_fd:
        ours = {os.fstat(dir_fd).st_uid, os.geteuid()}
        for name in names:
            path = os.path.join(directory, name)
            fd = _record_file(dir_fd, name, path, ours, report)
            if fd is None:
                continue
            report.files.append(path)
            with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if not line.strip():
                        continue
                    try:
                        report.records.append(AuditRecord.from_dict(json.loads(line)))
                    except (ValueError, KeyError, TypeError):
                        report.unreadable_lines += 1
    report.records.sort(key=lambda r: (r.time, r.rank if r.rank is not None else -1, r.pid))
    report.conflicts = find_conflicts(report.records)
    return report


def _record_file(dir_fd: int, name: str, path: str, ours: set[int], report: AuditReport) -> int | None:
    """The record file ``name`` open for reading, or None (and why, in ``report.refused``). The record
    directory may be a share: a FIFO planted under a record file's name made the report hang for ever, a
    link to ``/dev/zero`` would have been read without end, and another user's file shown as this job's
    records. Only a regular file of the directory's owner or of this user is read."""
    try:
        fd, st = open_regular_file(dir_fd, name)
    except OSError as exc:
        what = "a symbolic link" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
        report.refused.append(f"{path}: {what}, not read")
        return None
    if st.st_uid not in ours:
        os.close(fd)
        report.refused.append(f"{path}: another user's (uid {st.st_uid}), not read")
        return None
    return fd


def _processes(records: Iterable[AuditRecord]) -> tuple[str, ...]:
    by_label = {r.process: (r.rank if r.rank is not None else 1 << 62, r.process) for r in records}
    return tuple(label for _key, label in sorted(by_label.values()))


def find_conflicts(records: Iterable[AuditRecord]) -> list[Conflict]:
    writes: dict[str, list[AuditRecord]] = {}
    truncates: dict[str, list[AuditRecord]] = {}
    opens: dict[str, list[AuditRecord]] = {}
    for record in records:
        if record.unsafe:
            for path in record.paths():
                writes.setdefault(path, []).append(record)
        if record.op in TRUNCATING:
            truncates.setdefault(record.path, []).append(record)
        elif record.op == OPEN:
            opens.setdefault(record.path, []).append(record)
    conflicts: list[Conflict] = []
    for path, recs in sorted(writes.items()):
        if len({r.process for r in recs}) > 1:
            conflicts.append(Conflict("multiple-writers", path, _processes(recs), tuple(recs)))
    for path, truncs in sorted(truncates.items()):
        truncators = {r.process for r in truncs}
        readers = [r for r in opens.get(path, ()) if r.process not in truncators or len(truncators) > 1]
        if readers:
            involved = [*truncs, *readers]
            conflicts.append(Conflict("truncate-while-open", path, _processes(involved), tuple(involved)))
    return conflicts


def format_report(report: AuditReport) -> str:
    """A human-readable report: the conflicts first, then every unsafe write, then the tool's limit."""
    unsafe = report.unsafe
    processes = {r.process for r in report.records}
    lines = [
        f"safeio audit of {report.record_dir}: {len(report.files)} record files, {len(processes)} "
        f"processes, {len(report.records)} records, {len(unsafe)} unsafe writes, "
        f"{len(report.conflicts)} conflicts"
    ]
    if report.unreadable_lines:
        lines.append(f"({report.unreadable_lines} unreadable lines skipped)")
    lines.extend(f"(skipped {why})" for why in report.refused)
    if report.conflicts:
        lines.append("")
        lines.append("CONFLICTS")
        for conflict in report.conflicts:
            lines.append(f"  {conflict.kind}: {conflict.describe()}")
            lines.extend(f"    {r.describe()}" for r in conflict.records)
    if unsafe:
        lines.append("")
        lines.append("UNSAFE WRITES (outside a safeio stage)")
        lines.extend(f"  {r.describe()}" for r in unsafe)
    if not report.conflicts and not unsafe:
        lines.append("no unsafe writes, no conflicts")
    lines.append("")
    lines.append(LIMIT_NOTE)
    return "\n".join(lines)
