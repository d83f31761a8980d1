"""pytest plugin for another project's suite run in a subprocess: every test's outcome, written as JSON.

Loaded with ``-p <this module> --outcomes-json PATH`` (tests/_upstream_suites.py copies it under a name
of its own: a suite's own ``tests`` package would hide this one); ``--outcomes-probe module:attribute``
(repeatable) also records what that name is in the run (its module and qualified name, or a module's
file), so the caller can check which implementation the suite really exercised.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest

# Worst first: a test's outcome is the worst of its setup, call and teardown reports.
_SEVERITY = ("error", "failed", "xpassed", "passed", "xfailed", "skipped")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--outcomes-json", help="write {nodeid: outcome} and the probes here")
    parser.addoption("--outcomes-probe", action="append", default=[], help="module:attribute to describe")


def _outcome(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.when != "call" and report.failed:
        return "error"
    return report.outcome


class _Recorder:
    def __init__(self, path: str, probes: list[str]) -> None:
        self.path = path
        self.probes = probes
        self.outcomes: dict[str, str] = {}
        self.messages: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        outcome = _outcome(report)
        # A setup or teardown that passed says nothing of the test; a skip at setup, or an error, does.
        if report.when == "call" or outcome != "passed":
            before = self.outcomes.get(report.nodeid)
            if before is None or _SEVERITY.index(outcome) < _SEVERITY.index(before):
                self.outcomes[report.nodeid] = outcome
        if report.failed:
            self.messages[report.nodeid] = str(report.longrepr)[-3000:]

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.outcomes[report.nodeid] = "error"
            self.messages[report.nodeid] = str(report.longrepr)[-3000:]

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        record: dict[str, Any] = {
            "outcomes": self.outcomes,
            "messages": self.messages,
            "probes": {probe: _describe(probe) for probe in self.probes},
        }
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1, sort_keys=True)


def _describe(probe: str) -> str:
    module_name, _, attribute = probe.partition(":")
    try:
        value: Any = importlib.import_module(module_name)
    except ImportError as exc:
        return f"not importable: {exc}"
    if not attribute:
        return str(getattr(value, "__file__", value))
    for part in attribute.split("."):
        value = getattr(value, part)
    described = f"{value.__module__}.{value.__qualname__}"
    if hasattr(value, "__wrapped__") and hasattr(value, "__code__"):
        # functools.wraps copies the name and module: the wrapper's own code says whose it is.
        described += f" (wrapped in {value.__code__.co_filename})"
    return described


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--outcomes-json")
    if path:
        config.pluginmanager.register(_Recorder(path, config.getoption("--outcomes-probe")), "outcomes")
