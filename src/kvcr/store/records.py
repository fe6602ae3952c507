"""The records of a block index, as arrays, and the views over them. Pure code.

A key's record owns one slot in every pool. A record is ``FILLING`` while a transfer writes
its slots and ``READY`` once committed; a slot returns to the free list only through
:meth:`Records.remove` or :meth:`Records.release_slots`, which callers invoke only when no
transfer can touch it.

Array-backed, for pools of a million blocks: a record *is* the slot it holds in the first
pool (``rec``), its fields live in arrays indexed by rec (flags, generation, claims, score,
recency, the other pools' slots) and a :class:`KeyTable` maps key -> rec, its keys in one
array too. No record costs a Python object of its own, so a full collection of the engine's
process costs the same with 0 and 1M resident blocks, and a warm start replays a journal
into the arrays without making an object per block. Other code
handles records through :class:`Block`, a view made on demand; a view outlives its record
safely (its generation no longer matches: it reads as gone and writes nothing).

:class:`Records` holds the arrays; the block index (``index.py``) builds on it.
"""

from __future__ import annotations

import array
import enum
import itertools
import weakref
from collections.abc import Iterator, Sequence
from operator import itemgetter
from typing import Protocol

import numpy as np

from kvcr.store.eviction import EvictionQueue
from kvcr.store.keytable import KeyTable
from kvcr.store.slots import SlotPool
from kvcr.types import BlockKey

NEVER = float("-inf")  # the recency of a block nobody accessed since recovery


class BlockState(enum.Enum):
    FILLING = "FILLING"
    READY = "READY"
    GONE = "GONE"  # a view of a record that no longer exists


_new = tuple.__new__
# Every index by number, for its views (which hold no reference: see Block).
_INDEXES: weakref.WeakValueDictionary[int, Records] = weakref.WeakValueDictionary()
_numbers = itertools.count()

# Flags of a record (one byte per rec; 0: no record).
IS_FILLING, IS_READY, IS_ATTACHED = 1, 2, 4  # ATTACHED: in the index (not detached)
_STATE = {0: BlockState.GONE, IS_FILLING: BlockState.FILLING, IS_READY: BlockState.READY}


class Block(tuple):  # (rec, gen, key, slots, number of its index)
    """A view of one record of a :class:`BlockIndex` (see the module docstring). Its
    ``key`` and ``slots`` never change; the other fields are the record's, read and written
    through the index's arrays, as long as the record lives.

    A tuple of ints and bytes, because views are made per key on hot paths: one C call,
    two views of one record are equal, and the garbage collector stops tracking a view at
    its first look (it names its index by number), so views held by operations never pile
    up in the old generations and trigger full collections of the engine's process."""

    __slots__ = ()

    rec: int = property(itemgetter(0))  # type: ignore[assignment]
    gen: int = property(itemgetter(1))  # type: ignore[assignment]
    key: BlockKey = property(itemgetter(2))  # type: ignore[assignment]
    slots: tuple[int, ...] = property(itemgetter(3))  # type: ignore[assignment]

    @property
    def _index(self) -> Records:
        return _INDEXES[self[4]]

    def __repr__(self) -> str:
        return f"Block({self.key!r}, {self.slots}, {self.state.name}, claims={self.claims})"

    @property
    def live(self) -> bool:
        """Whether the record still exists (in the index, or detached with its slots)."""
        return self._index.gen[self.rec] == self.gen and self._index.flags[self.rec] != 0

    @property
    def state(self) -> BlockState:
        if not self.live:
            return BlockState.GONE
        return _STATE[self._index.flags[self.rec] & (IS_FILLING | IS_READY)]

    @property
    def claims(self) -> int:
        return self._index.claims[self.rec] if self.live else 0

    @claims.setter
    def claims(self, value: int) -> None:
        if self.live:
            self._index.claims[self.rec] = value

    @property
    def queued(self) -> bool:
        """In the eviction queue (a claimed block is not, until its last claim goes)."""
        return self.live and bool(self._index.queue.queued[self.rec])

    @property
    def last_access(self) -> float | None:
        value = self._index.recency[self.rec]
        return None if value == NEVER else value

    @last_access.setter
    def last_access(self, value: float | None) -> None:
        if self.live:
            self._index.recency[self.rec] = NEVER if value is None else value

    @property
    def access_count(self) -> int:
        counts = self._index.access_counts
        return counts[self.rec] if counts is not None else 0

    @property
    def position(self) -> int:
        positions = self._index.positions
        return positions[self.rec] if positions is not None else -1

    @position.setter
    def position(self, value: int) -> None:
        if self.live and self._index.positions is not None:
            self._index.positions[self.rec] = value


