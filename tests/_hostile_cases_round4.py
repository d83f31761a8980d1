"""Hostile shares, round 4 (an audit of the calls that act on a share by name): a directory another user
swaps in under a name safeio judged a moment before. Registered into ``tests._hostile_cases.CASES``, so
that ``tests/test_hostile_share.py`` runs each on local disk and on the NFS-like mount, under its alarm,
with the sentinel-tree check.

In a directory others can write without the sticky bit, another user may rename any entry of it, a
directory of yours included (a rename within one directory needs no permission on the directory
moved), though they cannot delete a non-empty tree of yours. What safeio removes by name is what stands
at the name when it acts, which need not be what it judged. The victim is root, the other user uid 65534
in a forked child (only root can be both); the swap is made at the point the race opens, so that each
case is exact rather than a matter of luck.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import xxhash

import safeio
import safeio.shares
from safeio._checkpoints.step_directories import LocalSteps
from safeio._diagnostics.audit_report import format_report, merge_reports
from safeio._promotion import backends
from safeio._storage.location import Location
from safeio._storage.manifest import MANIFEST_NAME
from safeio._storage.readers import LocalReader
from safeio._who import current_rank
from safeio.cli import verify_root
from safeio.frameworks import remove_file
from tests._hostile_cases import ROOT_ONLY, Share, alarm, captured_warnings, case, cli
from tests._hostile_cases_round2 import _as_nobody
from tests._hostile_cases_round3 import TiB, measured

DATA = "root's training data: uid 65534 may rename this tree, never delete it\n"


def _victims_tree(parent: Path) -> Path:
    """A tree of root's, 0755 with a 0644 file, beside the steps: uid 65534 cannot delete it."""
    data = parent / "data"
    data.mkdir(mode=0o755)
    (data / "corpus.txt").write_text(DATA)
    (data / "corpus.txt").chmod(0o644)
    return data


def _swapped_in(parent: Path, name: str, tree: Path) -> Callable[[], dict[str, Any]]:
    """As uid 65534: ``name`` renamed out of the way, and root's ``tree`` renamed to ``name``."""

    def swap() -> dict[str, Any]:
        os.rename(parent / name, parent / f"{name}.moved-by-65534")
        os.rename(tree, parent / name)
        return {"swapped": name}

    return swap


def _data_left(parent: Path) -> list[str]:
    return [str(p) for p in parent.rglob("corpus.txt") if p.read_text() == DATA]


@case
def r4case1_retention_never_deletes_a_tree_swapped_in_under_a_retired_steps_name(share: Share) -> None:
    """A root without the sticky bit: retention chose step 1 (root's, committed) to retire; uid 65534
    then renamed it away and root's ``data/`` tree to its name. Before, retention renamed whatever stood
    there aside and deleted it: root's tree was gone."""
    root = share.share / "run"
    root.mkdir()
    root.chmod(0o777)  # group- or world-writable, not sticky
    data = _victims_tree(root)
    ckpts = safeio.Checkpoints(root, keep=1, timeout=30)
    with ckpts.save(1) as ckpt:
        Path(ckpt.path, "weights.bin").write_text("step 1")
    step1 = next(name for name in os.listdir(root) if name.endswith("1") and (root / name).is_dir())
    retire = LocalSteps._retire
    swaps: list[dict[str, Any]] = []

    def raced(self: LocalSteps, root_fd: int, retired: list[Any], replaced: list[str]) -> None:
        if any(step.name == step1 for step in retired):  # retention judged it: now the window is open
            swaps.append(_as_nobody(_swapped_in(root, step1, data)))
        retire(self, root_fd, retired, replaced)

    with captured_warnings() as warnings, mock.patch.object(LocalSteps, "_retire", raced):
        with ckpts.save(2) as ckpt:
            Path(ckpt.path, "weights.bin").write_text("step 2")
        ckpts.wait()  # retention's deletion, on its thread, has ended
    assert swaps == [{"swapped": step1}], swaps
    assert _data_left(root), f"root's data/ tree (swapped in as {step1}) was deleted by retention"
    assert any(step1 in w and "not the step" in w for w in warnings), warnings
    latest = ckpts.latest()
    assert latest is not None and latest.step == 2, latest


