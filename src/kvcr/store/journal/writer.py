"""Writing the recovery journal: the holder's side, with compaction. Pure code over a
writable buffer (the group's 100 MiB journal region, or a bytearray in tests).

One process writes (the worker holding the group), frames after the last whole one; the
crc goes last, so a frame is whole exactly when its crc is valid.

Compaction: when a frame does not fit in the active half, the writer writes a snapshot of
the live state into the other half under a new epoch, then switches the header. A crash
before the switch leaves the old half and epoch in force; after it, the new ones. If even
the snapshot does not fit, recovery is disabled (a header with no active half) until the
state shrinks enough for a snapshot to fit again.

A writer whose live state is exactly what a reader replayed may *resume* at the reader's
:class:`Position` (after the last whole frame, same epoch and header) instead of starting
with a snapshot: a warm start then writes nothing of the state it recovered.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from kvcr.store.journal.format import (
    CRC,
    DATA_START,
    ENTRY_STRUCTS,
    FRAME_HEAD,
    FRAME_MAGIC,
    HEADER,
    HEADER_MAGIC,
    HEADER_SLOT,
    NO_HALF,
    PUT_G2,
    REMOVE,
    VERSION,
    Entry,
    Position,
    align8,
    encode_batch,
    encode_snapshot,
    entry_struct,
    half_bytes,
    read_header,
)
from kvcr.types import RecoveryMirrorError


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
        self.half = half_bytes(len(self._buf))
        header = read_header(self._buf)
        self._counter = header[0] + 1 if header else 1
        self._epoch = header[1] if header else 0
        self._active = header[2] if header and header[2] in (0, 1) else 1
        self._pending = bytearray()
        self._pos = 0
        self._seq = 0
        self.disabled = False
        self.stopped = False  # stop(): nothing is written until resume()
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
        """Fraction of the active half in use (1.0 while disabled or stopped)."""
        return 1.0 if self.disabled or self.stopped else self._pos / self.half

    def put(self, key: bytes, values: tuple[int, ...], tier: int = PUT_G2) -> None:
        """Record ``key`` at ``values``. A key the journal cannot describe (over 65,535
        bytes, over 255 values) is not recorded: it is counted in ``refused`` (and
        ``last_refusal`` says why), and simply not recoverable."""
        entry = ENTRY_STRUCTS.get((len(key), len(values))) or self._refuse(len(key), len(values))
        if entry is not None:
            self._pending += entry.pack(tier, len(key), key, len(values), *values)

    def remove(self, key: bytes, op: int = REMOVE) -> None:
        """Record that ``key`` left G2 (``REMOVE``) or G3 (``REMOVE_G3``)."""
        entry = ENTRY_STRUCTS.get((len(key), 0)) or self._refuse(len(key), 0)
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
            return entry_struct(key_len, count)
        except RecoveryMirrorError as exc:
            self.refused += 1
            self.last_refusal = exc
            return None

    def stop(self) -> None:
        """Stop journaling: drop what is buffered and publish a header with no active half,
        so that no reader replays what this journal held (it would go stale from now on)."""
        self._pending.clear()
        self._write_header(NO_HALF)
        self.stopped = True

    def resume(self) -> bool:
        """Journal again, from a snapshot of the live state under a new epoch (False: it
        does not fit, and recovery is disabled as after any such snapshot)."""
        self.stopped = False
        self._pending.clear()
        return self._compact()

    def flush(self) -> bool:
        if self.stopped:
            self._pending.clear()
            return False
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
        need = align8(FRAME_HEAD.size + len(payload) + CRC.size)
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
        if self.disabled or self.stopped or self._pending:
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
