"""A worker serves the blocks only its G3 holds to a peer's pull: read from the file into a
bounce slot, written with the pull's G2 blocks, counted, and the slot lent again only once
both are over. The G3 tier is real (files, NIXL's POSIX backend); the peers meet on the fake
fabric, in one trio loop (``peer_world.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcr.config import G3Options
from kvcr.logs import capture_events
from kvcr.runtime import bounce
from kvcr.types import CacheTier, QueryStatus
from peer_world import Worker, World, key

pytestmark = pytest.mark.integration

BLOCK = 4096
IN_G3 = (QueryStatus.FETCHABLE, CacheTier.G3)
HIT = (QueryStatus.HIT, CacheTier.LOCAL_G2)


def source(world: World, tmp_path: Path) -> Worker:
    g3 = G3Options(
        paths=(tmp_path / "d0" / "g3.bin", tmp_path / "d1" / "g3.bin"),
        capacity_bytes_per_file=4 * BLOCK,
    )
    return Worker(world, "a", g3=g3, pool_blocks=4)


async def spill(a: Worker) -> None:
    """Keys 0-7 deposited from elements 0-7 into a 4-block pool: 0-3 spill to G3."""
    for k in range(8):
        a.engine.write(k, seed=100 + k)
    for batch in (range(4), range(4, 8)):
        assert set((await a.deposit([(k, k) for k in batch])).values()) == {"SUCCESS"}
    assert a.kv.query([key(k) for k in range(8)]) == [IN_G3] * 4 + [HIT] * 4


def statuses(entries: dict) -> dict[int, str]:
    return {int.from_bytes(k, "big"): v.status.value for k, v in entries.items()}


async def test_a_pull_gets_g3_blocks_through_bounce_slots_byte_exact(tmp_path: Path) -> None:
    world = World()
    a, b = source(world, tmp_path), Worker(world, "b")
    async with a.running(), b.running():
        await spill(a)
        b.kv.submit_hint(b.hint(a, list(range(8))), request_id="r")

        entries = await b.deliver([(k, 10 + k) for k in range(8)])

        assert set(statuses(entries).values()) == {"SUCCESS"}
        for k in range(8):
            assert b.engine.checksum(10 + k) == a.engine.checksum(k)
        src = a.runtime.source
        assert (src.written_blocks, src.g3_blocks) == (8, 4)
        assert a.runtime.gauges()["source_g3_blocks"] == 4
        staging = src.staging
        assert staging.slots.count == 8  # G3 holds 8 blocks: no more bounce slots than that
        assert staging.slots.free == staging.slots.count  # all lent back
        assert a.kv.query([key(k) for k in range(8)]) == [IN_G3] * 4 + [HIT] * 4
        assert all(b.claims == 0 for b in a.runtime.g3.index.blocks())
        assert a.runtime.audit() == []


async def test_g3_keys_beyond_the_free_bounce_slots_are_misses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bounce, "BOUNCE_BYTES", 2 * BLOCK)
    world = World()
    a, b = source(world, tmp_path), Worker(world, "b")
    async with a.running(), b.running():
        await spill(a)
        b.kv.submit_hint(b.hint(a, [0, 1, 2, 3, 4]), request_id="r")

        with capture_events() as events:
            entries = await b.deliver([(k, 10 + k) for k in range(5)])

        # The first two G3 keys got the two slots; G2 keys never need one.
        assert statuses(entries) == {
            0: "SUCCESS",
            1: "SUCCESS",
            2: "FAILED",
            3: "FAILED",
            4: "SUCCESS",
        }
        for k in (0, 1, 4):
            assert b.engine.checksum(10 + k) == a.engine.checksum(k)
        [short] = [e for e in events if e["event"] == "bounce_slots_short"]
        assert (short["g3_keys"], short["lent"]) == (4, 2)
        staging = a.runtime.source.staging
        assert staging.short == 2 and staging.slots.free == staging.slots.count == 2
