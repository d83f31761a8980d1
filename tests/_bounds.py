"""Time bounds in tests, by one rule (issue 37): a bound that load can exceed is not a test's subject.

- Where a test asserts an outcome (a save reaches every rank, a peer is told the writer's error), every
  wait on the way is bounded generously: a loaded CI runner (2 cores, load average 15-20) made 20-30 s
  bounds expire and tests fail that had nothing to do with time. A generous bound costs nothing when the
  test passes; when the code under test hangs, the test still fails, later.
- Where the timeout itself is the subject (a peer gives up on a writer that never finishes), it stays
  short, and the test is written so that load can only lengthen what it measures: it asserts the lower
  bound exactly, and an upper one only as far as needed to tell "ended by its own timeout" from "ended
  by something else", which the test arranges to come much later.

docs/development.md lists the tests that are sensitive to load and why they are not flaky.
"""

from __future__ import annotations

PATIENT = 600.0  # seconds: a peer's timeout, a join, a subprocess, where the test asserts an outcome
RUN = 1200.0  # seconds: a whole multi-rank run (run_ranks), a job under torchrun
