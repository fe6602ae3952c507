"""The recovery journal's bytes: header slots, frames and entries, and their encoding. Pure
code.

Layout::

    [header slot 0 (64 B)][header slot 1 (64 B)] ... [half 0][half 1]     (halves 8-aligned)

A header slot is ``magic, version, counter, epoch, active half, half size, crc32``; the valid
slot with the highest counter wins, and a new header always goes to the *other* slot, so a
torn header write leaves the previous one in force. The active half holds frames::

    magic u32 | length u32 | epoch u64 | seq u64 | payload (length bytes) | crc32 u32 | pad to 8

The first frame of a half has seq 0 and every frame must carry the header's epoch and the
next seq; the crc covers everything before it. Frames of an older epoch left further on in
a reused half therefore end the replay.

Payload entries: ``op u8 | key length u16 | key | count u8 | count x u64``: ``op`` 1 puts the
key in G2 slots (one per pool), 2 removes it from G2, 3 puts it in G3 (the values say
where), 5 removes it from G3; a key can be in both tiers at once. A
batch of same-shaped changes is one entry: ``4 u8 | op u8 | n u32 | key length u16 | count
u8 | n keys | n x count x u64`` (joined keys and one array of values: no per-key framing, so
that publishing a deposit of hundreds of blocks costs little more than one entry).
"""

from __future__ import annotations

import array
import itertools
import struct
import sys
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from kvcr.types import RecoveryMirrorError

HEADER_MAGIC = 0x4B564A48  # "KVJH"
FRAME_MAGIC = 0x4B564A46  # "KVJF"
VERSION = 1
NO_HALF = 0xFFFFFFFF  # recovery disabled
HEADER = struct.Struct("<IIQQIIQ")  # magic, version, counter, epoch, active, pad, half size
HEADER_SLOT = 64
DATA_START = 2 * HEADER_SLOT
FRAME_HEAD = struct.Struct("<IIQQ")  # magic, payload length, epoch, seq
CRC = struct.Struct("<I")
ENTRY_HEAD = struct.Struct("<BH")
PUT_G2, REMOVE, PUT_G3, BATCH, REMOVE_G3 = 1, 2, 3, 4, 5
OPS = (PUT_G2, REMOVE, PUT_G3, REMOVE_G3)
REMOVALS = (REMOVE, REMOVE_G3)
BATCH_HEAD = struct.Struct("<BBIHB")  # BATCH, op, n, key length, values per key
MAX_KEY = 0xFFFF
MAX_VALUES = 0xFF


class JournalError(ValueError):
    """A journal buffer that cannot hold a journal at all (too small)."""


# The keys of one entry: a list of bytes, or a batch's keys in place (a numpy array of "void"
# items of one length; ``.tolist()`` makes them bytes), so that a replay into a block index
# makes no object per key.
Keys = list[bytes] | np.ndarray


def listed(keys: Keys) -> list[bytes]:
    """``keys`` as bytes objects."""
    return keys.tolist() if isinstance(keys, np.ndarray) else keys


@attrs.frozen
class Position:
    """Where a journal stands after its last whole frame: a writer can resume there."""

    counter: int  # of the header in force
    epoch: int
    active: int
    used: int  # bytes of the active half in use
    frames: int  # the next frame's seq


Entry = tuple[int, bytes, tuple[int, ...]]  # (op, key, values)


def align8(n: int) -> int:
    return (n + 7) & ~7


ENTRY_STRUCTS: dict[tuple[int, int], struct.Struct] = {}


def entry_struct(key_len: int, count: int) -> struct.Struct:
    """The packing of one entry with a key of ``key_len`` bytes and ``count`` values."""
    if not 0 <= key_len <= MAX_KEY or not 0 <= count <= MAX_VALUES:
        raise RecoveryMirrorError(
            f"recovery journal: an entry with a {key_len}-byte key and {count} values cannot "
            f"be described (at most {MAX_KEY} bytes and {MAX_VALUES} values)"
        )
    entry = ENTRY_STRUCTS[(key_len, count)] = struct.Struct(f"<BH{key_len}sB{count}Q")
    return entry


