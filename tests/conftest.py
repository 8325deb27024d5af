"""Options shared by every test tier, and where a run's time goes: a line per test file as it
ends (so a run stopped at its deadline still shows it) and a table per tier at the end."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
_tier_seconds: defaultdict[str, float] = defaultdict(float)
_tier_counts: defaultdict[str, int] = defaultdict(int)
_file_seconds: defaultdict[str, float] = defaultdict(float)
_reporter: list[pytest.TerminalReporter] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite tests/golden/ from the current renderers instead of comparing",
    )


def _tier(report: pytest.TestReport) -> str:
    """The tier of a test: its top folder under tests/ (unit, chart, controlplane, ...)."""
    first = report.nodeid.split("::", 1)[0]
    parts = Path(first).parts
    if parts and parts[0] == "tests":
        parts = parts[1:]
    return parts[0] if len(parts) > 1 else "."


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        _reporter.append(reporter)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    result = yield
    if nextitem is None or nextitem.path != item.path:
        path = item.nodeid.split("::", 1)[0]
        if _reporter and _file_seconds[path] >= 1.0:
            _reporter[0].write_line(f" [time] {path} {_file_seconds[path]:.0f} s")
    return result


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # setup + call + teardown: a tier's test bed starts and stops in its fixtures.
    _tier_seconds[_tier(report)] += report.duration
    _file_seconds[report.nodeid.split("::", 1)[0]] += report.duration
    if report.when == "call" or (report.when == "setup" and report.skipped):
        _tier_counts[_tier(report)] += 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per tier: tests run and seconds spent (the README's table of tier times)."""
    if len(_tier_seconds) < 2:
        return
    terminalreporter.section("time per tier")
    for tier, seconds in sorted(_tier_seconds.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{tier:<14} {_tier_counts[tier]:>5} tests {seconds:>9.1f} s")
