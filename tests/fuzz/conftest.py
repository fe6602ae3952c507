"""The fuzz suite reports how many cases it ran per input kind."""

from __future__ import annotations

from fuzzing import CASES


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not CASES:
        return
    terminalreporter.section("fuzz cases per input kind")
    for kind, count in sorted(CASES.items()):
        terminalreporter.write_line(f"{kind:<28} {count:>8}")
    terminalreporter.write_line(f"{'total':<28} {sum(CASES.values()):>8}")
