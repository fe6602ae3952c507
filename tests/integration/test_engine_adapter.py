"""KVCR driven exactly the way vLLM's in-tree adapter drives it.

The adapter registers one ``RegionDescriptor`` over the engine's CPU KV buffer, addresses
blocks as ``MemoryRef(end_point_name=kvcr.config.nixl_agent_name, element_index=i)``, maps
its block hashes through a ``key_adapter``, listens to inventory events, and scrapes
telemetry through ``stats_factory`` and ``get_stats``.
"""

from __future__ import annotations

import hashlib
import time
import zlib

import numpy as np
import pytest

from engine_sim import router_hint
from kvcr import (
    DURATION_METRIC,
    KVCR,
    STATE_METRIC,
    TRANSFER_BLOCKS_METRIC,
    TRANSFER_BYTES_METRIC,
    KVCRBindings,
)
from kvcr.config import KVCRBackendConfigs, KVCRConfig, LocalDramOptions
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.telemetry import InMemoryStats
from kvcr.types import BlockKey, CacheTier, InventoryEvent, MemoryRef, QueryStatus, RegionDescriptor
from procs import free_port

pytestmark = pytest.mark.integration

BLOCK = 64 * 1024
ENGINE_BLOCKS = 64
POOL_BLOCKS = 32


class HashKeys:
    """Engine block hashes (ints) <-> kvcr keys (bytes), namespaced by model."""

    def encode(self, framework_key: int) -> BlockKey:
        return BlockKey(b"llama-8b/" + framework_key.to_bytes(8, "big"))

    def decode(self, key: BlockKey) -> int:
        return int.from_bytes(key[-8:], "big")


class Adapter:
    """The slice of an engine adapter that talks to kvcr."""

    def __init__(self) -> None:
        self.kv_cache = np.zeros(ENGINE_BLOCKS * BLOCK, dtype=np.uint8)
        self.pool = np.zeros(POOL_BLOCKS * BLOCK, dtype=np.uint8)
        self.inventory: list[InventoryEvent] = []
        self.keys = HashKeys()
        config = KVCRConfig("vllm-worker-0", [("", BLOCK)], enable_telemetry=True)
        # The peer control channel, as vLLM's adapter creates it (an ephemeral port here).
        self.channel = ZmqPeerControlChannel("127.0.0.1", free_port(), "127.0.0.1")
        bindings = KVCRBindings(
            request_pin=lambda keys: 0,
            poll_pin_results=lambda: [],
            release_pin=lambda handle: True,
            framework_control=self.channel,
            key_adapter=self.keys,
            inventory_sink=self.inventory.append,
            stats_factory=InMemoryStats,
        )
        backends = KVCRBackendConfigs(
            framework_regions=[
                RegionDescriptor(addr=self.kv_cache.ctypes.data, size=BLOCK, count=ENGINE_BLOCKS)
            ],
            local_dram=LocalDramOptions([("", self.pool.ctypes.data, self.pool.nbytes)]),
        )
        self.kvcr = KVCR(config, bindings, backends)
        self.completed: dict[int, dict] = {}

    def ref(self, block_id: int) -> list[MemoryRef]:
        return [MemoryRef(end_point_name=self.kvcr.config.nixl_agent_name, element_index=block_id)]

    def block(self, block_id: int) -> np.ndarray:
        return self.kv_cache[block_id * BLOCK : (block_id + 1) * BLOCK]

    def wait(self, handle: int, count: int) -> dict:
        deadline = time.monotonic() + 10
        while len(self.completed.get(handle, {})) < count:
            assert time.monotonic() < deadline, f"op {handle} did not complete"
            for h, entries in self.kvcr.poll_completed():
                self.completed.setdefault(h, {}).update(entries)
            time.sleep(0.0005)
        return self.completed.pop(handle)


@pytest.fixture
def adapter():
    a = Adapter()
    yield a
    a.kvcr.close()
    a.channel.close()


