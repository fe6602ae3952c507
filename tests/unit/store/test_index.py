"""The block index: slots, records, claims and the lazy eviction queue (pure code)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcr.store.index import FETCHING, HIT, MISS, BlockIndex
from kvcr.store.records import BlockState
from kvcr.store.slots import SlotPool


def make_index(slots: int = 4, pools: int = 1) -> BlockIndex:
    return BlockIndex([SlotPool(f"p{i}", 4096, slots) for i in range(pools)])


def ready(index: BlockIndex, key: bytes, score: float):
    block = index.add_filling(key, now=0.0)
    index.commit(block, score)
    return block


def test_a_key_takes_one_slot_in_every_pool() -> None:
    index = make_index(slots=4, pools=3)
    block = index.add_filling(b"a", now=1.0)
    assert len(block.slots) == 3
    assert [p.free for p in index.pools] == [3, 3, 3]
    assert index.free_keys == 3


def test_view_follows_the_record_state() -> None:
    index = make_index()
    block = index.add_filling(b"a", now=0.0)
    assert index.answers([b"a"]) == [FETCHING]
    index.commit(block, 1.0)
    assert index.answers([b"a", b"b"]) == [HIT, MISS]
    assert block.state is BlockState.READY
    index.remove(block)
    assert b"a" not in index and index.answers([b"a"]) == [MISS]
    assert block.state is BlockState.GONE  # the view outlives its record, safely
    assert index.free_keys == 4


def test_a_detached_record_keeps_its_slots_until_released() -> None:
    index = make_index(slots=1)
    block = index.add_filling(b"a", now=0.0)
    index.detach(block)
    assert index.get(b"a") is None and index.answer(b"a") == MISS
    assert index.free_keys == 0  # quarantined: a transfer may still write the slot
    index.release_slots(block)
    assert index.free_keys == 1


def test_adding_a_key_twice_is_refused() -> None:
    index = make_index()
    index.add_filling(b"a", now=0.0)
    with pytest.raises(KeyError, match="already has a record"):
        index.add_filling(b"a", now=0.0)


def four_ready_a_claimed_e_filling() -> BlockIndex:
    """Blocks a, b, c, d ready with scores 1-4; a claimed; e still filling."""
    index = make_index(slots=8)
    for name, score in [(b"c", 3.0), (b"a", 1.0), (b"b", 2.0), (b"d", 4.0)]:
        ready(index, name, score)
    index.get(b"a").claims = 1
    index.add_filling(b"e", now=0.0)
    return index


def test_victims_come_lowest_score_first_and_skip_claimed_and_filling_blocks() -> None:
    index = four_ready_a_claimed_e_filling()

    order = [b.key for b in index.victims(lambda b: 0.0)]

    assert order == [b"b", b"c", b"d"]


def test_rescoring_moves_a_block_in_the_queue() -> None:
    index = make_index()
    ready(index, b"a", 1.0)
    ready(index, b"b", 2.0)
    index.rescore(index.get(b"a"), 5.0)
    assert [b.key for b in index.victims(lambda b: 0.0)] == [b"b", b"a"]


def test_blocks_not_removed_by_the_caller_stay_queued() -> None:
    index = make_index()
    ready(index, b"a", 1.0)
    ready(index, b"b", 2.0)
    victims = index.victims(lambda b: {b"a": 1.0, b"b": 2.0}[b.key])
    first = next(victims)
    victims.close()  # the caller kept it (policy said KEEP) and stopped
    assert first.key == b"a"
    assert [b.key for b in index.victims(lambda b: 0.0)] == [b"a", b"b"]


def test_claimed_blocks_leave_the_queue_until_whoever_unclaims_requeues_them() -> None:
    index = make_index()
    block = ready(index, b"a", 1.0)
    block.claims = 1
    assert list(index.victims(lambda b: 1.0)) == []
    assert block.queued is False  # no cost for it in later evictions
    block.claims = 0
    index.rescore(block, 1.0)
    assert [b.key for b in index.victims(lambda b: 1.0)] == [b"a"]


def test_evict_removes_the_lowest_scored_evictable_blocks_in_one_pass() -> None:
    index = four_ready_a_claimed_e_filling()

    evicted = index.evict(2)

    assert evicted == [b"b", b"c"]
    assert index.get(b"b") is None and b"c" not in index
    assert index.pools[0].free == 8 - 3  # a, d and e keep theirs
    assert index.get(b"a").queued is False  # claimed: out of the queue, as with victims
    assert index.evict(8) == [b"d"]


def test_a_batch_commits_at_once_in_score_order() -> None:
    index = make_index(slots=8)
    blocks = index.add_filling_batch([b"a", b"b", b"c"], now=0.0)

    index.commit_many(blocks, [3.0, 1.0, 2.0])

    assert all(b.state is BlockState.READY and index.answer(b.key) == HIT for b in blocks)
    assert [b.key for b in index.victims(lambda b: 0.0)] == [b"b", b"c", b"a"]


def test_a_deposit_fills_the_keys_its_lookup_found_absent_as_one_batch_of_arrays() -> None:
    index = make_index(slots=64, pools=2)
    ready(index, b"held", 1.0)
    keys = [b"held"] + [bytes([i]) * 8 for i in range(40)]
    found = index.lookup_to_fill(keys)
    assert found.held().tolist() == [True] + [False] * 40
    fill = index.add_fills(keys[1:], now=2.0, absent=found)
    assert fill.keys == keys[1:] and fill.slots.shape == (40, 2)
    assert index.answers(keys) == [HIT] + [FETCHING] * 40
    assert index.held(fill).all()
    index.commit_fills(fill, None)
    assert index.answers(keys) == [HIT] * 41 and index.audit()["double"] == 0
    assert [b.slots for b in fill.views()] == [tuple(row) for row in fill.slots.tolist()]


def test_keys_that_are_not_the_ones_a_lookup_found_absent_are_not_filed_by_it() -> None:
    index = make_index(slots=64)
    keys = [bytes([i]) * 8 for i in range(40)]
    found = index.lookup_to_fill(keys)
    with pytest.raises(ValueError, match="not the ones found absent"):
        index.add_fills(list(reversed(keys)), now=0.0, absent=found)
    assert index.free_keys == 64 and len(index) == 0  # nothing taken


def test_a_tier_can_publish_its_own_answers_and_nothing_while_filling() -> None:
    index = BlockIndex([SlotPool("g3", 4096, 4)], ready=FETCHING, filling=None)
    (block,) = index.add_filling_batch([b"a"], now=0.0)
    assert index.answer(b"a") == MISS  # not answerable until committed
    index.commit_many([block], [0.0])
    assert index.answer(b"a") == FETCHING
    index.remove(block)
    assert index.answer(b"a") == MISS


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdefgh"), st.floats(-1e6, 1e6)), max_size=60))
def test_victim_order_is_the_latest_score_of_each_live_block(updates) -> None:
    index = make_index(slots=8)
    latest: dict[bytes, float] = {}
    for name, score in updates:
        key = name.encode()
        block = index.get(key)
        if block is None:
            ready(index, key, score)
        else:
            index.rescore(block, score)
        latest[key] = score
    got = [(latest[b.key], b.key) for b in index.victims(lambda b: latest[b.key])]
    assert [k for _, k in got] == [k for _, k in sorted(got, key=lambda x: x[0])]
    assert {k for _, k in got} == set(latest)


def test_a_batch_gets_ascending_slots_so_nixl_can_merge_adjacent_descriptors() -> None:
    index = make_index(slots=8, pools=2)
    first = index.add_filling_batch([b"a", b"b", b"c", b"d"], now=0.0)
    for block in first[1:3]:
        index.remove(block)  # frees slots 1 and 2, pushed in that order

    batch = index.add_filling_batch([b"x", b"y", b"z"], now=0.0)

    assert [b.slots for b in batch] == [(1, 1), (2, 2), (4, 4)]


def test_audit_accounts_for_every_slot() -> None:
    index = make_index(slots=4, pools=2)
    a = ready(index, b"a", 1.0)
    index.add_filling(b"b", now=0.0)
    a.claims = 1
    assert index.audit() == {
        "blocks": 2,
        "filling": 1,
        "claims": 1,
        "free": 2,
        "quarantined": 0,
        "double": 0,
        "view_mismatch": 0,
        "queued": 1,
    }
    index.detach(a)  # withdrawn: its slots are nobody's until released
    assert index.audit()["quarantined"] == 2  # one per pool
    index.release_slots(a)
    assert index.audit()["quarantined"] == 0
    with pytest.raises(ValueError, match="slot 0 released twice"):
        index.pools[0].release(0)
    with pytest.raises(ValueError, match="not quarantined"):
        index.release_slots(a)  # a stale view frees nothing


def test_a_hundred_thousand_resident_blocks_give_the_collector_nothing_to_walk() -> None:
    import gc

    index = BlockIndex([SlotPool("p", 4096, 100_000)], score_is_recency=True)
    gc.collect()
    before = len(gc.get_objects())
    keys = [b"key-%08d" % i for i in range(100_000)]
    for first in range(0, 100_000, 1000):
        blocks = index.add_filling_batch(keys[first : first + 1000], now=float(first))
        index.commit_many(blocks, None)
    index.evict(500)  # the eviction queue's batch too
    del keys, blocks
    gc.collect()
    assert len(index) == 99_500
    assert len(gc.get_objects()) - before < 50  # per block: none