@case
def r4case2_a_step_is_read_where_it_was_judged_a_directory_never_through_a_link(share: Share) -> None:
    """A sticky world-writable root (the configuration docs/security.md recommends): uid 65534 makes its
    own directory under a step's name, and once safeio has found a directory there (not a link) puts a
    link to another run's step of root's in its place. Before, the step's marker was then read through the
    link: ``latest()`` of this run chose the other run's step, then waited its whole timeout for that step
    to be visible and failed (with the link swapped back for a directory of theirs in time, it could return
    their directory as the step to resume from)."""
    other_run, run = share.share / "other-run", share.share / "run"
    for root in (other_run, run):
        root.mkdir()
    run.chmod(0o1777)
    with safeio.Checkpoints(other_run, pointer=False, timeout=30).save(99) as ckpt:
        Path(ckpt.path, "weights.bin").write_text("the other run's step 99")
    # Before, latest() chose the linked step, then waited out this timeout for it to be visible.
    ckpts = safeio.Checkpoints(run, pointer=False, timeout=10)
    with ckpts.save(1) as ckpt:
        Path(ckpt.path, "weights.bin").write_text("this run's step 1")
    step99 = next(name for name in os.listdir(other_run) if name.endswith("99"))
    planted = run / step99
    assert _as_nobody(lambda: (planted.mkdir(), {"made": step99})[1]) == {"made": step99}
    is_step = LocalReader.is_step
    swaps: list[dict[str, Any]] = []

    def raced(self: LocalReader) -> bool:
        found = is_step(self)
        if self.location.path == str(planted) and not swaps:  # judged a directory: the window is open

            def swap() -> dict[str, Any]:
                planted.rmdir()
                planted.symlink_to(os.path.relpath(other_run / step99, run))
                return {"linked": step99}

            swaps.append(_as_nobody(swap))
        return found

    with mock.patch.object(LocalReader, "is_step", raced):
        latest = ckpts.latest()
    assert swaps == [{"linked": step99}], swaps
    assert latest is not None and latest.step == 1, f"latest() of {run} is {latest}, through the planted link"


@case
def r4baseline_1_naive_retention_deletes_the_tree_swapped_in(share: Share) -> None:
    """The naive way (judge the step by its marker, then remove it by name, as ``shutil.rmtree`` does)
    deletes root's tree that uid 65534 renamed to the step's name in between."""
    root = share.share / "run"
    root.mkdir()
    root.chmod(0o777)
    data = _victims_tree(root)
    step1 = root / "checkpoint-1"
    step1.mkdir()
    (step1 / "weights.bin").write_text("step 1")
    assert (step1 / "weights.bin").exists()  # judged: a step of ours
    assert _as_nobody(_swapped_in(root, step1.name, data)) == {"swapped": step1.name}
    shutil.rmtree(step1)
    assert not _data_left(root)


@case
def r4baseline_2_naive_reading_by_path_follows_the_link_swapped_in(share: Share) -> None:
    """The naive way (``os.path.isdir``, then the marker read by path) reads another run's marker through
    the link uid 65534 put where its own directory was judged."""
    other, run = share.share / "other-run" / "step_99", share.share / "run"
    other.mkdir(parents=True)
    (other / MANIFEST_NAME).write_text('{"step": 99}')
    run.mkdir(mode=0o1777)
    run.chmod(0o1777)
    planted = run / "step_99"
    assert _as_nobody(lambda: (planted.mkdir(), {"made": True})[1]) == {"made": True}
    assert os.path.isdir(planted)  # judged a directory

    def swap() -> dict[str, Any]:
        planted.rmdir()
        planted.symlink_to("../other-run/step_99")
        return {"linked": True}

    assert _as_nobody(swap) == {"linked": True}
    assert (planted / MANIFEST_NAME).read_text() == '{"step": 99}'


