"""Reading the recovery journal: replaying its whole frames into a state. Pure code.

Anyone may read, also while the holder writes, and after it died at any instruction. A
reader recovers exactly the frames that were whole when it looked: a torn, partial,
bit-flipped or stale frame ends the replay and is never misread.

A reader replays into a :class:`State` (a dict of residencies by default; a worker's or the
guard's block index, with no object per key). A :class:`Follower` applies only the frames
added since its last poll.
"""

from __future__ import annotations

import array
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import attrs
import numpy as np

from kvcr.store.journal.format import (
    CRC,
    DATA_START,
    FRAME_HEAD,
    FRAME_MAGIC,
    NO_HALF,
    PUT_G3,
    REMOVALS,
    REMOVE_G3,
    Change,
    Keys,
    Position,
    align8,
    decode_payload,
    half_bytes,
    listed,
    read_header,
)


@attrs.frozen
class Residency:
    """Where a committed key lives: ``tier`` PUT_G2 (``values`` = one slot per pool) or
    PUT_G3 (``values`` = its place in the file tier)."""

    tier: int
    values: tuple[int, ...]


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


def apply_payload(state: State, payload: bytes | memoryview) -> bool:
    """Apply one frame's entries to ``state``; False (and ``state`` untouched) if it is
    malformed."""
    changes = decode_payload(payload)
    if changes is None:
        return False
    for change in changes:
        _apply(state, change)
    return True


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
        changes = decode_payload(view[base + pos + FRAME_HEAD.size : base + end])
        if changes is None:
            break
        for change in changes:
            puts.add(change)
        pos = align8(end + CRC.size)
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
        self.half = half_bytes(len(self._view))
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
        header = read_header(view)
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
