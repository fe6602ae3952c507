"""Child of ``recovery.py``: a worker over guard group 0 that deposits N blocks of 4 KiB,
prints ``ready`` and waits (for its SIGKILL).

    python recovery_holder.py SOCKET PORT N DIGEST
"""

from __future__ import annotations

import os
import sys

import numpy as np
from common import Engine

from kvcr import KVCR, KVCRBindings
from kvcr.config import KVCRBackendConfigs, KVCRConfig, KVCRGuardConfig
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.types import RegionDescriptor

BLOCK = 4096
ELEMENTS = 1000


def main() -> None:
    socket_path, port, n, digest = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    name = f"holder-{os.getpid()}"
    region = np.random.randint(0, 255, BLOCK * ELEMENTS, dtype=np.uint8)
    channel = ZmqPeerControlChannel("127.0.0.1", port, "127.0.0.1")
    kv = KVCR(
        KVCRConfig(name, [("", BLOCK)]),
        KVCRBindings(
            request_pin=lambda keys: 0,
            poll_pin_results=list,
            release_pin=lambda handle: True,
            framework_control=channel,
        ),
        KVCRBackendConfigs(
            framework_regions=[
                RegionDescriptor(addr=region.ctypes.data, size=BLOCK, count=ELEMENTS)
            ]
        ),
        KVCRGuardConfig(socket_path, 0, digest),
    )
    Engine(kv, name, cadence=0.001).fill(n, ELEMENTS)  # keys 0..n-1, polled every 1 ms
    print("ready", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
