"""The examples in examples/ run as documented (a user copies them first)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, *args: str) -> str:
    """Run ``examples/<name>`` as a user would; its stdout, once it exited cleanly."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_quickstart_runs_and_verifies_its_bytes() -> None:
    assert "delivered bytes match the deposited blocks" in run_example("quickstart.py")


def test_guard_quickstart_runs_over_the_guards_pools_and_gives_them_back() -> None:
    out = run_example("guard_quickstart.py")
    assert "deposited into the guard's pool: True" in out
    tables = out.split("group  state")
    assert "0      held" in tables[1] and "0      idle" in tables[2]


def test_custom_policy_keeps_the_aligned_system_prompt_resident() -> None:
    out = run_example("custom_policy.py")
    assert "evicted, in order: user-0, user-1, user-2, user-3" in out
    assert "resident: system-0, system-1, user-4, user-5" in out


def test_two_workers_share_a_prefix_through_a_router_hint() -> None:
    out = run_example("two_workers.py")
    assert "B without a hint: {'MISS'}" in out
    assert "B with the router's hint to A: {'SUCCESS'}" in out
    assert "B's blocks have A's checksums: True" in out


def test_guard_recovery_serves_a_killed_workers_blocks_and_starts_its_replacement_warm() -> None:
    out = run_example("guard_recovery.py")
    assert "B pulled the prefix again, from A's guard: {'SUCCESS'}" in out
    assert "warm: 16 of 16 prefix blocks are local hits" in out
    assert "every copy has A's checksums" in out


def test_the_demo_verifies_every_block_it_moves_and_says_ok() -> None:
    out = run_example("demo.py", "--blocks", "32")
    assert "96 of 96 blocks verified against A's checksums" in out
    assert "A2 started warm with 32 of 32 blocks" in out
    assert out.rstrip().endswith("demo: OK")
