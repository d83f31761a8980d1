"""The documented way out of torch's gloo teardown race (docs/troubleshooting.md, "A job that does not
exit"): the page shows the code our reproduction runs (tests/_exit_race.py), and with it the job exits.

The rates (with and without it, with and without safeio) are measured by scripts/exit_race.py, not here:
without the workaround about half of the 4-rank jobs abort at exit on this machine kind, so this test
fails on the reproduction without those lines in nearly every run.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests._bounds import PATIENT
from tests._exit_race import run_job
from tests._markdown_blocks import ROOT, all_blocks

PAGE = "docs/troubleshooting.md"
RUNS = 3
RANKS = 4


def _workaround_lines() -> list[str]:
    """The lines between the reproduction's workaround markers, as written."""
    lines = Path(ROOT, "tests", "_exit_race.py").read_text().splitlines()
    begin = next(i for i, line in enumerate(lines) if line.strip() == "# workaround: begin")
    end = next(i for i, line in enumerate(lines) if line.strip() == "# workaround: end")
    return textwrap.dedent("\n".join(lines[begin + 1 : end])).splitlines()


def test_the_page_shows_the_code_the_reproduction_runs() -> None:
    wanted = [line.strip() for line in _workaround_lines()]
    blocks = [b for b in all_blocks() if b.path == PAGE and "destroy_process_group()" in b.code]
    assert blocks, f"{PAGE} shows no workaround"
    for block in blocks:
        shown = [line.strip() for line in block.code.splitlines()]
        if any(shown[i : i + len(wanted)] == wanted for i in range(len(shown))):
            return
    raise AssertionError(f"no block of {PAGE} has these lines:\n" + "\n".join(wanted))


def test_with_the_workaround_the_job_exits(tmp_path: Path) -> None:
    for run in range(RUNS):
        work = tmp_path / f"run-{run}"
        work.mkdir()
        outcome = run_job(RANKS, work, "--workaround", bound=PATIENT)
        assert outcome.kind == "clean", (
            f"run {run}: {outcome.kind} (exit {outcome.code}):\n{outcome.output[-4000:]}"
        )
