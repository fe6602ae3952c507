"""kvcr with a custom eviction policy, plugged in through ``KVCRBindings.policy``.

Many requests share a system prompt: its KV blocks are the first blocks of every sequence,
and they are worth more than any one user's tail. ``KeepPrefixPolicy`` keeps them: blocks
that ``align_sequence`` placed in the first ``PREFIX_BLOCKS`` positions of a sequence are
evicted only after every other block; among the rest, the least recently used goes first.

The pool holds 4 blocks. The script deposits a 2-block system prompt, aligns it as the
start of a sequence, then deposits 6 user blocks, one request after another: with kvcr's
default LRU policy the system prompt would be evicted first; with this policy it stays.

Run it with ``uv run python examples/custom_policy.py``.
"""

import os

# Set before importing kvcr: see examples/quickstart.py for what each does.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MEM_EVENTS", "no")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from collections.abc import Sequence

import numpy as np
from kvcr_workers import wait_for

from kvcr import KVCR, KVCRBindings
from kvcr.config import KVCRBackendConfigs, KVCRConfig, LocalDramOptions
from kvcr.policy import LRUPolicy
from kvcr.types import BlockMeta, CacheTier, MemoryRef, QueryStatus, RegionDescriptor

BLOCK_SIZE = 4096
ENGINE_BLOCKS = 16
POOL_BLOCKS = 4
PREFIX_BLOCKS = 2
AGENT = "policy-demo"


class KeepPrefixPolicy(LRUPolicy):
    """LRU, except that the first ``prefix`` blocks of an aligned sequence go last.

    kvcr calls the hooks from its runtime thread only, so the policy's own state needs no
    lock. ``eviction_score`` is taken again whenever a block's metadata changes (ingest,
    access, alignment): it must depend only on ``meta`` and on the policy's state.
    """

    PROTECTED = 1e18  # above any timestamp: protected blocks sort after every LRU score

    def __init__(self, prefix: int) -> None:
        self.prefix = prefix
        self.protected: set[bytes] = set()
        self.evicted: list[bytes] = []

    def on_align_sequence(self, blocks: Sequence[BlockMeta], use_current_time: bool) -> None:
        for meta in blocks:
            if 0 <= meta.position < self.prefix:
                self.protected.add(meta.block_key)

    def eviction_score(self, meta: BlockMeta, source: CacheTier) -> float:
        score = super().eviction_score(meta, source)
        return score + self.PROTECTED if meta.block_key in self.protected else score

    def on_remove(self, meta: BlockMeta) -> None:
        self.evicted.append(meta.block_key)
        self.protected.discard(meta.block_key)


def main() -> None:
    engine = np.random.randint(0, 255, BLOCK_SIZE * ENGINE_BLOCKS, dtype=np.uint8)
    pool = np.zeros(BLOCK_SIZE * POOL_BLOCKS, dtype=np.uint8)
    policy = KeepPrefixPolicy(PREFIX_BLOCKS)
    kv = KVCR(
        KVCRConfig(AGENT, [("", BLOCK_SIZE)]),
        KVCRBindings(
            request_pin=lambda keys: 0,  # no engine-memory pins in this example
            poll_pin_results=lambda: [],
            release_pin=lambda handle: True,
            policy=policy,
        ),
        KVCRBackendConfigs(
            framework_regions=[
                RegionDescriptor(addr=engine.ctypes.data, size=BLOCK_SIZE, count=ENGINE_BLOCKS)
            ],
            local_dram=LocalDramOptions([("", pool.ctypes.data, pool.nbytes)]),
        ),
    )

    def deposit(keys: list[bytes], first_block: int) -> None:
        blocks = {
            key: [MemoryRef(end_point_name=AGENT, element_index=first_block + i)]
            for i, key in enumerate(keys)
        }
        entries = wait_for(kv, kv.deposit(blocks), len(keys))
        assert all(entry.success for entry in entries.values()), entries

    try:
        system = [b"system-0", b"system-1"]
        deposit(system, first_block=0)
        kv.align_sequence(system)  # the engine says: these start a sequence, in this order
        for request in range(6):
            deposit([f"user-{request}".encode()], first_block=2 + request)

        resident = [
            key.decode()
            for key in [*system, *(f"user-{r}".encode() for r in range(6))]
            if kv.query([key])[0][0] is QueryStatus.HIT
        ]
        print("evicted, in order:", ", ".join(k.decode() for k in policy.evicted))
        print("resident:", ", ".join(resident))
        assert resident[:PREFIX_BLOCKS] == ["system-0", "system-1"], resident
        print("the system prompt survived every eviction")
    finally:
        kv.close()


if __name__ == "__main__":
    main()
