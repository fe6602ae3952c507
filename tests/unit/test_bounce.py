"""Bounce slots: how many a runtime maps, where their descriptors are, and lending them."""

from __future__ import annotations

import pytest

from kvcr.runtime import bounce
from kvcr.runtime.bounce import BounceBuffer, BounceSlots, bounce_slot_count
from kvcr.runtime.memory import MemoryMap
from kvcr.types import RegionDescriptor


def test_a_runtime_maps_the_budget_but_no_more_slots_than_g3_holds() -> None:
    assert bounce_slot_count(1 << 20, 10_000) == bounce.BOUNCE_BYTES >> 20
    assert bounce_slot_count(4096, 8) == 8
    assert bounce_slot_count(bounce.BOUNCE_BYTES * 2, 8) == 1  # a huge block: still one


def test_bounce_descriptors_follow_the_pools_and_the_engine_regions() -> None:
    buffer = BounceBuffer(4096, 3)
    region = RegionDescriptor(addr=1 << 20, size=4096, count=5, label="kv")
    memory = MemoryMap("a", [("", 4096)], [("", 1 << 30, 4 * 4096)], [region], buffer)
    assert (memory.bounce_base, memory.bounce_slots) == (4 + 5, 3)
    assert memory.descriptor_count == 12
    assert memory.ranges([9, 11]) == [(buffer.addr, 4096), (buffer.addr + 2 * 4096, 4096)]
    assert buffer.addr % 4096 == 0


def test_a_bounce_buffer_needs_one_pool_of_its_block_size() -> None:
    with pytest.raises(ValueError, match="exactly one pool"):
        MemoryMap("a", [("", 8192)], [], [], BounceBuffer(4096, 1))
    with pytest.raises(ValueError, match="exactly one pool"):
        MemoryMap("a", [("x", 4096), ("y", 4096)], [], [], BounceBuffer(4096, 1))


def test_slots_are_lent_lowest_first_and_given_back_once() -> None:
    slots = BounceSlots(base=10, count=3)
    assert slots.take(2) == [10, 11]
    assert slots.take(5) == [12]  # what is left
    assert slots.take(1) == [] and slots.free == 0
    slots.give([10, 11])
    assert slots.free == 2 and slots.take(1) == [10]
    with pytest.raises(ValueError, match="not one of ours"):
        slots.give([13])
    slots.give([10, 12])
    with pytest.raises(ValueError, match="twice"):
        slots.give([12])
