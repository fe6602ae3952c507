"""Child of ``recovery.py`` (and ``scale.py``, ``fencing.py``): a worker over guard group 0
that deposits N blocks of 4 KiB, prints ``ready`` and waits (for its SIGKILL, or SIGSTOP).
Key ``k`` is element ``k % 1000`` of its region, whose bytes are
``common.randomized(4096 * 1000, seed=4096)``.

    python recovery_holder.py SOCKET PORT N DIGEST [BLOCK G3_FILE]

With ``BLOCK`` and ``G3_FILE`` its blocks are ``BLOCK`` bytes and it has a G3 tier of N / 2
blocks in that file: the second half of its deposits spills the first half there (the
group's pool holds N / 2). Key ``k`` is element ``k % (N / 2)`` of its region, whose bytes
are ``common.randomized(BLOCK * N / 2, seed=BLOCK)``, so a puller knows them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from common import Engine, randomized

from kvcr import KVCR, KVCRBindings
from kvcr.config import G3Options, KVCRBackendConfigs, KVCRConfig, KVCRGuardConfig
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.types import RegionDescriptor

BLOCK = 4096
ELEMENTS = 1000


def main() -> None:
    socket_path, port, n, digest = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    name = f"holder-{os.getpid()}"
    block, elements, g3 = BLOCK, ELEMENTS, None
    if len(sys.argv) > 6:
        block, elements = int(sys.argv[5]), n // 2
        g3 = G3Options(paths=(Path(sys.argv[6]),), capacity_bytes_per_file=block * elements)
        region = randomized(block * elements, seed=block)
    else:
        region = randomized(BLOCK * ELEMENTS, seed=BLOCK)
    channel = ZmqPeerControlChannel("127.0.0.1", port, "127.0.0.1")
    kv = KVCR(
        KVCRConfig(name, [("", block)], operation_timeout_ms=20_000, abandon_timeout_ms=40_000),
        KVCRBindings(
            request_pin=lambda keys: 0,
            poll_pin_results=list,
            release_pin=lambda handle: True,
            framework_control=channel,
        ),
        KVCRBackendConfigs(
            framework_regions=[
                RegionDescriptor(addr=region.ctypes.data, size=block, count=elements)
            ],
            g3=g3,
        ),
        KVCRGuardConfig(socket_path, 0, digest),
    )
    Engine(kv, name, cadence=0.001).fill(n, elements)  # keys 0..n-1, polled every 1 ms
    print("ready", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
