"""G3 slot records from outside the process (files on disk that anything may have
scribbled on): they vouch for a slot's key and generation, or for nothing.

Read top to bottom: a record with any bytes changed decodes to itself or to nothing, never
to another key or generation; records mutated, moved or copied between slots in real G3
files never vouch for a slot the index did not put there; and a G3 tier on real NIXL
(POSIX backend) whose record area was damaged reads each block back byte-exact or not at
all.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import trio
from fuzzing import case, fuzz, open_fds
from hypothesis import given
from hypothesis import strategies as st

from g3_moves import read, store
from kvcr.g3.files import (
    PAGE,
    RECORD_SIZE,
    G3Files,
    Record,
    decode_record,
    encode_record,
    key_digest,
)
from kvcr.logs import get_logger
from kvcr.runtime.g3 import G3Tier
from kvcr.runtime.transfers import Transfers
from kvcr.transport.base import Segment
from kvcr.transport.nixl_files import NixlFileTransport

records = st.builds(
    Record,
    generation=st.integers(1, (1 << 64) - 1),
    digest=st.binary(min_size=16, max_size=16),
    data_crc=st.integers(0, (1 << 32) - 1),
)


@st.composite
def mutated_bytes(draw: st.DrawFn, raw: bytes) -> bytes:
    out = bytearray(raw)
    for _ in range(draw(st.integers(1, 6))):
        how = draw(st.sampled_from(["flip", "byte", "run", "cut", "shift"]))
        i = draw(st.integers(0, len(out) - 1)) if out else 0
        if how == "flip" and out:
            out[i] ^= 1 << draw(st.integers(0, 7))
        elif how == "byte" and out:
            out[i] = draw(st.integers(0, 255))
        elif how == "run":
            run = draw(st.binary(min_size=1, max_size=16))
            out[i : i + len(run)] = run
        elif how == "cut":
            del out[i:]
        else:
            out[:] = out[1:] + out[:1]
    return bytes(out[:RECORD_SIZE]).ljust(RECORD_SIZE, b"\0")


@fuzz(1500)
@given(record=records, data=st.data())
def test_a_mutated_record_decodes_to_itself_or_to_nothing(record, data) -> None:
    case("G3 record bytes")
    raw = encode_record(record)
    decoded = decode_record(data.draw(mutated_bytes(raw), "mutated"))
    assert decoded is None or decoded == record


BLOCK = PAGE
SLOTS = 8  # per file


@fuzz(300)
@given(data=st.data())
def test_records_mutated_moved_or_copied_never_vouch_for_another_key(
    tmp_path_factory, data
) -> None:
    case("G3 record bytes")
    directory = tmp_path_factory.mktemp("g3rec")
    g3 = G3Files((directory / "a.bin", directory / "b.bin"), SLOTS * BLOCK, BLOCK)
    try:
        expected = {s: (b"key-%d" % s, 1000 + s) for s in range(g3.capacity)}
        g3.write_records({s: Record(g, key_digest(k)) for s, (k, g) in expected.items()})
        for _ in range(data.draw(st.integers(1, 5))):
            f = data.draw(st.sampled_from(g3.files))
            at = RECORD_SIZE * data.draw(st.integers(0, SLOTS))  # header or a record
            how = data.draw(st.sampled_from(["mutate", "copy", "swap", "zero"]))
            if how == "mutate":
                raw = os.pread(f.fd, RECORD_SIZE, at)
                os.pwrite(f.fd, data.draw(mutated_bytes(raw)), at)
            elif how in ("copy", "swap"):  # a record from another slot (of either file)
                other = data.draw(st.sampled_from(g3.files))
                src = RECORD_SIZE * data.draw(st.integers(1, SLOTS))
                moved = os.pread(other.fd, RECORD_SIZE, src)
                if how == "swap":
                    os.pwrite(other.fd, os.pread(f.fd, RECORD_SIZE, at), src)
                os.pwrite(f.fd, moved, at)
            else:
                os.pwrite(f.fd, bytes(RECORD_SIZE), at)

        sound = g3.check_many(expected)

        # A slot is vouched for exactly while its record still says what the index put
        # there (bytes outside the record's fields, like its padding, do not matter); a
        # record copied from another slot names another key and generation, so never does.
        n = len(g3.files)
        for slot, (k, g) in expected.items():
            f, offset = g3.files[slot % n], RECORD_SIZE * (1 + slot // n)
            now = decode_record(os.pread(f.fd, RECORD_SIZE, offset))
            assert (slot in sound) == (now == Record(g, key_digest(k))), (slot, now)
    finally:
        g3.close()


# --- a tier on real NIXL --------------------------------------------------------------------

TIER_BLOCK = 64 * 1024
HOST = 4


async def _store_damage_read(directory: Path, damage: list[tuple[int, int, bytes]]) -> None:
    files = G3Files((directory / "a" / "g3", directory / "b" / "g3"), 2 * TIER_BLOCK, TIER_BLOCK)
    pool = np.random.default_rng(len(damage)).integers(0, 255, HOST * TIER_BLOCK, dtype=np.uint8)
    region = np.zeros(HOST * TIER_BLOCK, dtype=np.uint8)
    transport = NixlFileTransport(f"g3-fuzz-{os.getpid()}", "POSIX", {})
    try:
        transport.open(
            [
                Segment("pool", pool.ctypes.data, TIER_BLOCK, HOST),
                Segment("region", region.ctypes.data, TIER_BLOCK, HOST),
            ],
            [(f.fd, f.size) for f in files.files],
            files.slot_rows(),
        )
        log = get_logger("kvcr.test")
        transfers = Transfers(transport, log, fine=True, busy=True)
        tier = G3Tier(
            files=files,
            transport=transport,
            transfers=transfers,
            score=lambda block: 0.0,
            on_removed=lambda keys: None,
            log=log,
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(transfers.run)
            keys = [b"key-%d" % i for i in range(HOST)]
            assert await store(tier, [(k, i) for i, k in enumerate(keys)], "spill") == set(keys)
            slots = {k: tier.index.get(k).slots[0] for k in keys}
            for file_index, offset, raw in damage:
                os.pwrite(files.files[file_index].fd, raw, offset)

            got = await read(tier, [(k, HOST + i) for i, k in enumerate(keys)], "fill")

            for i, k in enumerate(keys):
                block = slice(i * TIER_BLOCK, (i + 1) * TIER_BLOCK)
                if k in got:  # a hit is the stored bytes, exactly
                    assert (region[block] == pool[block]).all(), k
                start = RECORD_SIZE * (1 + slots[k] // 2)  # its record, in file slot % 2
                touched = any(
                    f == slots[k] % 2 and at < start + RECORD_SIZE and start < at + len(raw)
                    for f, at, raw in damage
                )
                assert touched or k in got, k  # an untouched record still vouches
            nursery.cancel_scope.cancel()
    finally:
        transport.close()
        files.close()


@st.composite
def record_damage(draw: st.DrawFn) -> list[tuple[int, int, bytes]]:
    out = []
    for _ in range(draw(st.integers(1, 4))):
        record = draw(st.integers(0, 2))  # the file header, or one of the file's two records
        if draw(st.booleans()):  # another slot's record, or the other file's
            raw = encode_record(Record(draw(st.integers(1, 1 << 62)), key_digest(b"key-1")))
        else:
            raw = draw(st.binary(min_size=1, max_size=RECORD_SIZE))
        at = RECORD_SIZE * record + draw(st.integers(0, RECORD_SIZE - 1))
        out.append((draw(st.integers(0, 1)), at, raw))
    return out


@pytest.mark.integration
@fuzz(60)
@given(damage=record_damage())
def test_a_tier_over_damaged_records_reads_each_block_exactly_or_not_at_all(
    tmp_path_factory, damage
) -> None:
    case("G3 record bytes (NIXL tier)")
    directory = tmp_path_factory.mktemp("g3tier")
    before = open_fds()
    trio.run(_store_damage_read, directory, damage)
    assert open_fds() == before, "an example leaked file descriptors"