@case
def r4case3_an_audit_record_file_is_never_a_link_or_a_fifo_planted_under_its_name(share: Share) -> None:
    """A record directory all ranks write into, on the share (``SAFEIO_AUDIT_DIR``): uid 65534 plants a
    link, then a FIFO, under the name this process's records go to (``audit-rank{R}-pid{P}.jsonl``, a pid
    anyone can see). Before, the records were appended to the file the link named (here root's
    ``authorized_keys``, outside the share), and the FIFO made the audited write of root hang for ever."""
    records, work = share.share / "audit", share.share / "work"
    for directory in (records, work):
        directory.mkdir()
        directory.chmod(0o777)
    authorized = share.outside / ".ssh" / "authorized_keys"
    before = authorized.read_bytes()
    auditor = safeio.audit(work, action="record", record_dir=records)
    planted = Path(str(auditor.record_file(current_rank(), os.getpid())))
    assert _as_nobody(lambda: (planted.symlink_to(authorized), {"linked": True})[1]) == {"linked": True}
    with captured_warnings() as warnings, auditor:
        (work / "a.txt").write_text("an unsafe write, recorded")
    assert authorized.read_bytes() == before, "the audit record went through the planted link"
    assert any(str(planted) in w for w in warnings), warnings

    def fifo() -> dict[str, Any]:
        planted.unlink()
        os.mkfifo(planted, 0o666)
        return {"fifo": True}

    assert _as_nobody(fifo) == {"fifo": True}
    with captured_warnings() as warnings, alarm(20), auditor:  # the hang is the subject: a bound in time
        (work / "b.txt").write_text("another")
    assert any(str(planted) in w for w in warnings), warnings
    assert len(auditor.records) == 2, auditor.records


@case
def r4case4_the_audit_report_reads_only_regular_record_files_of_this_user(share: Share) -> None:
    """``safeio audit report DIR`` of a shared record directory: uid 65534 planted a FIFO, a link to
    ``/dev/zero`` and a record file of theirs forging a conflict. Before, the report hung for ever opening
    the FIFO (the link would have been read without end, and the forged records shown as this job's)."""
    records, work = share.share / "audit", share.share / "work"
    for directory in (records, work):
        directory.mkdir()
        directory.chmod(0o777)
    with safeio.audit(work, action="record", record_dir=records):
        (work / "a.txt").write_text("an unsafe write, recorded")
    forged = {"op": "open-truncate", "path": str(work / "a.txt"), "rank": 9, "pid": 1, "host": "x", "time": 0}

    def plant() -> dict[str, Any]:
        os.mkfifo(records / "audit-rank7-pid1.jsonl", 0o666)
        (records / "audit-rank8-pid1.jsonl").symlink_to("/dev/zero")
        (records / "audit-rank9-pid1.jsonl").write_text(json.dumps(forged) + "\n")
        return {"planted": 3}

    assert _as_nobody(plant) == {"planted": 3}
    with alarm(20):  # the hang is the subject: a bound in time
        report = merge_reports(records)
    assert [r.rank for r in report.records] == [None], report.records
    text = format_report(report)
    for n in (7, 8, 9):
        assert f"audit-rank{n}-pid1.jsonl" in text, text
    assert not report.conflicts, report.conflicts


def _their_step(root: Path, name: str, size: int) -> Path:
    """As uid 65534, in ``root``: a directory of its own holding a marker of step 2 that lists
    ``weights.bin`` of ``size`` bytes (sparse) with a checksum that is its own when the file is small."""

    def make() -> dict[str, Any]:
        theirs = root / name
        theirs.mkdir()
        with open(theirs / "weights.bin", "wb") as f:
            f.truncate(size)
        checksum = xxhash.xxh3_128_hexdigest(bytes(size)) if size < 1 << 20 else "0" * 32
        files = {"weights.bin": {"size": size, "xxh3_128": checksum}}
        (theirs / MANIFEST_NAME).write_text(json.dumps({"format": 2, "step": 2, "files": files}))
        return {"made": name}

    assert _as_nobody(make) == {"made": name}
    return root / name


