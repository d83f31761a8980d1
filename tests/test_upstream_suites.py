"""Other projects' own test suites, run against safeio's drop-ins (issue 24: "drop-in means drop-in").

Each suite runs twice in a subprocess pytest of its own: plain, and with the drop-ins first on the path.
The outcomes are compared test by test; every difference must be listed, with its reason, in the docs
(the table after ``<!-- upstream differences: NAME -->``), and every listed one must still happen.

Here: python-atomicwrites' ``tests/test_atomicwrites.py`` (from its 1.4.1 source distribution, in
tests/upstream/atomicwrites) against atomicwrites and against ``atomic_write`` mapped onto
``safeio.atomic_open`` (tests/_dropins/atomicwrites).

Lightning's checkpoint tests are run the same way by ``scripts/upstream_suites.py --lightning CHECKOUT``, a
release check: Lightning ships no tests in its distributions, and a copy taken through this workplace's
search tool may not be committed (docs/development.md).
"""

from __future__ import annotations

from pathlib import Path

import atomicwrites  # noqa: F401  (a test dependency: missing, this file errors rather than skips)

import safeio
from tests import _upstream_suites as upstream

TESTS = Path(__file__).resolve().parent
OURS = (Path(safeio.__file__).resolve().parent, TESTS / "_dropins")


def _is_ours(described: str) -> bool:
    """Whether a probe's description (a module's file, or a class's ``module.qualname``) is safeio's or a
    drop-in's. Judged by place, not by the word: a checkout cloned into a directory named ``safeio`` has
    "safeio" in every path, the original module's too (the check failed in such a clone)."""
    path = Path(described)
    if path.is_absolute():
        return any(path.resolve().is_relative_to(ours) for ours in OURS)
    return described.startswith("safeio.") or "_dropins" in described


def _compare(suite: upstream.Suite, files: tuple[str, ...], tmp_path: Path, timeout: float) -> None:
    plain = upstream.run(suite, files, tmp_path, dropins=False, timeout=timeout)
    dropins = upstream.run(suite, files, tmp_path, dropins=True, timeout=timeout)
    print(f"{suite.name}: plain {plain.seconds:.1f} s, with the drop-ins {dropins.seconds:.1f} s")
    # The runs exercised what they say: the drop-ins in one, the originals in the other.
    for probe in suite.probes:
        assert not _is_ours(plain.probes[probe]), plain.probes
        assert _is_ours(dropins.probes[probe]), dropins.probes
    assert plain.outcomes, f"{suite.name}: the plain run ran no test:\n{plain.output[-3000:]}"
    problems = upstream.compare(suite, files, plain, dropins)
    assert not problems, "\n".join(problems)


def test_atomicwrites_suite_on_atomic_open(tmp_path: Path) -> None:
    _compare(upstream.ATOMICWRITES, upstream.ATOMICWRITES.files, tmp_path, timeout=120)
