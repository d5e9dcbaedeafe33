"""What nbval adds to pytest's report: each chapter's time, cells summed, in the order they ran.

The course's budget is 3 minutes a chapter on the 2-core CPU, and CI is where that is read: `--durations`
lists the slowest cells of all chapters together, this the total of each. A figure printed, not a timed
test: these machines drift by ±15 % and more between hours."""
from __future__ import annotations

from pathlib import Path

_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if report.nodeid.endswith(".ipynb") or ".ipynb::" in report.nodeid:
        chapter = Path(report.nodeid.split("::")[0]).stem
        _seconds[chapter] = _seconds.get(chapter, 0.0) + report.duration   # set-up, call and tear-down


def pytest_terminal_summary(terminalreporter):
    if not _seconds:
        return
    terminalreporter.section("chapter times under nbval (cells, set-up and tear-down; the budget is 3 min each)")
    for chapter, s in _seconds.items():
        terminalreporter.write_line(f"{chapter:32s} {s / 60:5.1f} min ({s:5.0f} s)")
