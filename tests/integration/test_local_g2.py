"""Local G2 on real NIXL: what an engine deposits is what it gets delivered back.

Every test runs a threaded KVCR instance with a real NIXL agent (UCX loopback), and drives it
from the test thread exactly as an engine adapter would.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine_sim import EngineSim, Recorder, key
from kvcr import KVCR
from kvcr.policy import FIFOPolicy, KVCachePolicy, LRUPolicy
from kvcr.types import (
    CacheTier,
    MemoryRef,
    OpEntryStatus,
    PlacementAction,
    QueryStatus,
)

pytestmark = pytest.mark.integration

HIT = (QueryStatus.HIT, CacheTier.LOCAL_G2)
MISS = (QueryStatus.MISS, None)


@pytest.fixture
def open_kvcr() -> Iterator[Any]:
    made: list[KVCR] = []

    def make(engine: EngineSim, recorder: Recorder | None = None, **bindings: Any) -> KVCR:
        recorder = recorder or Recorder()
        kv = KVCR(engine.config, recorder.bindings(**bindings), engine.backend_configs)
        made.append(kv)
        return kv

    yield make
    for kv in made:
        kv.close()


def deposit(engine: EngineSim, kv: KVCR, pairs: list[tuple[bytes, int]], **kw: Any) -> dict:
    handle = kv.deposit(engine.blocks(pairs), **kw)
    return engine.statuses(engine.wait(kv, handle, len(pairs)))


def deliver(engine: EngineSim, kv: KVCR, pairs: list[tuple[bytes, int]]) -> dict:
    handle = kv.deliver(engine.blocks(pairs))
    return engine.statuses(engine.wait(kv, handle, len(pairs)))


@pytest.mark.parametrize(
    ("layouts", "stride"),
    [
        ([("", 4096)], 0),
        ([("k", 4096), ("v", 8192)], 0),
        ([("kv", 4096)], 3 * 4096 + 64),
    ],
    ids=["single-pool", "multi-pool", "strided-region"],
)
def test_delivered_bytes_equal_deposited_bytes(open_kvcr, layouts, stride) -> None:
    engine = EngineSim(layouts=layouts, stride=stride, pool_blocks=8, region_blocks=16)
    kv = open_kvcr(engine)
    for element in range(4):
        engine.write(element, seed=element)
    sums = {element: engine.checksum(element) for element in range(4)}

    assert deposit(engine, kv, [(key(i), i) for i in range(4)]) == dict.fromkeys(
        [key(i) for i in range(4)], "SUCCESS"
    )
    assert kv.query([key(i) for i in range(5)]) == [HIT] * 4 + [MISS]

    # Deliver into other elements, in another order; the deposited source may be reused.
    for element in range(4):
        engine.clear(element)
    targets = [(key(3), 8), (key(0), 9), (key(2), 10), (key(1), 11)]
    assert set(deliver(engine, kv, targets).values()) == {"SUCCESS"}
    for k, element in targets:
        assert engine.checksum(element) == sums[int(k[1:])]


def test_deliver_of_missing_keys_is_a_partial_result(open_kvcr) -> None:
    engine = EngineSim()
    kv = open_kvcr(engine)
    engine.write(0, seed=7)
    deposit(engine, kv, [(key(0), 0)])

    result = deliver(engine, kv, [(key(0), 10), (key(1), 11)])

    assert result == {key(0): "SUCCESS", key(1): "FAILED"}
    assert engine.checksum(10) == engine.checksum(0)


def test_lru_evicts_least_recently_used_when_the_pool_is_full(open_kvcr) -> None:
    engine = EngineSim(pool_blocks=4)
    recorder = Recorder()
    kv = open_kvcr(engine, recorder, policy=LRUPolicy())
    for i in range(4):
        deposit(engine, kv, [(key(i), i)])
    deliver(engine, kv, [(key(0), 20)])  # key 0 becomes the most recently used

    assert deposit(engine, kv, [(key(4), 4), (key(5), 5)]) == {
        key(4): "SUCCESS",
        key(5): "SUCCESS",
    }

    assert kv.query([key(i) for i in range(6)]) == [HIT, MISS, MISS, HIT, HIT, HIT]
    assert recorder.inventory_keys(removed=True) == [key(1), key(2)]


def test_fifo_evicts_in_deposit_order_whatever_was_read(open_kvcr) -> None:
    engine = EngineSim(pool_blocks=4)
    kv = open_kvcr(engine, policy=FIFOPolicy())
    for i in range(4):
        deposit(engine, kv, [(key(i), i)])
    deliver(engine, kv, [(key(0), 20)])

    deposit(engine, kv, [(key(4), 4)])

    assert kv.query([key(i) for i in range(5)]) == [MISS, HIT, HIT, HIT, HIT]


def test_no_evict_blocks_survive_pressure_until_released(open_kvcr) -> None:
    engine = EngineSim(pool_blocks=2)
    recorder = Recorder()
    kv = open_kvcr(engine, recorder)
    handle = kv.deposit(engine.blocks([(key(0), 0), (key(1), 1)]), no_evict=True)
    entries = engine.wait(kv, handle, 2)
    handles = [entries[key(0)].release_handle, entries[key(1)].release_handle]
    assert None not in handles

    assert deposit(engine, kv, [(key(2), 2)]) == {key(2): "FAILED"}
    assert kv.query([key(0), key(1), key(2)]) == [HIT, HIT, MISS]
    assert recorder.capacity == [[("", 1)]]

    assert kv.release(handles[:1]) == [(handles[0], True)]
    assert kv.release(handles[:1]) == [(handles[0], False)]  # a handle works once
    assert deposit(engine, kv, [(key(2), 2)]) == {key(2): "SUCCESS"}
    assert kv.query([key(0), key(1), key(2)]) == [MISS, HIT, HIT]


def test_fetched_blocks_are_claimed_and_point_into_kvcr_memory(open_kvcr) -> None:
    engine = EngineSim(pool_blocks=2)
    kv = open_kvcr(engine)
    engine.write(0, seed=3)
    deposit(engine, kv, [(key(0), 0), (key(1), 1)])

    handle = kv.fetch([key(0), key(9)])
    entries = engine.wait(kv, handle, 2)

    assert entries[key(9)].status is OpEntryStatus.FAILED
    hit = entries[key(0)]
    assert hit.success
    (ref,) = hit.descriptors
    assert ref.end_point_name == engine.name and ref.label == ""
    slot = engine.pools[0][ref.element_index * 4096 : (ref.element_index + 1) * 4096]
    assert (slot == engine.view(0, 0)).all()
    # The claim holds the block through pressure; releasing it lets it go.
    assert deposit(engine, kv, [(key(2), 2)]) == {key(2): "SUCCESS"}
    assert kv.query([key(0), key(1)]) == [HIT, MISS]
    assert kv.release([hit.release_handle]) == [(hit.release_handle, True)]
    assert deposit(engine, kv, [(key(3), 3)]) == {key(3): "SUCCESS"}
    assert kv.query([key(0)]) == [MISS]


def test_capacity_callback_honours_the_low_watermark(open_kvcr) -> None:
    engine = EngineSim(pool_blocks=10, capacity_low_watermark_percent=20)
    recorder = Recorder()
    kv = open_kvcr(engine, recorder)
    handle = kv.deposit(engine.blocks([(key(i), i) for i in range(8)]), no_evict=True)
    engine.wait(kv, handle, 8)
    assert recorder.capacity == []  # 2 of 10 free: exactly the watermark

    assert deposit(engine, kv, [(key(8), 8)]) == {key(8): "SUCCESS"}

    assert recorder.capacity == [[("", 1)]]  # 1 free now, the watermark wants 2


def test_policy_drop_gives_dropped_and_stores_nothing(open_kvcr) -> None:
    class DropOdd(KVCachePolicy):
        def decide_ingest(
            self, meta, source, required_local, router_hints=None, framework_hints=None
        ):
            if meta.block_key[-1] % 2:
                return (PlacementAction.DROP, None)
            return super().decide_ingest(
                meta, source, required_local, router_hints, framework_hints
            )

    engine = EngineSim()
    kv = open_kvcr(engine, policy=DropOdd())

    assert deposit(engine, kv, [(key(0), 0), (key(1), 1)]) == {
        key(0): "SUCCESS",
        key(1): "DROPPED",
    }
    assert kv.query([key(0), key(1)]) == [HIT, MISS]


def test_deposit_of_a_resident_key_succeeds_without_copying(open_kvcr) -> None:
    engine = EngineSim()
    recorder = Recorder()
    kv = open_kvcr(engine, recorder)
    engine.write(0, seed=1)
    deposit(engine, kv, [(key(0), 0)])
    engine.write(1, seed=2)

    assert deposit(engine, kv, [(key(0), 1)]) == {key(0): "SUCCESS"}
    deliver(engine, kv, [(key(0), 5)])

    assert engine.checksum(5) == engine.checksum(0)  # the first copy is kept
    assert recorder.inventory_keys(removed=False) == [key(0)]


@pytest.mark.parametrize(
    ("make_refs", "message"),
    [
        (
            lambda e: [MemoryRef(end_point_name=e.name, label="nope", element_index=0)],
            "region 'nope'",
        ),
        (lambda e: [MemoryRef(end_point_name=e.name, element_index=32)], "out of range .*count 32"),
        (lambda e: [MemoryRef(end_point_name="other", element_index=0)], "agent 'other'"),
        (lambda e: [], "has 0 refs"),
        (lambda e: "ref", "must be a list"),
    ],
    ids=["unknown-label", "index-out-of-range", "foreign-agent", "refs-vs-layout", "not-a-list"],
)
def test_bad_refs_are_rejected_at_the_call_and_nothing_is_lost(
    open_kvcr, make_refs, message
) -> None:
    engine = EngineSim()
    kv = open_kvcr(engine)
    engine.write(0, seed=5)
    deposit(engine, kv, [(key(0), 0)])

    with pytest.raises(ValueError, match=f"deposit: key #1 .*{message}"):
        kv.deposit({key(1): engine.refs(1), key(2): make_refs(engine)})
    with pytest.raises(ValueError, match=f"deliver: key #0 .*{message}"):
        kv.deliver({key(0): make_refs(engine)})

    assert kv.query([key(0), key(1)]) == [HIT, MISS]
    deliver(engine, kv, [(key(0), 3)])
    assert engine.checksum(3) == engine.checksum(0)


def test_wrong_block_size_is_rejected_naming_region_and_pool(open_kvcr) -> None:
    engine = EngineSim(layouts=[("k", 4096), ("v", 8192)])
    kv = open_kvcr(engine)
    swapped = [
        MemoryRef(end_point_name=engine.name, label="v", element_index=0),
        MemoryRef(end_point_name=engine.name, label="k", element_index=0),
    ]
    with pytest.raises(ValueError, match="region 'v' has 8192-byte elements, pool 'k' has 4096"):
        kv.deposit({key(0): swapped})


def test_duplicate_keys_and_closed_instance_are_call_errors(open_kvcr) -> None:
    engine = EngineSim()
    kv = open_kvcr(engine)
    with pytest.raises(ValueError, match=r"fetch: key #2 .* appears twice"):
        kv.fetch([key(0), key(1), key(0)])

    kv.close()
    kv.close()  # idempotent
    for call in (
        lambda: kv.deposit({}),
        lambda: kv.query([key(0)]),
        lambda: kv.fetch([key(0)]),
        lambda: kv.deliver({}),
        lambda: kv.release([1]),
    ):
        with pytest.raises(ValueError, match="is closed"):
            call()
