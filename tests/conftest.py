"""Suite-wide setup: NIXL/UCX environment for a CPU-only machine (see nixl-on-cpu.md).

These must be set before the first NIXL agent of the process starts, so they live here and
not in a fixture.
"""

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MEM_EVENTS", "no")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