def _two_steps(share: Share) -> tuple[Path, str]:
    """A root of root's, writable by others without the sticky bit, with steps 1 and 2 committed; the
    name of step 2."""
    root = share.share / "run"
    root.mkdir()
    root.chmod(0o777)
    ckpts = safeio.Checkpoints(root, keep=None, timeout=30)
    for step in (1, 2):
        with ckpts.save(step) as ckpt:
            Path(ckpt.path, "weights.bin").write_text(f"step {step}")
    return root, next(name for name in os.listdir(root) if name.endswith("2") and (root / name).is_dir())


@case
def r4case5_verify_of_a_root_never_reads_a_step_swapped_after_it_was_judged(share: Share) -> None:
    """``safeio verify ROOT``, a root without the sticky bit: once verify had listed and judged root's
    steps, uid 65534 renamed step 2 away and put a directory of its own in its place, whose marker lists a
    sparse 1 TiB file with a checksum, then a link to it. Before, verify hashed that file through the
    step's name (hours; round 3's case 5 came back by the race). Now step 2 is reported as no longer
    root's directory, and nothing of it is read."""
    root, step2 = _two_steps(share)
    theirs = _their_step(root, "theirs", TiB)
    judged = verify_root.checkpoint_rows
    swaps: list[dict[str, Any]] = []

    def raced(*args: Any) -> Any:
        rows = judged(*args)  # every step judged (root's, committed): now the window is open
        if not swaps:
            swaps.append(_as_nobody(_swapped_in(root, step2, theirs)))
        else:  # the second run: a link to their directory instead

            def link() -> dict[str, Any]:
                os.rename(root / step2, root / f"{step2}.moved-by-65534")
                (root / step2).symlink_to(theirs.name)
                return {"linked": step2}

            swaps.append(_as_nobody(link))
        return rows

    for run in range(2):
        if run:  # root's step 2 put back, their directory under its own name again
            os.rename(root / step2, theirs)
            os.rename(root / f"{step2}.moved-by-65534", root / step2)
        with mock.patch.object(verify_root, "checkpoint_rows", raced), measured() as figures:
            code, text = cli("verify", str(root))
        figures.within("safeio verify")
        assert code == 1, text
        assert any(
            step2 in line and "no longer a directory of uid 0" in line for line in text.splitlines()
        ), text
    assert swaps == [{"swapped": step2}, {"linked": step2}], swaps


@case
def r4case6_a_step_is_this_users_directory_not_only_its_marker(share: Share) -> None:
    """A root without the sticky bit, on a system that lets users hard-link others' files
    (``fs.protected_hardlinks=0``): uid 65534 linked root's marker of step 3 into a directory of its own,
    beside a ``weights.bin`` of its choosing at the size the marker lists, and put that directory under
    step 3's name once root had deleted its step 3. The marker is root's file, so judging the marker's
    owner alone took their directory for root's committed step 3, to resume from. (Only root can make the
    link here without changing the machine's sysctl: the link is the state that setting lets 65534 make.)"""
    root = share.share / "run"
    root.mkdir()
    root.chmod(0o777)
    ckpts = safeio.Checkpoints(root, keep=None, timeout=30)
    for step in (1, 2, 3):
        with ckpts.save(step) as ckpt:
            Path(ckpt.path, "weights.bin").write_text(f"root's step {step}")
    step3 = next(name for name in os.listdir(root) if name.endswith("3") and (root / name).is_dir())
    forged = "their weights"  # as long as "root's step 3"
    theirs = root / "theirs"

    def make() -> dict[str, Any]:
        theirs.mkdir()
        (theirs / "weights.bin").write_text(forged)
        return {"made": theirs.name}

    assert _as_nobody(make) == {"made": theirs.name}
    os.link(root / step3 / MANIFEST_NAME, theirs / MANIFEST_NAME)
    shutil.rmtree(root / step3)  # root deletes its step 3 (by hand, or a script's own rotation)
    assert _as_nobody(lambda: (theirs.rename(root / step3), {"moved": step3})[1]) == {"moved": step3}
    assert (root / step3).stat().st_uid == 65534 and (root / step3 / MANIFEST_NAME).stat().st_uid == 0
    # Judged by its marker and the marker's owner (as before): their directory is root's step 3.
    judged = LocalReader(Location(str(root / step3), str(root / step3)), follow=False)
    marker = judged.committed_marker()
    assert marker is not None and marker["step"] == 3 and judged.owner(marker) == 0, marker
    latest = ckpts.latest()
    assert latest is not None and latest.step == 2, f"latest() of {root} is {latest}: their directory"
    assert ckpts.steps() == [1, 2], ckpts.steps()


