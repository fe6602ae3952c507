"""Suite-wide setup: NIXL/UCX environment for a CPU-only machine (see nixl-on-cpu.md).

These must be set before the first NIXL agent of the process starts, so they live here and
not in a fixture.
"""

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MEM_EVENTS", "no")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from hypothesis import settings

# Property tests run the same cases on every run (no flaky tests: a case that fails fails
# every time), and keep no example database in the repository.
settings.register_profile("kvcr", derandomize=True, database=None)
settings.load_profile("kvcr")


import pytest  # noqa: E402

import engine_sim  # noqa: E402


@pytest.fixture(autouse=True)
def _engine_callbacks_keep_the_thread_rule():
    """Every test engine built on ``engine_sim.Recorder`` checks each callback it gets
    (contract section 4): on its own thread, inside a call it made into KVCR. A breach fails
    the test that caused it."""
    engine_sim.CALLBACK_CHECKS.clear()
    yield
    wrong = [w for check in engine_sim.CALLBACK_CHECKS for w in check.wrong]
    engine_sim.CALLBACK_CHECKS.clear()
    assert not wrong, f"engine callbacks broke the thread rule: {wrong[:5]}"
