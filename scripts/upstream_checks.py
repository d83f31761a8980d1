#!/usr/bin/env python3
"""A release check: transformers' own ``examples/pytorch/language-modeling/run_clm.py``, unmodified, under
``SAFEIO_PATCH=1`` and without it, side by side, the way tests/test_upstream_trl.py runs TRL's SFT script
(the same harness, tests/_upstream_jobs.py): 2 gloo ranks under torchrun, the output directory on the
NFS-like mount, rank 0 SIGKILLed while it writes ``checkpoint-4``, then a resume from the path
``get_last_checkpoint`` gives.

    .venv/bin/python scripts/upstream_checks.py --run-clm examples/pytorch/language-modeling/run_clm.py

run_clm.py is not kept in this repository, nor installed by transformers' wheel: take it from a checkout
of transformers at the installed version's tag. It imports ``evaluate`` (in the ``test`` extra). Needs
FUSE (fuse3). Prints what each side did; exits 1 when an expectation is not met (plain must fail on the
partial ``checkpoint-4``, the patched job must resume from ``checkpoint-2`` and exit 0), 2 when the
check cannot run here.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, os.fspath(ROOT))  # the harness lives beside the tests, as `tests._upstream_jobs`

from safeio.testing import hf_objects  # noqa: E402
from safeio.testing.nfslike import Mount, fuse_unavailable_reason  # noqa: E402
from tests._upstream_jobs import (  # noqa: E402
    LAUNCH,
    TRAINING,
    kill_mid_checkpoint_then_resume,
    lines_of_text,
    summary,
    unmet,
)


def run_clm_command(script: Path, where: Path) -> list[str]:
    """run_clm's offline inputs, as its README tells: a local config and tokenizer, a text file."""
    hf_objects.config().save_pretrained(where / "config")
    hf_objects.fast_tokenizer().save_pretrained(where / "tokenizer")
    (where / "train.txt").write_text("\n".join(lines_of_text()) + "\n")
    inputs = [
        "--model_type", "llama",
        "--config_name", os.fspath(where / "config"),
        "--tokenizer_name", os.fspath(where / "tokenizer"),
        "--train_file", os.fspath(where / "train.txt"),
        "--block_size", "8",
        "--do_train",
    ]  # fmt: skip
    return [*LAUNCH, os.fspath(script), *inputs, *TRAINING]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-clm", type=Path, required=True, help="path of transformers' run_clm.py")
    args = parser.parse_args(argv)
    if not args.run_clm.is_file():
        print(f"upstream_checks: {args.run_clm}: no such file", file=sys.stderr)
        return 2
    reason = fuse_unavailable_reason()
    if reason is not None:
        print(f"upstream_checks: the NFS-like mount is unavailable: {reason}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="safeio-upstream-", dir="/tmp"))
    work.chmod(0o755)
    (work / "backing").mkdir()
    command = run_clm_command(args.run_clm.resolve(), work)
    with Mount(work / "backing", work / "mnt", state_dir=work / "state", hazard_timeout=0.5) as mount:
        sides = kill_mid_checkpoint_then_resume(mount, work, command)
        print(f"run_clm.py: {summary(sides, mount)}")
        problems = unmet(sides, mount)
    for problem in problems:
        print(f"UNMET: {problem}", file=sys.stderr)
    print(f"logs and directories kept in {work}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
