"""The examples in examples/ run as documented (a user copies them first)."""

from __future__ import annotations

import re
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


def test_the_demo_verifies_every_block_and_measures_each_step_beside_raw_nixl() -> None:
    out = run_example("demo.py", "--blocks", "32")
    # Per pull step (from A, from A's guard, from A2): 2 one-block requests, 3 passes.
    assert "294 of 294 blocks verified against A's checksums" in out
    assert "A2 started warm with 32 of 32 blocks" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("step "))
    columns = re.split(r"\s{2,}", lines[header].strip())
    assert columns[3:6] == ["kvcr GB/s", "raw NIXL GB/s", "ratio"]
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[header + 2 : header + 6]]
    assert [row[0] for row in rows] == [
        "A: engine -> kvcr pool (deposit)",
        "B <- A (peer to peer)",
        "B <- A's guard (A dead)",
        "B <- A2 (A's replacement)",
    ]
    for row in rows:
        assert row[1:3] == ["64", "32"]  # the two steady passes: 64 blocks, 32 MiB
        kvcr, raw, ratio = map(float, row[3:6])
        assert kvcr > 0 and raw > 0 and ratio == pytest.approx(kvcr / raw, rel=0.05)
    assert out.rstrip().endswith("demo: OK")
