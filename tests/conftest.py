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