@case
def r4case7_remove_file_removes_only_the_entry_it_judged(share: Share) -> None:
    """``safeio.frameworks.remove_file`` (Lightning's ``remove_checkpoint`` under ``SafeCheckpointIO``) in
    a directory others can write without the sticky bit: once it had judged the checkpoint file, uid 65534
    renamed it away and root's ``data/`` tree to its name; then, with a link judged, root's own file.
    Before, what stood at the name was renamed aside and deleted: root's tree, then root's file."""
    ckpts = share.share / "ckpts"
    ckpts.mkdir()
    ckpts.chmod(0o777)
    data = _victims_tree(ckpts)
    kept = ckpts / "notes.txt"
    kept.write_text(DATA)
    (ckpts / "epoch=1.ckpt").write_text("the checkpoint of epoch 1")
    (ckpts / "last.ckpt").symlink_to("epoch=1.ckpt")
    judge = backends.lstat_at
    swaps: list[dict[str, Any]] = []

    def raced(dir_fd: int, name: str) -> os.stat_result | None:
        found = judge(dir_fd, name)  # judged: now the window is open
        mine = {"epoch=1.ckpt": data, "last.ckpt": kept}.get(name)
        if mine is not None:
            swaps.append(_as_nobody(_swapped_in(ckpts, name, mine)))
        return found

    with captured_warnings() as warnings, mock.patch.object(backends, "lstat_at", raced):
        remove_file(ckpts / "epoch=1.ckpt")
        remove_file(ckpts / "last.ckpt")
    assert swaps == [{"swapped": "epoch=1.ckpt"}, {"swapped": "last.ckpt"}], swaps
    assert (ckpts / "epoch=1.ckpt" / "corpus.txt").read_text() == DATA, "root's tree was removed"
    assert (ckpts / "last.ckpt").read_text() == DATA, "root's file was removed"
    assert len([w for w in warnings if "not removed" in w]) == 2, warnings


@case
def r4baseline_3_naive_verify_reads_the_directory_swapped_in(share: Share) -> None:
    """The naive way (the step verified by its path, as any promoted directory is) reads uid 65534's
    directory put in place of root's step 2 once it was judged, and finds it complete: their content
    passes for root's checkpoint (with a 1 TiB file listed, verify hashes for hours)."""
    root, step2 = _two_steps(share)
    theirs = _their_step(root, "theirs", 5)
    assert _as_nobody(_swapped_in(root, step2, theirs)) == {"swapped": step2}
    assert safeio.shares.Target(root / step2).verify() == []
    assert (root / step2 / MANIFEST_NAME).stat().st_uid == 65534


ROOT_ONLY.update(
    {
        "r4case1_retention_never_deletes_a_tree_swapped_in_under_a_retired_steps_name",
        "r4baseline_1_naive_retention_deletes_the_tree_swapped_in",
        "r4case2_a_step_is_read_where_it_was_judged_a_directory_never_through_a_link",
        "r4baseline_2_naive_reading_by_path_follows_the_link_swapped_in",
        "r4case3_an_audit_record_file_is_never_a_link_or_a_fifo_planted_under_its_name",
        "r4case4_the_audit_report_reads_only_regular_record_files_of_this_user",
        "r4case5_verify_of_a_root_never_reads_a_step_swapped_after_it_was_judged",
        "r4baseline_3_naive_verify_reads_the_directory_swapped_in",
        "r4case6_a_step_is_this_users_directory_not_only_its_marker",
        "r4case7_remove_file_removes_only_the_entry_it_judged",
    }
)
