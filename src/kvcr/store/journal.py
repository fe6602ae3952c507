"""The recovery journal: committed residency changes of one pool group, in its mapping.

Pure code over a writable buffer (the group's 100 MiB journal region, or a bytearray in
tests). One process writes (the worker holding the group); anyone may read, also while it
writes, and after it died at any instruction. A reader recovers exactly the frames that were
whole when it looked: a torn, partial, bit-flipped or stale frame ends the replay and is
never misread.

Layout::

    [header slot 0 (64 B)][header slot 1 (64 B)] ... [half 0][half 1]     (halves 8-aligned)

A header slot is ``magic, version, counter, epoch, active half, half size, crc32``; the valid
slot with the highest counter wins, and a new header always goes to the *other* slot, so a
torn header write leaves the previous one in force. The active half holds frames::

    magic u32 | length u32 | epoch u64 | seq u64 | payload (length bytes) | crc32 u32 | pad to 8

The first frame of a half has seq 0 and every frame must carry the header's epoch and the
next seq; the crc covers everything before it. Frames of an older epoch left further on in
a reused half therefore end the replay.

Compaction: when a frame does not fit in the active half, the writer writes a snapshot of
the live state into the other half under a new epoch, then switches the header. A crash
before the switch leaves the old half and epoch in force; after it, the new ones. If even
the snapshot does not fit, recovery is disabled (a header with no active half) until the
state shrinks enough for a snapshot to fit again.

A reader replays into a :class:`State` (a dict of residencies by default; a worker's or the
guard's block index, with no object per key). A writer whose live state is exactly what a
reader replayed may *resume* at the reader's :class:`Position` (after the last whole frame,
same epoch and header) instead of starting with a snapshot: a warm start then writes
nothing of the state it recovered.

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
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, cast

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


@attrs.frozen
class Residency:
    """Where a committed key lives: ``tier`` PUT_G2 (``values`` = one slot per pool) or
    PUT_G3 (``values`` = its place in the file tier)."""

    tier: int
    values: tuple[int, ...]


# The keys of one entry: a list of bytes, or a batch's keys in place (a numpy array of "void"
# items of one length; ``.tolist()`` makes them bytes), so that a replay into a block index
# makes no object per key.
Keys = list[bytes] | np.ndarray


def listed(keys: Keys) -> list[bytes]:
    """``keys`` as bytes objects."""
    return keys.tolist() if isinstance(keys, np.ndarray) else keys


class State(Protocol):
    """Where a reader applies replayed changes (each call: one entry of one frame)."""

    def put(self, tier: int, keys: Keys, values: Sequence[int], count: int) -> None:
        """``keys`` put in ``tier`` (PUT_G2 or PUT_G3) at ``count`` values each (flat)."""

    def remove(self, op: int, keys: Keys) -> None:
        """``keys`` removed by ``op`` (REMOVE or REMOVE_G3)."""

    def __len__(self) -> int:
        """How many keys are in G2."""


class DictState(dict[bytes, Residency]):
    """Replayed state as a dict of G2 residencies, and ``g3`` beside it: for ``status``,
    tests and tools. A worker replays into its block index instead (no object per key)."""

    def __init__(self) -> None:
        super().__init__()
        self.g3: dict[bytes, Residency] = {}

    def put(self, tier: int, keys: Keys, values: Sequence[int], count: int) -> None:
        into = self.g3 if tier == PUT_G3 else self
        for i, key in enumerate(listed(keys)):
            into[key] = Residency(tier, tuple(values[i * count : (i + 1) * count]))

    def remove(self, op: int, keys: Keys) -> None:
        into = self.g3 if op == REMOVE_G3 else self
        for key in listed(keys):
            into.pop(key, None)

    def snapshot(self) -> DictState:
        copy = DictState()
        copy.update(self)
        copy.g3.update(self.g3)
        return copy


@attrs.frozen
class Position:
    """Where a journal stands after its last whole frame: a writer can resume there."""

    counter: int  # of the header in force
    epoch: int
    active: int
    used: int  # bytes of the active half in use
    frames: int  # the next frame's seq


@attrs.frozen
class Replay:
    """What a reader recovered: the committed state, and how it got it."""

    state: Any  # the State replayed into (a DictState unless the reader chose)
    epoch: int
    frames: int
    used: int  # bytes of the active half in use
    half_size: int
    disabled: bool
    start: int = DATA_START  # offset of the active half in the buffer
    position: Position | None = None  # None: no frame can be appended (no valid header)

    @property
    def g3(self) -> dict[bytes, Residency]:
        """The G3 residencies (of a DictState)."""
        g3: dict[bytes, Residency] = getattr(self.state, "g3", {})
        return g3


def _align8(n: int) -> int:
    return (n + 7) & ~7


_ENTRIES: dict[tuple[int, int], struct.Struct] = {}


def _entry_struct(key_len: int, count: int) -> struct.Struct:
    """The packing of one entry with a key of ``key_len`` bytes and ``count`` values."""
    if not 0 <= key_len <= MAX_KEY or not 0 <= count <= MAX_VALUES:
        raise RecoveryMirrorError(
            f"recovery journal: an entry with a {key_len}-byte key and {count} values cannot "
            f"be described (at most {MAX_KEY} bytes and {MAX_VALUES} values)"
        )
    entry = _ENTRIES[(key_len, count)] = struct.Struct(f"<BH{key_len}sB{count}Q")
    return entry


def encode_entries(entries: Iterable[tuple[int, bytes, tuple[int, ...]]]) -> bytes:
    """Entries as one payload; those the journal cannot describe are left out (they were
    refused when first put, so they are not in the journal anyway)."""
    out = bytearray()
    for op, key, values in entries:
        shape = (len(key), len(values))
        entry = _ENTRIES.get(shape)
        if entry is None:
            try:
                entry = _entry_struct(*shape)
            except RecoveryMirrorError:
                continue
        out += entry.pack(op, shape[0], key, shape[1], *values)
    return bytes(out)


def encode_snapshot(entries: Iterable[tuple[int, bytes, tuple[int, ...]]]) -> bytes:
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


def apply_payload(state: State, payload: bytes | memoryview) -> bool:
    """Apply one frame's entries to ``state``; False (and ``state`` untouched) if it is
    malformed."""
    changes = _decode_payload(payload)
    if changes is None:
        return False
    for change in changes:
        _apply(state, change)
    return True


def _decode_payload(payload: bytes | memoryview) -> list[Change] | None:
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


def _apply(state: State, change: Change) -> None:
    op, keys, flat, count = change
    if op in REMOVALS:
        state.remove(op, keys)
    else:
        state.put(op, keys, flat, count)


class _Puts:
    """Consecutive batch puts of one shape (op, key length, values per key), across frames,
    applied as one: a warm start over a journal of a thousand deposits' frames is then one
    bulk insert. Anything else is applied in order, after what is held."""

    def __init__(self, state: State) -> None:
        self._state = state
        self._shape: tuple[int, int, Any] | None = None
        self._keys: list[np.ndarray] = []
        self._values = array.array("Q")

    def add(self, change: Change) -> None:
        op, keys, flat, count = change
        if op in REMOVALS or not isinstance(keys, np.ndarray):
            self.flush()
            _apply(self._state, change)
            return
        shape = (op, count, keys.dtype)
        if shape != self._shape:
            self.flush()
            self._shape = shape
        self._keys.append(keys)
        self._values.extend(cast("array.array[int]", flat))

    def flush(self) -> None:
        if self._shape is not None and self._keys:
            op, count, _ = self._shape
            keys = self._keys[0] if len(self._keys) == 1 else np.concatenate(self._keys)
            self._state.put(op, keys, self._values, count)
        self._shape, self._keys, self._values = None, [], array.array("Q")


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


def _read_header(buf: memoryview) -> tuple[int, int, int, int] | None:
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


def read(buf: memoryview | bytearray | bytes, state: Callable[[], State] = DictState) -> Replay:
    """Replay the journal in ``buf``: every whole frame of the active half, in order, into
    a new ``state()``."""
    follower = Follower(buf, state)
    try:
        return follower.poll()
    finally:
        follower.release()


def _replay_frames(
    view: memoryview, base: int, half: int, epoch: int, pos: int, seq: int, state: State
) -> tuple[int, int]:
    """Apply the whole frames from ``pos`` (expecting ``seq``) to ``state``; the position
    and seq after the last one."""
    puts = _Puts(state)
    while pos + FRAME_HEAD.size + CRC.size <= half:
        magic, length, frame_epoch, frame_seq = FRAME_HEAD.unpack_from(view, base + pos)
        end = pos + FRAME_HEAD.size + length
        if magic != FRAME_MAGIC or frame_epoch != epoch or frame_seq != seq:
            break
        if end + CRC.size > half:
            break
        (crc,) = CRC.unpack_from(view, base + end)
        if zlib.crc32(view[base + pos : base + end]) != crc:
            break
        changes = _decode_payload(view[base + pos + FRAME_HEAD.size : base + end])
        if changes is None:
            break
        for change in changes:
            puts.add(change)
        pos = _align8(end + CRC.size)
        seq += 1
    puts.flush()
    return pos, seq


class Follower:
    """Follows a journal that another process writes: each :meth:`poll` applies only the
    frames added since the last one, and starts over (into a new ``state()``) when the
    header moved (a snapshot, a new holder). The guard keeps one per held group, so it
    always knows what the holder has committed and how full the journal is.

    ``poll`` returns the state itself, not a copy, unless the state has a ``snapshot()``
    (a DictState does)."""

    def __init__(
        self, buf: memoryview | bytearray | bytes, state: Callable[[], State] = DictState
    ) -> None:
        self._view = memoryview(buf)
        self.half = _layout(len(self._view))
        self._new_state = state
        self._header: tuple[int, int, int, int] | None = None
        self.state: State = state()
        self._pos = self._seq = 0

    def restart(self, state: Callable[[], State] | None = None) -> None:
        """Forget what was followed: the next poll replays the journal from its start (into
        a new state, made by ``state`` from now on if given)."""
        if state is not None:
            self._new_state = state
        # Empty until the next poll, which makes a new state() (the header differs).
        self._header, self.state, self._pos, self._seq = None, DictState(), 0, 0

    def adopt(self, state: State, position: Position) -> None:
        """Follow on from ``state``, which holds what the journal held at ``position``
        (its writer stopped there)."""
        self._header = (position.counter, position.epoch, position.active, self.half)
        self.state, self._pos, self._seq = state, position.used, position.frames

    def poll(self) -> Replay:
        view, half = self._view, self.half
        header = _read_header(view)
        if header != self._header:
            self._header, self.state, self._pos, self._seq = header, self._new_state(), 0, 0
        if header is None:
            return Replay(self._out(), 0, 0, 0, half, disabled=False)
        counter, epoch, active, header_half = header
        if active == NO_HALF or active > 1 or header_half != half:
            return Replay(self._out(), epoch, 0, 0, half, disabled=active == NO_HALF)
        base = DATA_START + active * half
        self._pos, self._seq = _replay_frames(
            view, base, half, epoch, self._pos, self._seq, self.state
        )
        position = Position(counter, epoch, active, self._pos, self._seq)
        return Replay(
            self._out(), epoch, self._seq, self._pos, half, False, start=base, position=position
        )

    def _out(self) -> Any:
        snapshot = getattr(self.state, "snapshot", None)
        return self.state if snapshot is None else snapshot()

    def release(self) -> None:
        self._view.release()


Entry = tuple[int, bytes, tuple[int, ...]]  # (op, key, values)


class Writer:
    """The holder's side: buffers changes and publishes them as frames.

    ``live()`` lists the live state as ``(tier, key, values)`` whenever the writer needs a
    snapshot: at start (a fresh epoch, so that whatever an earlier holder left behind is
    never replayed again) and when a half is full. The writer keeps no copy of its own: the
    holder's index is the state. Call :meth:`flush` before any slot named by a buffered
    removal is written again, and after commits; it returns False while recovery is
    disabled (the journal cannot hold even a snapshot of the live state).
    """

    def __init__(
        self,
        buf: memoryview | bytearray,
        live: Callable[[], Iterable[Entry]] | None,
        resume: Position | None = None,
    ) -> None:
        """``resume``: where a reader found the journal, if the writer's live state is
        exactly what the reader replayed: the writer then appends after the last whole
        frame (a torn one is overwritten) instead of starting with a snapshot."""
        self._buf = memoryview(buf)
        self._live = live
        self.half = _layout(len(self._buf))
        header = _read_header(self._buf)
        self._counter = header[0] + 1 if header else 1
        self._epoch = header[1] if header else 0
        self._active = header[2] if header and header[2] in (0, 1) else 1
        self._pending = bytearray()
        self._pos = 0
        self._seq = 0
        self.disabled = False
        self._disabled_at = 0  # snapshot bytes that did not fit
        self._pending_at_disable = 0
        self.compactions = 0
        self.refused = 0
        self.last_refusal: RecoveryMirrorError | None = None
        if resume is not None and header == (
            resume.counter,
            resume.epoch,
            resume.active,
            self.half,
        ):
            self._active, self._pos, self._seq = resume.active, resume.used, resume.frames
            self.resumed = True
        else:
            self.resumed = False
            self._compact()

    @property
    def fill(self) -> float:
        """Fraction of the active half in use (1.0 while disabled)."""
        return 1.0 if self.disabled else self._pos / self.half

    def put(self, key: bytes, values: tuple[int, ...], tier: int = PUT_G2) -> None:
        """Record ``key`` at ``values``. A key the journal cannot describe (over 65,535
        bytes, over 255 values) is not recorded: it is counted in ``refused`` (and
        ``last_refusal`` says why), and simply not recoverable."""
        entry = _ENTRIES.get((len(key), len(values))) or self._refuse(len(key), len(values))
        if entry is not None:
            self._pending += entry.pack(tier, len(key), key, len(values), *values)

    def remove(self, key: bytes, op: int = REMOVE) -> None:
        """Record that ``key`` left G2 (``REMOVE``) or G3 (``REMOVE_G3``)."""
        entry = _ENTRIES.get((len(key), 0)) or self._refuse(len(key), 0)
        if entry is not None:
            self._pending += entry.pack(op, len(key), key, 0)

    def put_batch(
        self,
        keys: Sequence[bytes],
        values: Sequence[tuple[int, ...]] | np.ndarray,
        tier: int = PUT_G2,
    ) -> None:
        """:meth:`put` for many keys at once (``values``: each key's, or an array of keys x
        values); one entry when they share a shape."""
        entry = encode_batch(tier, keys, values)
        if entry is None:
            rows = values.tolist() if isinstance(values, np.ndarray) else values
            for key, vals in zip(keys, rows):
                self.put(key, tuple(vals), tier)
        else:
            self._pending += entry

    def remove_batch(self, keys: Sequence[bytes], op: int = REMOVE) -> None:
        """:meth:`remove` for many keys at once."""
        entry = encode_batch(op, keys, None)
        if entry is None:
            for key in keys:
                self.remove(key, op)
        else:
            self._pending += entry

    def _refuse(self, key_len: int, count: int) -> struct.Struct | None:
        try:
            return _entry_struct(key_len, count)
        except RecoveryMirrorError as exc:
            self.refused += 1
            self.last_refusal = exc
            return None

    def flush(self) -> bool:
        if not self._pending:
            return not self.disabled
        payload = bytes(self._pending)
        self._pending.clear()
        if self.disabled:
            # Retry only after changes worth a quarter of the snapshot that did not fit: a
            # snapshot costs time linear in the state, so each change pays a bounded share.
            self._pending_at_disable += len(payload)
            if 4 * self._pending_at_disable < self._disabled_at:
                return False
            return self._compact()
        return self._append(payload) or self._compact()

    def _append(self, payload: bytes) -> bool:
        need = _align8(FRAME_HEAD.size + len(payload) + CRC.size)
        if self._pos + need > self.half:
            return False
        base = DATA_START + self._active * self.half + self._pos
        head = FRAME_HEAD.pack(FRAME_MAGIC, len(payload), self._epoch, self._seq)
        end = base + FRAME_HEAD.size + len(payload)
        self.write_at(base, head)
        self.write_at(base + FRAME_HEAD.size, payload)
        crc = zlib.crc32(payload, zlib.crc32(head))
        # The crc goes last: a reader that sees it valid sees the whole frame (x86 keeps
        # store order; the crc would not match a frame missing any earlier store anyway).
        self.write_at(end, CRC.pack(crc))
        self._pos += need
        self._seq += 1
        return True

    def _compact(self) -> bool:
        """Write a snapshot of the live state into the other half under a new epoch and
        switch to it; disable recovery if it does not fit."""
        target = 1 - self._active if self._active in (0, 1) else 0
        self._epoch += 1
        self._active, self._pos, self._seq = target, 0, 0
        snapshot = self.snapshot()
        fits = self._append(snapshot) if snapshot else True
        self.disabled = not fits
        self._disabled_at, self._pending_at_disable = len(snapshot), 0
        self._write_header(NO_HALF if self.disabled else target)
        self.compactions += 1
        return fits

    def position(self) -> Position | None:
        """Where the journal stands after the last flush (None while recovery is
        disabled): a reader that replayed up to here may hand it to the next writer."""
        if self.disabled or self._pending:
            return None
        return Position(self._counter - 1, self._epoch, self._active, self._pos, self._seq)

    def snapshot(self) -> bytes:
        """The live state as one payload, from ``live`` (a subclass that has no ``live``
        encodes it itself)."""
        assert self._live is not None, "a writer without live() overrides snapshot()"
        return encode_snapshot(self._live())

    def _write_header(self, active: int) -> None:
        slot = self._counter % 2
        off = slot * HEADER_SLOT
        fields = HEADER.pack(
            HEADER_MAGIC, VERSION, self._counter, self._epoch, active, 0, self.half
        )
        self.write_at(off, fields + CRC.pack(zlib.crc32(fields)))
        self._counter += 1

    def write_at(self, offset: int, data: bytes) -> None:
        """Every byte the writer publishes goes through here, in order (a test records the
        stores to replay a crash after any prefix of them)."""
        self._buf[offset : offset + len(data)] = data