def test_offload_then_load_a_prefix_like_the_vllm_adapter(adapter: Adapter) -> None:
    hashes = [int.from_bytes(hashlib.sha256(b"%d" % i).digest()[:8], "big") for i in range(8)]
    keys = [adapter.keys.encode(h) for h in hashes]
    rng = np.random.default_rng(0)
    for block_id in range(8):
        adapter.block(block_id)[:] = rng.integers(0, 256, BLOCK, dtype=np.uint8)
    sums = [zlib.crc32(adapter.block(b).tobytes()) for b in range(8)]

    # Offload: the engine stores computed blocks after a request finishes.
    assert adapter.kvcr.query(keys) == [(QueryStatus.MISS, None)] * 8
    handle = adapter.kvcr.deposit({k: adapter.ref(b) for b, k in enumerate(keys)})
    assert all(e.success for e in adapter.wait(handle, 8).values())
    assert adapter.inventory == [InventoryEvent(tuple(keys), CacheTier.LOCAL_G2, False)]
    adapter.kvcr.align_sequence(keys)

    # Load: a new request with the same prefix finds it and loads it into free blocks.
    lookup = adapter.kvcr.query(keys)
    hits = len([s for s in lookup if s == (QueryStatus.HIT, CacheTier.LOCAL_G2)])
    assert hits == 8
    handle = adapter.kvcr.deliver({k: adapter.ref(32 + b) for b, k in enumerate(keys)})
    assert all(e.success for e in adapter.wait(handle, 8).values())
    assert [zlib.crc32(adapter.block(32 + b).tobytes()) for b in range(8)] == sums

    # Telemetry: bytes and blocks agree with the block geometry.
    stats = adapter.kvcr.get_stats()
    assert isinstance(stats, InMemoryStats)
    counters = stats.counters
    assert counters[(TRANSFER_BLOCKS_METRIC, ("local_fill",))] == 8
    assert counters[(TRANSFER_BYTES_METRIC, ("local_fill",))] == 8 * BLOCK
    assert counters[(TRANSFER_BLOCKS_METRIC, ("local_deliver",))] == 8
    assert counters[(TRANSFER_BYTES_METRIC, ("local_deliver",))] == 8 * BLOCK
    durations = stats.histograms[(DURATION_METRIC, ("local_fill", "success"))]
    assert len(durations) == 1 and 0 < durations[0] < 10
    assert stats.gauges[(STATE_METRIC, ("local_g2_blocks",))] == 8
    assert stats.gauges[(STATE_METRIC, ("local_g2_used_bytes",))] == 8 * BLOCK
    assert stats.gauges[(STATE_METRIC, ("local_g2_capacity_bytes",))] == POOL_BLOCKS * BLOCK

    # Each get_stats starts a fresh interval.
    fresh = adapter.kvcr.get_stats()
    assert fresh is not stats and not fresh.counters and not fresh.histograms


def test_telemetry_disabled_changes_nothing_but_get_stats(adapter: Adapter) -> None:
    adapter.kvcr.close()
    pool = np.zeros(4 * BLOCK, dtype=np.uint8)
    engine = np.zeros(4 * BLOCK, dtype=np.uint8)
    kv = KVCR(
        KVCRConfig("no-telemetry", [("", BLOCK)]),
        KVCRBindings(lambda k: 0, lambda: [], lambda h: True, stats_factory=InMemoryStats),
        KVCRBackendConfigs(
            framework_regions=[RegionDescriptor(addr=engine.ctypes.data, size=BLOCK, count=4)],
            local_dram=LocalDramOptions([("", pool.ctypes.data, pool.nbytes)]),
        ),
    )
    try:
        handle = kv.deposit({b"a": [MemoryRef(end_point_name="no-telemetry", element_index=0)]})
        deadline = time.monotonic() + 10
        results: list = []
        while not results and time.monotonic() < deadline:
            results = kv.poll_completed()
        assert results == [(handle, {b"a": results[0][1][b"a"]})]
        assert results[0][1][b"a"].success
        assert kv.get_stats() is None
    finally:
        kv.close()


def test_a_router_hint_makes_covered_keys_fetchable_for_its_request(adapter: Adapter) -> None:
    kv = adapter.kvcr
    keys = [adapter.keys.encode(h) for h in (11, 12, 13)]
    handle = kv.deposit({keys[0]: adapter.ref(0)})
    adapter.wait(handle, 1)

    kv.submit_hint(router_hint("tcp://127.0.0.1:5555", [11, 12]), request_id="req-1")

    local, remote, miss = (
        (QueryStatus.HIT, CacheTier.LOCAL_G2),
        (
            QueryStatus.FETCHABLE,
            CacheTier.REMOTE_G2,
        ),
        (QueryStatus.MISS, None),
    )
    assert kv.query(keys, request_id="req-1") == [local, remote, miss]
    assert kv.query(keys, request_id="other") == [local, miss, miss]
    assert kv.query(keys) == [local, miss, miss]

    with pytest.raises(ValueError, match=r"submit_hint: .*block_hashes"):
        kv.submit_hint(router_hint("tcp://127.0.0.1:5555", []), request_id="req-1")
    assert kv.query(keys, request_id="req-1") == [local, remote, miss]  # earlier hint kept

    kv.discard_hint("req-1")
    assert kv.query(keys, request_id="req-1") == [local, miss, miss]
