"""The soak in the default suite: a guard service and three workers in child processes run
random steps for about 20 s, with every claim, pin, slot, handle and resource accounted for
after each step and every delivered block checked byte for byte; its faults are SIGKILLed
workers, workers paused or stopped until fenced, and the service SIGKILLed and restarted
(see tests/soak.py; the long run is ``uv run nox -s soak -- --minutes N``)."""

from __future__ import annotations

import pytest

from soak import WEIGHTS, run

pytestmark = pytest.mark.integration

SECONDS = 20
SEED = 7


def test_a_short_soak_crashes_leaks_and_corrupts_nothing(tmp_path) -> None:
    summary = run(SECONDS, SEED, log=lambda line: None, directory=tmp_path)
    print(summary.line())
    assert summary.violations == 0
    # Every kind of step ran (the driver does each once before drawing by weight), and a
    # 20 s run on a slow machine still does sixty or more.
    assert set(summary.by_kind) == set(WEIGHTS)
    assert summary.steps >= 60
    assert summary.kills >= 2 and summary.fences >= 1 and summary.pauses >= 1
    assert summary.guard_restarts >= 1
    # Each death, by kill or by fence, is followed by exactly one restart of its group.
    assert summary.restarts == summary.kills + summary.fences
    assert summary.invariant_checks >= 30 * summary.steps  # some 50 per step
    assert summary.blocks_verified >= summary.steps
