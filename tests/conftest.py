"""Suite-wide setup: NIXL/UCX environment for a CPU-only machine (see nixl-on-cpu.md).

These must be set before the first NIXL agent of the process starts, so they live here and
not in a fixture.
"""

import compileall
import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MEM_EVENTS", "no")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

# The suite starts hundreds of Python processes (guards, workers, claimants) that import
# kvcr and these helpers. Where PYTHONDONTWRITEBYTECODE is set (CI's image sets it) none of
# them would write bytecode, so each compiled kvcr from source again (~0.15 s a process on
# a 2-core machine). Compile it once here; the files are __pycache__, which git ignores.
# (``uv sync`` compiles the dependencies: ``compile-bytecode`` in pyproject.toml.)
if sys.flags.dont_write_bytecode:
    _spec = importlib.util.find_spec("kvcr")
    for _where in (_spec.submodule_search_locations or []) if _spec else []:
        compileall.compile_dir(_where, quiet=2)
    compileall.compile_dir(Path(__file__).parent, maxlevels=0, quiet=2)

from hypothesis import settings

# Property tests run the same cases on every run (no flaky tests: a case that fails fails
# every time), and keep no example database in the repository. No per-example deadline:
# Hypothesis's default (200 ms) fails a case that only ran slowly, on a loaded 2-core
# machine (seen once in test_config while other suites ran beside it).
settings.register_profile("kvcr", derandomize=True, database=None, deadline=None)
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
