"""The G3 tier on real NIXL (POSIX backend) and real files: blocks stored from host memory
come back byte-exact, the lowest-scored go first when the files are full, and a damaged
file turns its keys into misses, never into wrong bytes."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import trio

from damage import KINDS
from damage import damage as damage_file
from g3_moves import read, store
from kvcr.g3.files import G3Files
from kvcr.logs import get_logger
from kvcr.runtime.g3 import FETCHABLE_G3, G3Tier
from kvcr.runtime.mirror import Mirror
from kvcr.runtime.transfers import Transfers
from kvcr.store import journal
from kvcr.store.index import BlockIndex
from kvcr.store.slots import SlotPool
from kvcr.transport.base import Segment
from kvcr.transport.nixl_files import NixlFileTransport

pytestmark = pytest.mark.integration

BLOCK = 64 * 1024
HOST = 8  # host descriptors 0..7: the "G2 pool"; 8..15: an engine region to read into


class World:
    def __init__(self, tmp_path: Path, slots_per_file: int = 4) -> None:
        self.files = G3Files(
            (tmp_path / "a" / "g3", tmp_path / "b" / "g3"), slots_per_file * BLOCK, BLOCK
        )
        self.pool = np.random.default_rng(7).integers(0, 255, HOST * BLOCK, dtype=np.uint8)
        self.region = np.zeros(HOST * BLOCK, dtype=np.uint8)
        self.transport = NixlFileTransport(f"g3-tier-{os.getpid()}-{id(self)}", "POSIX", {})
        self.transport.open(
            [
                Segment("pool", self.pool.ctypes.data, BLOCK, HOST),
                Segment("region", self.region.ctypes.data, BLOCK, HOST),
            ],
            [(f.fd, f.size) for f in self.files.files],
            self.files.slot_rows(),
        )
        self.removed: list[bytes] = []
        self.scores: dict[bytes, float] = {}
        self.transfers = Transfers(self.transport, get_logger("kvcr.test"), fine=True, busy=True)
        self.tier = G3Tier(
            files=self.files,
            transport=self.transport,
            transfers=self.transfers,
            score=lambda block: self.scores.get(block.key, 0.0),
            on_removed=self.removed.extend,
            log=get_logger("kvcr.test"),
        )

    def host(self, i: int) -> bytes:
        return self.pool[i * BLOCK : (i + 1) * BLOCK].tobytes()

    def read_back(self, i: int) -> bytes:
        return self.region[i * BLOCK : (i + 1) * BLOCK].tobytes()

    def close(self) -> None:
        self.transport.close()
        self.files.close()


@pytest.fixture
async def world(tmp_path) -> AsyncIterator[World]:
    w = World(tmp_path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(w.transfers.run)
        yield w
        nursery.cancel_scope.cancel()
    w.close()


def k(i: int) -> bytes:
    return b"key-%d" % i


async def test_stored_blocks_read_back_byte_exact(world) -> None:
    stored = await store(world.tier, [(k(i), i) for i in range(6)], "spill")
    assert stored == {k(i) for i in range(6)}
    assert all(world.tier.index.answer(k(i)) == FETCHABLE_G3 for i in range(6))

    got = await read(world.tier, [(k(i), HOST + i) for i in range(6)], "fill")

    assert got == stored
    assert all(world.read_back(i) == world.host(i) for i in range(6))
    assert await store(world.tier, [(k(0), 0)], "again") == set()  # already there


async def test_full_files_evict_the_lowest_scored_blocks(world) -> None:
    world.scores = {k(i): float(i) for i in range(8)}
    await store(world.tier, [(k(i), i) for i in range(8)], "fill up")  # 2 files x 4 slots
    world.scores[k(8)] = 100.0

    stored = await store(world.tier, [(k(8), 0), (k(9), 1)], "more")

    assert stored == {k(8), k(9)}
    assert world.removed == [k(0), k(1)]
    assert k(0) not in world.tier and k(2) in world.tier


async def test_a_slot_is_rewritten_only_once_the_journal_no_longer_names_its_old_key(
    world,
) -> None:
    """With a guard group's journal, a crash mid-store must not leave the journal naming
    the evicted key in a slot whose data is being overwritten (its record still vouches
    for it until the new record replaces it)."""
    buf = memoryview(bytearray(64 * 1024))
    index = BlockIndex([SlotPool("g2", BLOCK, 1)])
    world.tier.journal = Mirror(buf, index, {}, group=1, log=get_logger("kvcr.test"))
    world.scores = {k(i): float(i) for i in range(9)}
    await store(world.tier, [(k(i), i) for i in range(8)], "fill up")
    world.tier.journal.flush()
    assert set(journal.read(buf).g3) == {k(i) for i in range(8)}
    named_at_post: list[set[bytes]] = []
    post = world.transport.post

    def post_and_look(*args: object) -> object:
        named_at_post.append(set(journal.read(buf).g3))  # what a successor would find now
        return post(*args)

    world.transport.post = post_and_look

    assert await store(world.tier, [(k(8), 0)], "evicts key 0") == {k(8)}

    assert named_at_post == [{k(i) for i in range(1, 8)}]
    world.tier.journal.flush()
    assert journal.read(buf).g3[k(8)].values[0] == world.tier.index.get(k(8)).slots[0]


@pytest.mark.parametrize("damage", KINDS)
async def test_a_damaged_file_turns_its_keys_into_misses(world, damage) -> None:
    await store(world.tier, [(k(i), i) for i in range(4)], "spill")
    path = world.files.files[0].path  # holds the even slots: keys 0 and 2
    damage_file(path, damage)

    got = await read(world.tier, [(k(i), HOST + i) for i in range(4)], "fill")

    assert got == {k(1), k(3)}
    assert sorted(world.removed) == [k(0), k(2)]
    assert world.read_back(1) == world.host(1) and world.read_back(3) == world.host(3)
