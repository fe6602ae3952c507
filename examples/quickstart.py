"""kvcr quickstart: the engine-adapter flow against the local G2 tier, on a CPU-only machine.

An "engine" array stands in for the inference engine's KV-cache memory (16 blocks of 4 KiB)
and a "pool" array is the host-DRAM pool kvcr owns (room for 8 blocks). The script
deposits four blocks into the pool, asks which keys kvcr holds, delivers them back into
other engine blocks, checks the bytes, and closes.

Run it with ``uv run python examples/quickstart.py``.
"""

import os

# NIXL/UCX read these when the first NIXL agent of the process starts, which happens when
# KVCR is constructed, and kvcr's transport imports NIXL at that point too. Set them before
# importing kvcr so that nothing can start an agent with other values:
#   UCX_NET_DEVICES=lo   UCX binds and advertises only loopback, not the external interface
#   UCX_MEM_EVENTS=no    the first UCX agent starts in ~0.04 s instead of ~0.4 s
#   NIXL_LOG_LEVEL=WARN  NIXL's Python logger would otherwise print INFO lines to stdout
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MEM_EVENTS", "no")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np
from kvcr_workers import wait_for  # poll_completed() until every entry of an operation arrived

from kvcr import KVCR, KVCRBindings
from kvcr.config import KVCRBackendConfigs, KVCRConfig, LocalDramOptions
from kvcr.types import MemoryRef, RegionDescriptor

BLOCK_SIZE = 4096  # bytes per KV block
ENGINE_BLOCKS = 16
POOL_BLOCKS = 8
AGENT = "w0"  # this worker's NIXL agent name; MemoryRefs to engine memory name it


def refs(keys: list[bytes], first_block: int) -> dict[bytes, list[MemoryRef]]:
    """Map each key to one engine block, starting at ``first_block``."""
    return {
        key: [MemoryRef(end_point_name=AGENT, element_index=first_block + i)]
        for i, key in enumerate(keys)
    }


def statuses(entries: dict) -> dict[int, str]:
    return {key[0]: entry.status.name for key, entry in sorted(entries.items())}


def main() -> None:
    engine = np.random.randint(0, 255, BLOCK_SIZE * ENGINE_BLOCKS, dtype=np.uint8)
    pool = np.zeros(BLOCK_SIZE * POOL_BLOCKS, dtype=np.uint8)

    # One pool; the empty name is allowed when it is the only one.
    config = KVCRConfig(AGENT, [("", BLOCK_SIZE)])
    # This example never asks the engine to pin its blocks, so the pin callbacks are stubs.
    bindings = KVCRBindings(
        request_pin=lambda keys: 0,
        poll_pin_results=lambda: [],
        release_pin=lambda handle: True,
    )
    backends = KVCRBackendConfigs(
        # The engine's memory: element i is block i, at addr + i * size.
        framework_regions=[
            RegionDescriptor(addr=engine.ctypes.data, size=BLOCK_SIZE, count=ENGINE_BLOCKS)
        ],
        # kvcr's own host-DRAM pool (local G2): (pool name, address, size in bytes).
        local_dram=LocalDramOptions([("", pool.ctypes.data, pool.nbytes)]),
    )

    kv = KVCR(config, bindings, backends)
    try:
        # Deposit engine blocks 0..3 under keys 0..3. Success means the engine may reuse them.
        keys = [bytes([i]) for i in range(4)]
        handle = kv.deposit(refs(keys, first_block=0))
        deposited = wait_for(kv, handle, len(keys))
        print("deposit:", statuses(deposited))

        # Query never blocks: (HIT, LOCAL_G2) for the four deposited keys, MISS for the rest.
        answers = kv.query([bytes([i]) for i in range(6)])
        for i, (status, tier) in enumerate(answers):
            print(f"query key {i}: {status.name} {tier.name if tier else ''}")

        # Deliver keys 0..4 into engine blocks 8..12. Key 4 was never deposited, so its entry
        # fails: a partial result (a present prefix, the rest missing) is normal.
        wanted = [bytes([i]) for i in range(5)]
        handle = kv.deliver(refs(wanted, first_block=8))
        delivered = wait_for(kv, handle, len(wanted))
        print("deliver:", statuses(delivered))

        def engine_block(i: int) -> np.ndarray:
            return engine[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]

        for i in range(4):
            assert delivered[bytes([i])].success
            assert np.array_equal(engine_block(i), engine_block(8 + i)), f"block {i} differs"
        print("delivered bytes match the deposited blocks")
    finally:
        # close() waits until no transfer can touch engine or pool memory any more: keep the
        # arrays alive until it returns.
        kv.close()


if __name__ == "__main__":
    main()