def encode_entries(entries: Iterable[Entry]) -> bytes:
    """Entries as one payload; those the journal cannot describe are left out (they were
    refused when first put, so they are not in the journal anyway)."""
    out = bytearray()
    for op, key, values in entries:
        shape = (len(key), len(values))
        entry = ENTRY_STRUCTS.get(shape)
        if entry is None:
            try:
                entry = entry_struct(*shape)
            except RecoveryMirrorError:
                continue
        out += entry.pack(op, shape[0], key, shape[1], *values)
    return bytes(out)


def encode_snapshot(entries: Iterable[Entry]) -> bytes:
    """The live state as one payload of batch entries, one per shape (op, key length,
    values): ~8 bytes a key smaller than one entry each, and a snapshot's entries are all
    puts of distinct (tier, key) pairs, so their order does not matter."""
    shapes: dict[tuple[int, int, int], tuple[list[bytes], list[tuple[int, ...]]]] = {}
    for op, key, values in entries:
        keys, vals = shapes.setdefault((op, len(key), len(values)), ([], []))
        keys.append(key)
        vals.append(values)
    out = bytearray()
    for (op, _, _), (keys, vals) in shapes.items():
        batch = encode_batch(op, keys, vals)
        out += batch if batch is not None else encode_entries(zip([op] * len(keys), keys, vals))
    return bytes(out)


# Sizing: the keys engines give (content hashes: 8-32 bytes); a longer key still works, but
# a full group of them may not fit a snapshot (recovery is then disabled, and logged).
SIZING_KEY_BYTES = 32
G3_VALUES = 2  # a G3 entry's values: file slot, generation


def snapshot_bytes(g2_keys: int, pools: int, g3_keys: int = 0) -> int:
    """The most a snapshot of ``g2_keys`` keys in G2 (one slot in each of ``pools``) and
    ``g3_keys`` in G3 takes, at keys of ``SIZING_KEY_BYTES``."""
    g2 = g2_keys * (SIZING_KEY_BYTES + 8 * pools)
    g3 = g3_keys * (SIZING_KEY_BYTES + 8 * G3_VALUES)
    return g2 + g3 + 2 * BATCH_HEAD.size + FRAME_HEAD.size + CRC.size + 8


def half_bytes(journal_bytes: int) -> int:
    """What one half of a journal region of ``journal_bytes`` holds: a snapshot must fit."""
    return _layout(journal_bytes)


Change = tuple[int, Keys, Sequence[int], int]  # op, keys, values (flat), count


def decode_payload(payload: bytes | memoryview) -> list[Change] | None:
    """One frame's entries, or None if it is malformed."""
    changes: list[Change] = []
    pos, end = 0, len(payload)
    while pos < end:
        if payload[pos] == BATCH:
            pos = _read_batch(payload, pos, end, changes)
            if pos < 0:
                return None
            continue
        if pos + ENTRY_HEAD.size > end:
            return None
        op, klen = ENTRY_HEAD.unpack_from(payload, pos)
        pos += ENTRY_HEAD.size
        if op not in OPS or pos + klen + 1 > end:
            return None
        key = bytes(payload[pos : pos + klen])
        count = payload[pos + klen]
        pos += klen + 1
        if pos + 8 * count > end:
            return None
        changes.append((op, [key], struct.unpack_from(f"<{count}Q", payload, pos), count))
        pos += 8 * count
    return changes