class JournalSink(Protocol):
    """Where committed residency changes go (the guard's recovery journal)."""

    def committed(self, key: BlockKey, slots: tuple[int, ...]) -> None: ...
    def removed(self, key: BlockKey) -> None: ...
    def removed_many(self, keys: list[BlockKey]) -> None: ...
    def committed_many(self, keys: list[BlockKey], slots: np.ndarray) -> None: ...
    def flush(self) -> object: ...


class Records:
    """The record arrays of one tier's index, and what each record's life takes: its view,
    its end (:meth:`remove`, or :meth:`detach` then :meth:`release_slots`)."""

    def __init__(
        self, pools: list[SlotPool], *, score_is_recency: bool, policy_metadata: bool
    ) -> None:
        """``score_is_recency``: the eviction score is always the recency (the base LRU
        policy), so one array holds both. ``policy_metadata``: keep access counts and
        sequence positions (only a policy's own hooks read them)."""
        capacity = pools[0].capacity
        self.number = next(_numbers)
        _INDEXES[self.number] = self
        self.pools = pools
        self._first = pools[0]
        self._others = pools[1:]
        # Committed changes are mirrored here; buffered ones are flushed before any slot is
        # handed out again, so a removal is always published before its slot is rewritten.
        self.journal: JournalSink | None = None
        self.table = KeyTable(capacity)
        self.flags = bytearray(capacity)
        self._flags_np = np.frombuffer(self.flags, np.uint8)
        self.gen = array.array("I", bytes(4 * capacity))
        self.claims = array.array("I", bytes(4 * capacity))
        self.other_slots = [array.array("I", bytes(4 * capacity)) for _ in self._others]
        self.queue = EvictionQueue(capacity)
        self.recency = (
            self.queue.score if score_is_recency else array.array("d", bytes(8 * capacity))
        )
        self._score_is_recency = score_is_recency
        self.access_counts = array.array("I", bytes(4 * capacity)) if policy_metadata else None
        self.positions = array.array("i", [-1]) * capacity if policy_metadata else None
        self.ready_count = 0

    def __len__(self) -> int:
        return len(self.table)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self.table

    def resident_keys(self) -> list[BlockKey]:
        """Every key with a record (for checks and tools: O(records))."""
        return [BlockKey(key) for key, _ in self.table.items()]

    def get(self, key: BlockKey) -> Block | None:
        rec = self.table.find(key)
        if rec < 0:
            return None
        if self.other_slots:
            return self._view(rec, key)
        return _new(Block, (rec, self.gen[rec], key, (rec,), self.number))

    def _flags_of(self, keys: Sequence[BlockKey]) -> tuple[np.ndarray, np.ndarray]:
        """Each key's record (-1: none) and its flags (0: none)."""
        recs = self.table.find_many(keys)
        return recs, self._flags_at(recs)

    def _flags_at(self, recs: np.ndarray) -> np.ndarray:
        if not len(self.table):
            return np.zeros(len(recs), dtype=np.uint8)
        flags: np.ndarray = np.where(recs >= 0, self._flags_np[np.maximum(recs, 0)], 0)
        return flags

    def _view(self, rec: int, key: BlockKey) -> Block:
        slots = (rec, *(s[rec] for s in self.other_slots)) if self.other_slots else (rec,)
        return _new(Block, (rec, self.gen[rec], key, slots, self.number))

    def blocks(self) -> Iterator[Block]:
        """Every record in the index (views), in no particular order."""
        for key, rec in list(self.table.items()):
            yield self._view(rec, BlockKey(key))

    def views(self, recs: np.ndarray) -> list[Block]:
        """Views of records in the index."""
        keys = self.table.keys(recs)
        return [self._view(rec, BlockKey(key)) for rec, key in zip(recs.tolist(), keys)]

    @staticmethod
    def records(blocks: Sequence[Block]) -> np.ndarray:
        """The records of ``blocks``, as an array."""
        return np.fromiter((b[0] for b in blocks), dtype=np.intp, count=len(blocks))

    def slots_of(self, recs: np.ndarray) -> np.ndarray:
        """The slots of records in every pool: n x pools (the first column: ``recs``)."""
        columns = [recs] + [np.frombuffer(c, np.uint32)[recs] for c in self.other_slots]
        return np.stack(columns, axis=1).astype(np.intp)

    @property
    def free_keys(self) -> int:
        """How many more keys fit without eviction (a key needs a slot in every pool)."""
        return min(pool.free for pool in self.pools)

    def holds(self, block: Block) -> bool:
        rec = block.rec
        return self.gen[rec] == block.gen and bool(self.flags[rec] & IS_ATTACHED)

    def _held(self, recs: np.ndarray, gens: np.ndarray) -> np.ndarray:
        held: np.ndarray = (np.frombuffer(self.gen, np.uint32).take(recs) == gens) & (
            self._flags_np.take(recs) & IS_ATTACHED != 0
        )
        return held

    def flush_journal(self) -> None:
        if self.journal is not None:
            self.journal.flush()

    def remove(self, block: Block) -> None:
        """Forget the record and free its slots: only when no transfer touches them."""
        self.detach(block)
        self.release_slots(block)

    def detach(self, block: Block) -> None:
        """Forget the record but keep its slots taken (quarantined): a transfer may still
        write them. :meth:`release_slots` frees them once it cannot."""
        rec = block.rec
        if not self.holds(block):
            raise KeyError(f"block index: {block.key!r} is not in the index")
        self.table.remove(rec)
        self.queue.drop(rec)
        flags = self.flags[rec]
        self.flags[rec] = flags & ~IS_ATTACHED
        if flags & IS_READY:
            self.ready_count -= 1
            if self.journal is not None:
                self.journal.removed(block.key)

    def release_slots(self, block: Block) -> None:
        """Free a detached record's slots (the record ends: its views read as gone)."""
        rec = block.rec
        if self.gen[rec] != block.gen or self.flags[rec] & IS_ATTACHED:
            raise ValueError(f"block index: {block.key!r}: its slots are not quarantined")
        self.flags[rec] = 0
        self.gen[rec] = (block.gen + 1) & 0xFFFFFFFF
        self._first.release(rec)
        for pool, slot in zip(self._others, block.slots[1:]):
            pool.release(slot)

    def audit(self) -> dict[str, int]:
        """Where every slot is, for soak and debugging checks (never on a hot path).

        ``quarantined`` slots belong to no record in the index and are not free: legitimate
        while a transfer may still write them (a withdrawn fill), a leak once nothing is in
        flight. ``double`` counts slots handed out twice (free and in a record, in two
        records): always a bug. ``view_mismatch`` counts keys whose record disagrees with
        the key it is filed under."""
        attached = [rec for rec in self.table.records().tolist() if self.flags[rec] & IS_ATTACHED]
        double = quarantined = 0
        for p, pool in enumerate(self.pools):
            held = [0] * pool.capacity
            for rec in attached:
                held[rec if p == 0 else self.other_slots[p - 1][rec]] += 1
            taken = pool.taken
            double += sum(1 for s, n in enumerate(held) if n > 1 or (n and not taken[s]))
            quarantined += sum(1 for s, n in enumerate(held) if not n and taken[s])
        mismatch = sum(
            1
            for key, rec in self.table.items()
            if self.table.find(key) != rec or not self.flags[rec] & IS_ATTACHED
        )
        return {
            "blocks": len(self.table),
            "filling": sum(1 for rec in attached if self.flags[rec] & IS_FILLING),
            "claims": sum(self.claims[rec] for rec in attached),
            "free": min((p.free for p in self.pools), default=0),
            "quarantined": quarantined,
            "double": double,
            "view_mismatch": mismatch
            + abs(self.ready_count - sum(1 for r in attached if self.flags[r] & IS_READY)),
            "queued": len(self.queue),
        }
