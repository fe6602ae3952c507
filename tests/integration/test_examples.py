"""The examples in examples/ run as documented (a user copies them first)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_quickstart_runs_and_verifies_its_bytes() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "delivered bytes match the deposited blocks" in done.stdout


def test_guard_quickstart_runs_over_the_guards_pools_and_gives_them_back() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "guard_quickstart.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "deposited into the guard's pool: True" in done.stdout
    tables = done.stdout.split("group  state")
    assert "0      held" in tables[1] and "0      idle" in tables[2]
