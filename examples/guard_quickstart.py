"""A worker whose pools live in the guard service's shared memory.

    uv run python examples/guard_quickstart.py

It starts `kvcr-guard` with two pool groups in a temporary directory (in production the
service runs on its own, before any worker), then runs a KVCR over group 0: the pools come
from the service, and so does the control endpoint, which the service keeps bound when the
worker goes away. `kvcr-guard status` shows who holds what before and after.
"""

import os

# Set before importing kvcr: see examples/quickstart.py for what each does.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MEM_EVENTS", "no")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import tempfile
from pathlib import Path

import numpy as np
from kvcr_workers import DIGEST, Guard, free_port, wait_for

from kvcr import KVCR, KVCRBindings
from kvcr.config import KVCRBackendConfigs, KVCRConfig, KVCRGuardConfig
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.types import MemoryRef, RegionDescriptor

BLOCK_SIZE = 64 * 1024

with tempfile.TemporaryDirectory() as tmp:
    guard = Guard(Path(tmp), groups=2, size_gb=0.0625)  # 64 MiB per group
    try:
        engine = np.random.randint(0, 255, BLOCK_SIZE * 8, dtype=np.uint8)
        # The group's control endpoint: a fixed port per group in production; any free one here.
        channel = ZmqPeerControlChannel("127.0.0.1", free_port(), "127.0.0.1")
        kv = KVCR(
            KVCRConfig("guarded-w0", [("", BLOCK_SIZE)]),
            KVCRBindings(
                request_pin=lambda keys: 0,
                poll_pin_results=lambda: [],
                release_pin=lambda handle: True,
                framework_control=channel,  # adopts the listener the service bound
            ),
            KVCRBackendConfigs(  # no local_dram: the pools come from the guard
                framework_regions=[
                    RegionDescriptor(addr=engine.ctypes.data, size=BLOCK_SIZE, count=8)
                ],
            ),
            KVCRGuardConfig(guard.socket_path, guard_index=0, compatibility_digest=DIGEST),
        )
        try:
            keys = [bytes([i]) for i in range(4)]
            handle = kv.deposit(
                {
                    k: [MemoryRef(end_point_name="guarded-w0", element_index=i)]
                    for i, k in enumerate(keys)
                }
            )
            entries = wait_for(kv, handle, len(keys))
            print("deposited into the guard's pool:", all(e.success for e in entries.values()))
            print(guard.status_table())
        finally:
            kv.close()  # gives the group back
            channel.close()
        print(guard.status_table())
    finally:
        guard.stop()