def _read_batch(payload: bytes | memoryview, pos: int, end: int, out: list[Change]) -> int:
    """Decode the batch entry at ``pos`` into ``out``; the next position, or -1."""
    if pos + BATCH_HEAD.size > end:
        return -1
    _, op, n, klen, count = BATCH_HEAD.unpack_from(payload, pos)
    pos += BATCH_HEAD.size
    keys_end = pos + n * klen
    values_end: int = keys_end + 8 * n * count
    if op not in OPS or (op in REMOVALS) != (count == 0) or values_end > end:
        return -1
    if klen == 0 and count == 0:
        # n removals of the empty key take no bytes at all, so n is bounded by nothing the
        # frame holds: they are one removal (applying it n times changes nothing more).
        n = min(n, 1)
    # Keys in place, as numpy "void" items of klen bytes (bytes objects only on demand).
    keys: Keys = np.frombuffer(payload, f"V{klen}", n, pos).copy() if klen else [b""] * n
    values = array.array("Q", bytes(payload[keys_end:values_end]))
    if sys.byteorder != "little":
        values.byteswap()
    out.append((op, keys, values, count))
    return values_end


def encode_batch(
    op: int, keys: Sequence[bytes], values: Sequence[tuple[int, ...]] | np.ndarray | None
) -> bytes | None:
    """One batch entry for ``keys`` (and their ``values``, or an array of keys x values;
    None for removals), or None if they do not share one shape (then encode them one by
    one)."""
    n = len(keys)
    klens = set(map(len, keys))
    if isinstance(values, np.ndarray):
        if len(klens) != 1 or values.ndim != 2 or len(values) != n:
            return None
        (klen,), count = klens, values.shape[1]
        if klen > MAX_KEY or count > MAX_VALUES or (op in REMOVALS) != (count == 0):
            return None
        head = BATCH_HEAD.pack(BATCH, op, n, klen, count)
        return head + b"".join(keys) + values.astype("<u8", copy=False).tobytes()
    counts = {0} if values is None else set(map(len, values))
    if len(klens) != 1 or len(counts) != 1:
        return None
    (klen,), (count,) = klens, counts
    if klen > MAX_KEY or count > MAX_VALUES or (op in REMOVALS) != (count == 0):
        return None
    flat: Iterable[int]
    if values is None:
        flat = ()
    elif count == 1:
        flat = [v[0] for v in values]
    else:
        flat = itertools.chain(*values)
    packed = array.array("Q", flat)
    if sys.byteorder != "little":
        packed.byteswap()
    return BATCH_HEAD.pack(BATCH, op, n, klen, count) + b"".join(keys) + packed.tobytes()


def encode_flat(op: int, keys: Sequence[bytes], flat: Any, count: int) -> bytes:
    """Entries putting ``keys`` at ``count`` values each (``flat``: all of them, a sequence
    or a numpy array), batched per key length (one batch when the lengths agree)."""
    values = np.asarray(flat, dtype="<u8").reshape(len(keys), count)
    lengths = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
    out = bytearray()
    for klen in np.unique(lengths).tolist():
        rows = np.flatnonzero(lengths == klen)
        part = keys if len(rows) == len(keys) else [keys[i] for i in rows.tolist()]
        if klen > MAX_KEY or count > MAX_VALUES:
            continue  # refused when first put: not in the journal anyway
        head = BATCH_HEAD.pack(BATCH, op, len(part), klen, count)
        out += head + b"".join(part) + values[rows].tobytes()
    return bytes(out)


def _layout(size: int) -> int:
    half = ((size - DATA_START) // 2) & ~7
    if half < 4096:
        raise JournalError(f"journal region of {size} bytes is too small (at least 8 KiB)")
    return half


def read_header(buf: memoryview) -> tuple[int, int, int, int] | None:
    """(counter, epoch, active half, half size) of the valid header slot with the highest
    counter, or None if neither slot is valid."""
    best = None
    for slot in range(2):
        off = slot * HEADER_SLOT
        fields = HEADER.unpack_from(buf, off)
        (crc,) = CRC.unpack_from(buf, off + HEADER.size)
        if fields[0] != HEADER_MAGIC or fields[1] != VERSION:
            continue
        if zlib.crc32(buf[off : off + HEADER.size]) != crc:
            continue
        counter, epoch, active, _, half = fields[2], fields[3], fields[4], fields[5], fields[6]
        if best is None or counter > best[0]:
            best = (counter, epoch, active, half)
    return best
