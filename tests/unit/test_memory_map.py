"""The memory map (kvcr.runtime.memory): engine refs resolved to descriptors on the engine's
thread, a bad ref named by its key's position whatever path checked it, and descriptors
turned back into the engine's own refs for a TransferError."""

from __future__ import annotations

import pytest

from kvcr.runtime.memory import MemoryMap
from kvcr.types import MemoryRef, RegionDescriptor

REGIONS = [
    RegionDescriptor(addr=0x10000, size=1024, count=8, label="a"),
    RegionDescriptor(addr=0x90000, size=1024, count=4, label="b"),
]


def one_pool() -> MemoryMap:
    return MemoryMap("agent-1", [("", 1024)], [("", 0x100000, 1024 * 16)], REGIONS)


def ref(label: str, index: object) -> MemoryRef:
    return MemoryRef(end_point_name="agent-1", label=label, element_index=index)  # type: ignore[arg-type]


def test_refs_resolve_to_descriptors_after_the_pool_slots_in_region_order() -> None:
    blocks = {b"k0": [ref("a", 0)], b"k1": (ref("b", 3),), b"k2": [ref("a", 7)]}
    assert one_pool().resolve_blocks("deliver", blocks) == {
        b"k0": (16,),  # 16 pool slots come first
        b"k1": (16 + 8 + 3,),
        b"k2": (16 + 7,),
    }


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (ref("a", 8), "element_index 8 is out of range for region 'a' \\(count 8\\)"),
        (ref("a", True), "element_index True is out of range"),
        (ref("zz", 0), "region 'zz' is not a registered framework region"),
        (MemoryRef(end_point_name="other", element_index=0), "agent 'other' is not this"),
    ],
)
def test_a_bad_ref_among_many_good_ones_is_named_by_its_key_position(
    bad: MemoryRef, message: str
) -> None:
    blocks: dict[bytes, list[MemoryRef]] = {b"%d" % i: [ref("a", i % 8)] for i in range(40)}
    blocks[b"bad"] = [bad]
    with pytest.raises(ValueError, match=f"deposit: key #40 ref 0.*{message}"):
        one_pool().resolve_blocks("deposit", blocks)


def test_a_key_that_is_not_bytes_is_named() -> None:
    with pytest.raises(ValueError, match="deliver: key #1 must be bytes, got str"):
        one_pool().resolve_blocks("deliver", {b"k": [ref("a", 0)], "k": [ref("a", 1)]})


def test_two_pools_take_one_ref_each() -> None:
    regions = [*REGIONS, RegionDescriptor(addr=0xA0000, size=512, count=4, label="c")]
    memory = MemoryMap(
        "agent-1", [("k", 1024), ("v", 512)], [("k", 0x1, 1024 * 4), ("v", 0x2, 512 * 4)], regions
    )
    assert memory.resolve_blocks("deposit", {b"x": [ref("a", 1), ref("c", 2)]}) == {
        b"x": (8 + 1, 8 + 8 + 4 + 2)
    }
    with pytest.raises(ValueError, match=r"key #0 .* has 1 refs, the pool layout"):
        memory.resolve_blocks("deposit", {b"x": [ref("a", 1)]})


def test_descriptors_turn_back_into_the_engine_refs_they_came_from() -> None:
    memory = one_pool()
    refs = [ref("b", 2), ref("a", 0), ref("a", 7), ref("b", 0)]
    descs = memory.resolve_blocks("deliver", {b"%d" % i: [r] for i, r in enumerate(refs)})
    assert memory.refs_of(d for (d,) in descs.values()) == tuple(refs)
