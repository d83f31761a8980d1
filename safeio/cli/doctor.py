"""``safeio doctor PATH``: can this filesystem hang a training job, and which safeio setting covers it?

The report has three parts: what the mount says (type and the options that matter), what live probes in
a scratch directory under PATH measure, and one verdict per risk naming the safeio setting that covers
it. The scratch directory is named like a safeio temporary sibling, so if doctor is killed mid-probe,
``safeio gc`` recognises and removes it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from safeio.cli import _probes
from safeio.cli._common import EXIT_OK, EXIT_PROBLEMS, CliError, existing_directory, print_json, write_error
from safeio.cli._fsinfo import FsInfo, inspect
from safeio.shares import remove_tree, temporary_name

DEFAULT_PROBE_TIMEOUT = 2.0


def add_parser(commands: Any, epilog: str) -> None:
    parser = commands.add_parser(
        "doctor",
        help="probe the filesystem holding PATH and say which risks apply and what covers them",
        description="Report the filesystem holding PATH (type and the mount options that matter: NFS "
        "version, hard/soft, locking, attribute caches, lookupcache; Lustre, GPFS, CIFS, FUSE, ...), run "
        "live probes in a scratch directory under PATH (removed afterwards): atomic rename, "
        "renameat2 exchange, exclusive create, flock and POSIX locks between two processes, fsync "
        "latency, and how fast a change reaches a second process; then give a verdict per risk with "
        "the safeio setting that covers it. Needs write permission in PATH.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "path", metavar="PATH", help="a directory on the filesystem to check (e.g. your checkpoint root)"
    )
    parser.add_argument(
        "--peer-path",
        metavar="DIR",
        help="the same directory as PATH seen through another mount (another client of the same "
        "share): the second process works there, so locks and cache staleness are measured across clients",
    )
    parser.add_argument(
        "--probe-timeout",
        metavar="SECONDS",
        type=float,
        default=DEFAULT_PROBE_TIMEOUT,
        help=f"how long to wait for a change to become visible (default {DEFAULT_PROBE_TIMEOUT:g})",
    )
    parser.add_argument("--json", action="store_true", help="print a machine-readable report")
    parser.set_defaults(run=run)


@dataclass
class Verdict:
    risk: str
    status: str  # "present", "possible", "absent"
    why: str
    covered_by: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def run(args: argparse.Namespace) -> int:
    path = existing_directory(args.path)
    peer_root = existing_directory(args.peer_path, what="--peer-path") if args.peer_path else None
    if not 0 < args.probe_timeout <= 60:
        raise CliError("--probe-timeout must be between 0 and 60 seconds")
    started = time.monotonic()
    info = inspect(path)
    probes = _run_probes(path, peer_root, args.probe_timeout)
    verdicts = judge(info, probes, cross_client=peer_root is not None)
    broken = [p for p in probes if p.status == "fail" and p.name in ("rename_over", "exclusive_create")]
    report = {
        "path": path,
        "peer_path": peer_root,
        "filesystem": info.to_dict(),
        "probes": [p.to_dict() for p in probes],
        "verdicts": [v.to_dict() for v in verdicts],
        "ok": not broken,
        "seconds": round(time.monotonic() - started, 3),
    }
    if args.json:
        print_json(report)
    else:
        _print(info, probes, verdicts, report)
    return EXIT_PROBLEMS if broken else EXIT_OK


def _run_probes(path: str, peer_root: str | None, timeout: float) -> list[_probes.Probe]:
    name = temporary_name("safeio-doctor")
    scratch = os.path.join(path, name)
    peer: _probes.Peer | None = None
    # The mkdir inside the clean-up's reach: a Ctrl-C delivered while it was blocked on a hung share
    # raised as it returned, and left the scratch directory behind.
    try:
        try:
            os.mkdir(scratch, 0o755)
        except OSError as exc:
            raise write_error(exc, path) from None
        peer_scratch = scratch if peer_root is None else os.path.join(peer_root, name)
        if peer_root is not None:
            _await_peer_view(peer_root, peer_scratch, path, timeout)
        try:
            peer = _probes.Peer(peer_scratch, timeout)
        except (OSError, _probes.PeerError) as exc:
            raise CliError(f"could not start the probe's second process: {exc}", EXIT_PROBLEMS) from None
        live = peer
        steps: list[tuple[str, Callable[[], _probes.Probe]]] = [
            ("rename_over", lambda: _probes.rename_over(scratch)),
            ("exchange", lambda: _probes.exchange(scratch)),
            ("exclusive_create", lambda: _probes.exclusive_create(scratch, live)),
            ("flock", lambda: _probes.lock_between(scratch, live, "flock")),
            ("posix", lambda: _probes.lock_between(scratch, live, "posix")),
            ("fsync", lambda: _probes.fsync_latency(scratch)),
            (
                "visibility",
                lambda: _probes.visibility(scratch, live, timeout, cross_client=peer_root is not None),
            ),
        ]
        results = []
        for name, step in steps:
            try:
                results.append(step())
            except (OSError, _probes.PeerError) as exc:
                # An I/O error of the filesystem under test is a finding, not a crash of doctor.
                results.append(_probes.Probe(name, name, "error", f"{type(exc).__name__}: {exc}"))
        return results
    finally:
        if peer is not None:
            peer.close()
        with contextlib.suppress(OSError):
            remove_tree(scratch, what="doctor scratch directory")


def _await_peer_view(peer_root: str, peer_scratch: str, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.isdir(peer_scratch):
        if time.monotonic() > deadline:
            raise CliError(
                f"--peer-path {peer_root} does not show the probe directory created in {path} within "
                f"{timeout:g} s: it must be the same directory seen through another mount"
            )
        time.sleep(0.005)  # polling interval; the deadline bounds the wait


def judge(info: FsInfo, probes: list[_probes.Probe], *, cross_client: bool) -> list[Verdict]:
    by_name = {p.name: p for p in probes}
    shared = info.is_network
    verdicts = [
        Verdict(
            "in-place writes by several ranks",
            "present" if shared else "possible",
            (
                "every rank's save_pretrained opens the same files with O_TRUNC; on a shared filesystem a "
                "truncation interlocks with other ranks' reads in the kernel (the 35-hour hang)"
                if shared
                else "on a local disk ranks do not hang, but readers can load half-written files"
            ),
            "safeio.save_pretrained(obj, path) or `with safeio.replicated(path) as stage:` (one writer, "
            "a private stage, rename into place); safeio.patch_save_pretrained() for code you do not own",
        ),
        _lock_verdict(info, by_name, cross_client),
        _cache_verdict(info, by_name.get("visibility"), cross_client),
        _exchange_verdict(by_name.get("exchange")),
    ]
    return verdicts


def _lock_verdict(info: FsInfo, probes: dict[str, _probes.Probe], cross_client: bool) -> Verdict:
    risk = "locks that do not exclude across clients"
    auto = "lock='auto' (the default) picks " + (
        "a lease lock here (SoftFileLease: an exclusive-create marker with a heartbeat)"
        if info.is_network
        else "flock here (local filesystem)"
    )
    failing = [
        p.title for p in (probes.get("flock"), probes.get("posix")) if p is not None and p.status != "ok"
    ]
    if failing:
        return Verdict(
            risk,
            "present",
            f"measured: {', '.join(failing)} did not exclude",
            f"{auto}; never force lock=True/'flock'",
        )
    if not info.is_network:
        return Verdict(
            risk, "absent", "a local filesystem has one client; locks excluded between two processes", auto
        )
    if cross_client:
        why = "measured across two mounts: flock and POSIX locks excluded (other clients may differ)"
        return Verdict(risk, "possible", why, auto)
    if info.lock_scope == "local":
        return Verdict(risk, "present", "the mount options make locks local to this client", auto)
    why = (
        "flock/POSIX locks here are only as good as the server and daemon; measured on this client only "
        "(pass --peer-path to measure across clients)"
    )
    return Verdict(risk, "possible", why, auto)


def _cache_verdict(info: FsInfo, probe: _probes.Probe | None, cross_client: bool) -> Verdict:
    risk = "stale-cache windows"
    cover = (
        "peers wait for the writer's published outcome, not for the filesystem, and every wait is bounded "
        "by timeout= (SAFEIO_TIMEOUT, default 1800 s); readers on other nodes: mode='versioned' and "
        "safeio.snapshot(path)"
    )
    if cross_client and probe is not None:
        worst = probe.seconds or 0.0
        if probe.data.get("stale_past_deadline"):
            return Verdict(
                risk, "present", f"measured: another client still saw old state after {worst:g} s", cover
            )
        if worst > 0.05:
            return Verdict(
                risk, "present", f"measured: another client saw changes after up to {worst:.2f} s", cover
            )
        return Verdict(
            risk, "absent", f"measured: another client saw every change within {worst * 1e3:.0f} ms", cover
        )
    if not info.is_network:
        return Verdict(risk, "absent", "one client: every process on this host shares one cache", cover)
    window = info.cache_window
    if window is not None and window > 0:
        why = f"from the mount settings: other clients may see stale names or sizes for up to {window:g} s"
        return Verdict(risk, "present", why, cover)
    return Verdict(
        risk,
        "possible",
        "cannot be observed from one client; pass --peer-path (another mount of PATH)",
        cover,
    )


def _exchange_verdict(probe: _probes.Probe | None) -> Verdict:
    risk = "no atomic directory exchange"
    cover = (
        "mode='versioned' (a symlink swapped in one rename: the name never disappears) for directories read "
        "while they are replaced; mode='merge' (save_pretrained's default) replaces file by file"
    )
    if probe is not None and probe.status == "ok":
        return Verdict(
            risk, "absent", "renameat2(RENAME_EXCHANGE) works: mode='replace' swaps in one step", cover
        )
    return Verdict(
        risk,
        "present",
        "mode='replace' renames the old version aside, then the new one in: a reader can find the name "
        "missing for an instant (never a partial directory)",
        cover,
    )


def _print(
    info: FsInfo, probes: list[_probes.Probe], verdicts: list[Verdict], report: dict[str, Any]
) -> None:
    print(f"safeio doctor: {info.path}")
    print("filesystem")
    print(f"  {'type':<30} {info.label} [{info.fs_type}] from {info.source}, mounted at {info.mount_point}")
    print(f"  {'shared (network) filesystem':<30} {'yes' if info.is_network else 'no'}")
    for key, value in info.settings.items():
        print(f"  {key:<30} {value}")
    print(f"  {'options':<30} {','.join(dict.fromkeys(info.options))}")
    for note in info.notes:
        print(_wrap(f"note: {note}", "  ", "        "))
    print("probes (in a scratch directory under PATH, removed afterwards)")
    marks = {"ok": "ok", "fail": "FAIL", "unsupported": "no", "error": "error", "info": "--"}
    for probe in probes:
        print(f"  [{marks.get(probe.status, probe.status):>5}] {probe.title:<45} {probe.detail}")
    print("risks")
    for verdict in verdicts:
        print(_wrap(f"[{verdict.status:>8}] {verdict.risk}: {verdict.why}", "  ", " " * 13))
        print(_wrap(f"covered by: {verdict.covered_by}", " " * 13, " " * 25))
    if not report["ok"]:
        print("FILESYSTEM UNSUITABLE: a guarantee safeio's promotion relies on failed (see FAIL above)")
    print(f"({report['seconds']:.1f} s)")


def _wrap(text: str, first: str, rest: str) -> str:
    return textwrap.fill(
        text, width=110, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False
    )
