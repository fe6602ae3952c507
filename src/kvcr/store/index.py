"""The block index of one tier: slots, records, claims and the eviction queue. Pure code.

A key's record owns one slot in every pool. A record is ``FILLING`` while a transfer writes
its slots and ``READY`` once committed. Memory rules kept here:

- a slot returns to the free list only through :meth:`BlockIndex.remove` or
  :meth:`BlockIndex.release_slots`, which callers invoke only when no transfer can touch it;
- a block with claims (a transfer reading it, a fetch or ``no_evict`` release handle) is
  never chosen for eviction.

Array-backed, for pools of a million blocks: a record *is* the slot it holds in the first
pool (``rec``), its fields live in arrays indexed by rec (flags, generation, claims, score,
recency, the other pools' slots) and a :class:`KeyTable` maps key -> rec, its keys in one
array too. No record costs a Python object of its own, so a full collection of the engine's
process costs the same with 0 and 1M resident blocks, and a warm start replays a journal
into the arrays without making an object per block. Other code
handles records through :class:`Block`, a view made on demand; a view outlives its record
safely (its generation no longer matches: it reads as gone and writes nothing).

``query`` reads :meth:`BlockIndex.answers` from engine threads without locks (the key table
is safe to read while the runtime writes; see its module); only the runtime writes.
"""

from __future__ import annotations

import array
import enum
import itertools
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from operator import itemgetter
from typing import Protocol, cast

import numpy as np

from kvcr.store.eviction import EvictionQueue
from kvcr.store.keytable import KeyTable, Probe
from kvcr.types import BlockKey, CacheTier, QueryStatus

Answer = tuple[QueryStatus, CacheTier | None]
HIT = (QueryStatus.HIT, CacheTier.LOCAL_G2)
FETCHING = (QueryStatus.FETCHING, CacheTier.LOCAL_G2)
MISS: Answer = (QueryStatus.MISS, None)
_NEVER = float("-inf")  # the recency of a block nobody accessed since recovery


class SlotPool:
    """Free slots of one pool: a byte per slot (0: free). Lowest-numbered slots are handed
    out first."""

    def __init__(self, name: str, block_size: int, capacity: int) -> None:
        self.name = name
        self.block_size = block_size
        self.capacity = capacity
        self.taken = bytearray(capacity)
        self._free = capacity
        self._low = 0  # no free slot below this one

    @property
    def free(self) -> int:
        return self._free

    @property
    def used(self) -> int:
        return self.capacity - self._free

    @property
    def free_slots(self) -> frozenset[int]:
        """The free slots (O(capacity): for checks, not hot paths)."""
        return frozenset(np.flatnonzero(np.frombuffer(self.taken, np.uint8) == 0).tolist())

    def take(self) -> int:
        return self.take_many(1)[0]

    def take_many(self, count: int) -> list[int]:
        """``count`` free slots (the lowest ones), ascending."""
        if count > self._free:
            raise IndexError(f"pool {self.name!r}: {count} slots wanted, {self._free} free")
        taken, low = self.taken, self._low
        if taken.find(1, low, low + count) < 0 and low + count <= self.capacity:
            # The usual case of a pool filling up: a run of free slots.
            taken[low : low + count] = b"\x01" * count
            slots = list(range(low, low + count))
            low += count
        else:
            slots = []
            for _ in range(count):
                low = taken.find(0, low)
                taken[low] = 1
                slots.append(low)
                low += 1
        self._free -= count
        self._low = low
        return slots

    def release_many(self, slots: np.ndarray) -> None:
        """:meth:`release` for many distinct slots at once."""
        taken = np.frombuffer(self.taken, np.uint8)
        if not taken[slots].all():
            raise ValueError(f"pool {self.name!r}: a slot released twice")
        taken[slots] = 0
        self._free += len(slots)
        self._low = min(self._low, int(slots.min()))

    def release(self, slot: int) -> None:
        if not self.taken[slot]:
            raise ValueError(f"pool {self.name!r}: slot {slot} released twice")
        self.taken[slot] = 0
        self._free += 1
        self._low = min(self._low, slot)

    def take_these(self, slots: Iterable[int]) -> None:
        """Take specific free slots (recovered blocks occupy the slots they had)."""
        for slot in slots:
            if self.taken[slot]:
                raise ValueError(f"pool {self.name!r}: slot {slot} is taken")
            self.taken[slot] = 1
            self._free -= 1

    def take_checked(self, slots: np.ndarray) -> None:
        """:meth:`take_these` for slots the caller checked free, in range and distinct."""
        np.frombuffer(self.taken, np.uint8)[slots] = 1
        self._free -= len(slots)


class BlockState(enum.Enum):
    FILLING = "FILLING"
    READY = "READY"
    GONE = "GONE"  # a view of a record that no longer exists


_new = tuple.__new__
# Every index by number, for its views (which hold no reference: see Block).
_INDEXES: weakref.WeakValueDictionary[int, BlockIndex] = weakref.WeakValueDictionary()
_numbers = itertools.count()

# Flags of a record (one byte per rec; 0: no record).
_FILLING, _READY, _ATTACHED = 1, 2, 4  # ATTACHED: in the index (not detached)
_STATE = {0: BlockState.GONE, _FILLING: BlockState.FILLING, _READY: BlockState.READY}
_READY_STATE = BlockState.READY


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
    def _index(self) -> BlockIndex:
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
        return _STATE[self._index.flags[self.rec] & (_FILLING | _READY)]

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
        return None if value == _NEVER else value

    @last_access.setter
    def last_access(self, value: float | None) -> None:
        if self.live:
            self._index.recency[self.rec] = _NEVER if value is None else value

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


class Found:
    """One lookup of a batch of keys (:meth:`BlockIndex.lookup`): each key's record (-1:
    none) and its state flags (0: none), and (``probe``) the key table's lookup, which can
    file the keys it found absent without looking for them again."""

    __slots__ = ("flags", "probe", "recs")

    def __init__(self, recs: np.ndarray, flags: np.ndarray, probe: Probe | None = None) -> None:
        self.recs, self.flags, self.probe = recs, flags, probe

    def held(self) -> np.ndarray:
        """Which keys have a record."""
        held: np.ndarray = self.recs >= 0
        return held

    def subset(self, mask: np.ndarray) -> Found:
        """The lookup of the keys that ``mask`` selects."""
        return Found(self.recs[mask], self.flags[mask])

    @property
    def ready(self) -> np.ndarray:
        """Which keys have a READY record in the index."""
        ready: np.ndarray = self.flags == _ATTACHED | _READY
        return ready

    @property
    def filling(self) -> np.ndarray:
        """Which keys have a record being filled."""
        filling: np.ndarray = self.flags & _FILLING != 0
        return filling


class Filling:
    """Records made FILLING at once (:meth:`BlockIndex.add_fills`), with their keys,
    generations and slots: a deposit fills, commits and settles them with masks over these
    arrays, no view per key (views cost ~1 us each at a thousand keys, with the collector's
    share of them)."""

    __slots__ = ("gens", "keys", "number", "recs", "slots")

    def __init__(
        self,
        keys: list[BlockKey],
        recs: np.ndarray,
        gens: np.ndarray,
        slots: np.ndarray,
        number: int,
    ) -> None:
        # slots: n x pools (its first column: recs); number: the index's
        self.keys, self.recs, self.gens, self.slots, self.number = keys, recs, gens, slots, number

    def __len__(self) -> int:
        return len(self.keys)

    def subset(self, mask: np.ndarray) -> Filling:
        """The records that ``mask`` selects."""
        keys = [key for key, kept in zip(self.keys, mask.tolist()) if kept]
        return Filling(keys, self.recs[mask], self.gens[mask], self.slots[mask], self.number)

    def views(self) -> list[Block]:
        """A view of each record (for the paths that hand blocks on: hooks, release handles)."""
        number = self.number
        return [
            _new(Block, (rec, gen, key, tuple(slots), number))
            for key, rec, gen, slots in zip(
                self.keys, self.recs.tolist(), self.gens.tolist(), self.slots.tolist()
            )
        ]


class Claim:
    """Records claimed at once (:meth:`BlockIndex.claim_ready`), with their generations:
    dropping the claims later touches only the records that are still those."""

    __slots__ = ("gens", "recs")

    def __init__(self, recs: np.ndarray, gens: np.ndarray) -> None:
        self.recs, self.gens = recs, gens

    def __len__(self) -> int:
        return len(self.recs)


def slot_pools(
    names: Sequence[str], block_sizes: Sequence[int], slot_counts: Sequence[int]
) -> list[SlotPool]:
    """A slot pool for each pool of a memory map: its name, block size and slot count."""
    return [
        SlotPool(name, block, slots) for name, block, slots in zip(names, block_sizes, slot_counts)
    ]


class Published:
    """A tier's index as engine threads see it for ``query``: set once the tier runs (the
    file tier starts after the facade exists)."""

    def __init__(self) -> None:
        self.index: BlockIndex | None = None


class BlockIndex:
    def __init__(
        self,
        pools: list[SlotPool],
        ready: Answer = HIT,
        filling: Answer | None = FETCHING,
        *,
        score_is_recency: bool = False,
        policy_metadata: bool = True,
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
        # What query answers, by a record's flags.
        self._answers: list[Answer] = [MISS] * 8
        self._answers[_ATTACHED | _READY] = ready
        if filling is not None:
            self._answers[_ATTACHED | _FILLING] = filling

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

    def ready_views(self, keys: Sequence[BlockKey]) -> list[Block | None]:
        """A view of each key's record if it is READY, else None: for the hot paths that
        read many keys at once."""
        recs, flags = self._flags_of(keys)
        ready = flags == _ATTACHED | _READY
        if self.other_slots:
            view = self._view
            return [
                view(rec, key) if ok else None
                for key, rec, ok in zip(keys, recs.tolist(), ready.tolist())
            ]
        gen, number = self.gen, self.number
        return [
            _new(Block, (rec, gen[rec], key, (rec,), number)) if ok else None
            for key, rec, ok in zip(keys, recs.tolist(), ready.tolist())
        ]

    def filling(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Those of ``keys`` whose record is being filled."""
        _, flags = self._flags_of(keys)
        return [key for key, f in zip(keys, (flags & _FILLING).tolist()) if f]

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

    def answers(self, keys: Sequence[BlockKey]) -> list[Answer]:
        """What ``query`` says of each key (engine threads, no locks)."""
        _, codes = self._flags_of(keys)
        table = self._answers
        return [table[code] for code in codes.tolist()]

    def answer(self, key: BlockKey) -> Answer:
        rec = self.table.find(key)
        return MISS if rec < 0 else self._answers[self.flags[rec]]

    @property
    def free_keys(self) -> int:
        """How many more keys fit without eviction (a key needs a slot in every pool)."""
        return min(pool.free for pool in self.pools)

    # -- records ---------------------------------------------------------------------------

    def add_filling(self, key: BlockKey, now: float) -> Block:
        return self.add_filling_batch([key], now)[0]

    def add_filling_batch(self, keys: list[BlockKey], now: float) -> list[Block]:
        """:meth:`add_fills`, as views."""
        return self.add_fills(keys, now).views() if keys else []

    def add_fills(self, keys: list[BlockKey], now: float, absent: Found | None = None) -> Filling:
        """Records for ``keys``, in ``FILLING`` state. Each pool's slots are handed out in
        ascending order along the keys, so consecutive keys get adjacent slots whenever the
        free list allows: NIXL merges adjacent descriptors (+40 % at 64 KiB blocks).
        ``absent``: a :meth:`lookup_to_fill` whose keys without a record are ``keys`` (or
        their first ones), in order: if no key was filed since, they are filed without
        looking for them again."""
        probe = absent.probe if absent is not None and keys else None
        if probe is not None:
            rows = np.flatnonzero(probe.found < 0)[: len(keys)]
            if len(rows) < len(keys) or probe.keys[int(rows[-1])] is not keys[-1]:
                raise ValueError("block index: keys to fill are not the ones found absent")
        if keys and self.journal is not None:
            self.journal.flush()
        at = np.array(self._first.take_many(len(keys)), dtype=np.intp)
        if probe is None:
            holders = self.table.add_many(keys, at)
        else:
            holders = self.table.add_probed(probe, rows, at)
        if (holders >= 0).any():
            self._unfile(keys, at, holders)
        self._flags_np[at] = _ATTACHED | _FILLING
        np.frombuffer(self.claims, np.uint32)[at] = 0
        np.frombuffer(self.recency, np.float64)[at] = now
        if self.access_counts is not None and self.positions is not None:
            np.frombuffer(self.access_counts, np.uint32)[at] = 0
            np.frombuffer(self.positions, np.int32)[at] = -1
        gens = np.frombuffer(self.gen, np.uint32).take(at)
        columns = [at]
        for pool, column in zip(self._others, self.other_slots):
            taken = np.array(pool.take_many(len(keys)), dtype=np.intp)
            np.frombuffer(column, np.uint32)[at] = taken
            columns.append(taken)
        slots = at.reshape(-1, 1) if not self._others else np.stack(columns, axis=1)
        return Filling(keys, at, gens, slots, self.number)

    def _unfile(self, keys: Sequence[BlockKey], recs: np.ndarray, holders: np.ndarray) -> None:
        """Undo the filing of a batch of new records, one of whose keys had a record."""
        self.table.remove_many(recs[holders < 0])
        self._first.release_many(recs)
        key = keys[int(np.flatnonzero(holders >= 0)[0])]
        raise KeyError(f"block index: key {key!r} already has a record")

    def commit(self, block: Block, score: float) -> None:
        self.flags[block.rec] = _ATTACHED | _READY
        self.ready_count += 1
        self.rescore(block, score)
        if self.journal is not None:
            self.journal.committed(block.key, block.slots)

    def commit_many(self, blocks: Sequence[Block], scores: Sequence[float] | None) -> None:
        """:meth:`commit` for a batch of held FILLING blocks, queued by ``scores`` (None: by
        their recency) and journaled as one batch."""
        if not blocks:
            return
        recs = self.records(blocks)
        np.frombuffer(self.flags, np.uint8)[recs] = _ATTACHED | _READY
        self.requeue(recs, scores)
        self.ready_count += len(recs)
        if self.journal is not None:
            slots = np.array([b[3] for b in blocks], dtype=np.uint64)
            self.journal.committed_many([b[2] for b in blocks], slots)

    def commit_fills(self, fill: Filling, scores: Sequence[float] | None) -> None:
        """:meth:`commit_many` for held records of :meth:`add_fills`."""
        if not len(fill):
            return
        self._flags_np[fill.recs] = _ATTACHED | _READY
        self.requeue(fill.recs, scores)
        self.ready_count += len(fill)
        if self.journal is not None:
            self.journal.committed_many(fill.keys, fill.slots)

    def lookup(self, keys: Sequence[BlockKey]) -> Found:
        """What one probe of the key table finds for ``keys``: for the hot paths, which
        then claim or wait without looking the keys up again (valid until they yield)."""
        recs, flags = self._flags_of(keys)
        return Found(recs, flags)

    def lookup_to_fill(self, keys: Sequence[BlockKey]) -> Found:
        """:meth:`lookup` of distinct keys, whose absent ones :meth:`add_fills` may file
        without a second probe."""
        probe = self.table.probe(keys)
        return Found(probe.found, self._flags_at(probe.found), probe)

    def claim_ready(self, found: Found, now: float) -> Claim:
        """Claim (an access at ``now``) the READY records of a fresh :meth:`lookup`
        (distinct keys) at once, with numpy: no view per block."""
        at = found.recs[found.ready]
        np.frombuffer(self.claims, np.uint32)[at] += 1
        self.queue.drop_many(at)
        np.frombuffer(self.recency, np.float64)[at] = now
        if self.access_counts is not None:
            np.frombuffer(self.access_counts, np.uint32)[at] += 1
        return Claim(at, np.frombuffer(self.gen, np.uint32)[at].copy())

    def unclaim_records(self, claim: Claim) -> np.ndarray:
        """Drop the claims of :meth:`claim_ready`; returns the records whose last claim
        went while in the index and out of the queue (the caller queues them again)."""
        recs, gens = claim.recs, claim.gens
        claims = np.frombuffer(self.claims, np.uint32)
        held = (np.frombuffer(self.gen, np.uint32)[recs] == gens) & (
            np.frombuffer(self.flags, np.uint8)[recs] & _ATTACHED != 0
        )
        at = recs[held & (claims[recs] > 0)]
        claims[at] -= 1
        back: np.ndarray = at[(claims[at] == 0) & (self.queue.queued_np[at] == 0)]
        return back

    def slots_of(self, recs: np.ndarray) -> np.ndarray:
        """The slots of records in every pool: n x pools (the first column: ``recs``)."""
        columns = [recs] + [np.frombuffer(c, np.uint32)[recs] for c in self.other_slots]
        return np.stack(columns, axis=1).astype(np.intp)

    @staticmethod
    def records(blocks: Sequence[Block]) -> np.ndarray:
        """The records of ``blocks``, as an array."""
        return np.fromiter((b[0] for b in blocks), dtype=np.intp, count=len(blocks))

    def align(self, keys: Sequence[BlockKey], now: float | None) -> np.ndarray:
        """Place the READY ones of ``keys`` as one sequence, in one pass over the arrays:
        each gets its position, and a recency from ``now`` (None: the most recent of
        theirs) that falls with the position, so that a prefix is evicted from its tail.
        Returns their records (queue them again with :meth:`requeue`)."""
        every = self.table.find_many(keys)
        # A key without a record (-1) reads the last record's flags: masked out after.
        ready = (self._flags_np.take(every) & _READY != 0) & (every >= 0)
        positions: np.ndarray = np.flatnonzero(ready)
        recs: np.ndarray = every.take(positions)
        if not len(recs):
            return recs
        recency = np.frombuffer(self.recency, np.float64)
        anchor = now if now is not None else float(recency[recs].max())
        recency[recs] = anchor - positions * 1e-9
        if self.positions is not None:
            np.frombuffer(self.positions, np.int32)[recs] = positions
        return recs

    def requeue(self, recs: np.ndarray, scores: Sequence[float] | None) -> None:
        """Queue the unclaimed ones of ``recs`` (distinct, in the index) by ``scores``
        (None: by their recency)."""
        values = (
            np.frombuffer(self.recency, np.float64).take(recs)
            if scores is None
            else np.asarray(scores, dtype=np.float64)
        )
        free = np.frombuffer(self.claims, np.uint32).take(recs) == 0
        if free.all():  # the usual case: nothing claimed, no masking
            self.queue.push_many(recs, values)
        else:
            self.queue.push_many(recs[free], values[free])

    def views(self, recs: np.ndarray) -> list[Block]:
        """Views of records in the index."""
        keys = self.table.keys(recs)
        return [self._view(rec, BlockKey(key)) for rec, key in zip(recs.tolist(), keys)]

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
        self.flags[rec] = flags & ~_ATTACHED
        if flags & _READY:
            self.ready_count -= 1
            if self.journal is not None:
                self.journal.removed(block.key)

    def held(self, fill: Filling) -> np.ndarray:
        """Which records of ``fill`` are still in the index (not withdrawn)."""
        return self._held(fill.recs, fill.gens)

    def _held(self, recs: np.ndarray, gens: np.ndarray) -> np.ndarray:
        held: np.ndarray = (np.frombuffer(self.gen, np.uint32).take(recs) == gens) & (
            self._flags_np.take(recs) & _ATTACHED != 0
        )
        return held

    def holds(self, block: Block) -> bool:
        rec = block.rec
        return self.gen[rec] == block.gen and bool(self.flags[rec] & _ATTACHED)

    def release_slots(self, block: Block) -> None:
        """Free a detached record's slots (the record ends: its views read as gone)."""
        rec = block.rec
        if self.gen[rec] != block.gen or self.flags[rec] & _ATTACHED:
            raise ValueError(f"block index: {block.key!r}: its slots are not quarantined")
        self.flags[rec] = 0
        self.gen[rec] = (block.gen + 1) & 0xFFFFFFFF
        self._first.release(rec)
        for pool, slot in zip(self._others, block.slots[1:]):
            pool.release(slot)

    # -- recency and the eviction queue ------------------------------------------------------

    def touch(self, block: Block, now: float) -> None:
        rec = block.rec
        if not self.holds(block):
            return
        if self.access_counts is not None:
            self.access_counts[rec] += 1
        if self._score_is_recency and self.queue.queued[rec]:
            self.queue.push(rec, now)  # its place in the queue moves with it
        else:
            self.recency[rec] = now

    def rescore(self, block: Block, score: float) -> None:
        if self.holds(block):
            self.queue.push(block.rec, score)

    def claim(self, block: Block, now: float | None = None) -> None:
        """One more claim on a record in the index: out of the eviction queue until the
        last claim goes (``now``: an access)."""
        if self.holds(block):
            self.claims[block.rec] += 1
            self.queue.drop(block.rec)
            if now is not None:
                self.touch(block, now)

    def unclaim(self, block: Block) -> bool:
        """Drop one claim; True when it was the last one of a record in the index that is
        out of the queue (the caller queues it again with a fresh score)."""
        rec = block.rec
        if not self.holds(block) or not self.claims[rec]:
            return False
        self.claims[rec] -= 1
        return not self.claims[rec] and not self.queue.queued[rec]

    def dequeue(self, block: Block) -> None:
        """Take a block out of the eviction queue while it is claimed; whoever drops the
        last claim queues it again."""
        if self.holds(block):
            self.queue.drop(block.rec)

    def evict(self, wanted: int) -> list[BlockKey]:
        """Remove up to ``wanted`` evictable blocks, lowest score first, and return their
        keys: :meth:`victims` for a tier that drops whatever it evicts, in one pass over
        the arrays (no view, no generator step per block). Claimed blocks met on the way
        leave the queue, as there."""
        flags = np.frombuffer(self.flags, np.uint8)
        claims = np.frombuffer(self.claims, np.uint32)
        recs: list[int] = []
        while len(recs) < wanted:
            popped = self.queue.pop_many(wanted - len(recs))
            if not popped:
                break
            at = np.array(popped, dtype=np.intp)
            recs.extend(at[(flags[at] == _ATTACHED | _READY) & (claims[at] == 0)].tolist())
        return self._remove_ready(recs) if recs else []

    def _remove_ready(self, recs: list[int]) -> list[BlockKey]:
        """Remove READY, unclaimed, unqueued records at once; their slots are free."""
        at = np.array(recs, dtype=np.intp)
        keys = cast("list[BlockKey]", self.table.keys(at))
        self.table.remove_many(at)
        np.frombuffer(self.flags, np.uint8)[at] = 0
        np.frombuffer(self.gen, np.uint32)[at] += 1  # wraps, like release_slots
        self._first.release_many(at)
        for pool, column in zip(self._others, self.other_slots):
            pool.release_many(np.frombuffer(column, np.uint32)[at].astype(np.intp))
        self.ready_count -= len(keys)
        if self.journal is not None:
            self.journal.removed_many(keys)
        return keys

    def _pop_evictable(self) -> Block | None:
        """The lowest-scored evictable block, out of the queue (None when there is none).
        Claimed blocks met on the way leave the queue."""
        flags, claims = self.flags, self.claims
        while (rec := self.queue.pop()) is not None:
            if flags[rec] == _ATTACHED | _READY and claims[rec] == 0:
                return self._view(rec, BlockKey(self.table.key(rec)))
        return None

    def evictable(self, block: Block) -> bool:
        return self.holds(block) and bool(self.flags[block.rec] & _READY) and not block.claims

    def victims(self, score: Callable[[Block], float]) -> Generator[Block, None, None]:
        """Evictable blocks, lowest score first. A block the caller does not remove is
        queued again when the iteration ends (also when the caller stops right at it).

        Claimed blocks met on the way leave the queue instead of being queued again, so an
        eviction costs nothing per claimed block: whoever drops the last claim requeues it
        (``queued`` is False until then)."""
        kept: list[Block] = []
        try:
            while (block := self._pop_evictable()) is not None:
                kept.append(block)
                yield block
        finally:
            for block in kept:
                if self.holds(block) and not block.claims:
                    self.rescore(block, score(block))

    # -- recovery ------------------------------------------------------------------------------

    def put_recovered(self, keys: Sequence[BlockKey] | np.ndarray, slots: Sequence[int]) -> int:
        """READY records for blocks replayed from a journal, in the slots they had
        (``slots``: one per pool for each key, flat), without recency, not queued (see
        :meth:`queue_recovered`). ``keys``: bytes, or a journal batch's keys in place (an
        array of numpy "void" items of one length). A key replayed again moves. A key whose
        slots are not one in range per pool, each free, is left out: a record from outside
        is never trusted to point at memory. Returns how many were left out.

        A batch in free, distinct slots (what a writer publishes) goes into the arrays and
        the key table with numpy, no object per key; anything else key by key."""
        width, n = len(self.pools), len(keys)
        if len(slots) != width * n:
            return n
        if not n:
            return 0
        wanted = np.asarray(slots, dtype=np.uint64).reshape(n, width)
        columns = [wanted[:, p] for p in range(width)]
        if not all(self._free_and_distinct(p, c) for p, c in zip(self.pools, columns)):
            listed = keys.tolist() if isinstance(keys, np.ndarray) else keys
            return self._put_one_by_one(listed, wanted.tolist())
        recs = columns[0].astype(np.intp)
        self._put_all([c.astype(np.intp) for c in columns])
        if isinstance(keys, np.ndarray):
            holders = self.table.add_rows(keys.view(np.uint8).reshape(n, -1), recs)
        else:
            holders = self.table.add_many(keys, recs)
        if (holders >= 0).any():
            self._supersede(recs, holders)
        return 0

    @staticmethod
    def _free_and_distinct(pool: SlotPool, slots: np.ndarray) -> bool:
        if len(slots) and int(slots.max()) >= pool.capacity:
            return False
        index = slots.astype(np.intp)
        taken = np.frombuffer(pool.taken, np.uint8)
        if taken[index].any():
            return False
        # A writer hands slots out ascending: then they are distinct without a sort.
        return bool(np.all(index[1:] > index[:-1])) or len(np.unique(index)) == len(index)

    def _put_all(self, columns: list[np.ndarray]) -> None:
        """READY records in free, distinct slots (``columns``: each pool's), keys not filed."""
        recs = columns[0]
        for pool, column in zip(self.pools, columns):
            pool.take_checked(column)
        for store, column in zip(self.other_slots, columns[1:]):
            np.frombuffer(store, np.uint32)[recs] = column
        self._flags_np[recs] = _ATTACHED | _READY
        np.frombuffer(self.claims, np.uint32)[recs] = 0
        np.frombuffer(self.recency, np.float64)[recs] = _NEVER
        if self.positions is not None:
            np.frombuffer(self.positions, np.int32)[recs] = -1
        self.ready_count += len(recs)

    def _supersede(self, recs: np.ndarray, holders: np.ndarray) -> None:
        """Replayed records whose key was filed already (``holders``): the later put wins,
        the other record goes. Rare: a writer removes a key before putting it again."""
        batch = {rec: i for i, rec in enumerate(recs.tolist())}
        moved: dict[int, int] = {}  # a record that lost its key -> the one that took it
        for i in np.flatnonzero(holders >= 0).tolist():
            new, holder = int(recs[i]), int(holders[i])
            while holder in moved:
                holder = moved[holder]
            if batch.get(holder, -1) > i:
                loser = new  # a later put of the key holds it already
            else:
                self.table.replace(holder, new)
                loser = moved[holder] = holder
            self._drop_unfiled(loser)

    def _drop_unfiled(self, rec: int) -> None:
        """End a READY record whose key is not (or no longer) filed: its slots are free."""
        self.queue.drop(rec)
        self.flags[rec] = 0
        self.ready_count -= 1
        self.gen[rec] = (self.gen[rec] + 1) & 0xFFFFFFFF
        self._first.release(rec)
        for pool, column in zip(self._others, self.other_slots):
            pool.release(column[rec])

    def _put_one_by_one(self, keys: Sequence[BlockKey], rows: list[list[int]]) -> int:
        skipped = 0
        for key, row in zip(keys, rows):
            old = self.table.find(key)
            if old >= 0:
                self.remove(self._view(old, key))
            if any(not 0 <= s < p.capacity or p.taken[s] for s, p in zip(row, self.pools)):
                skipped += 1
                continue
            self._put_all([np.array([s], np.intp) for s in row])
            self.table.add(key, row[0])
        return skipped

    def forget_recovered(self, keys: Sequence[BlockKey] | np.ndarray) -> None:
        """Replayed removals: the keys' records go, their slots are free."""
        for key in keys.tolist() if isinstance(keys, np.ndarray) else keys:
            rec = self.table.find(key)
            if rec >= 0:
                self.remove(self._view(rec, key))

    def queue_recovered(self, score: Callable[[Block], float] | None) -> None:
        """Queue every unqueued READY record for eviction: by ``score``, or (None) all with
        the score of no recency, in one pass over the arrays."""
        flags = np.frombuffer(self.flags, np.uint8)
        queued = np.frombuffer(self.queue.queued, np.uint8)
        recs = np.flatnonzero((flags == (_ATTACHED | _READY)) & (queued == 0))
        if score is None:
            self.queue.push_all(recs, _NEVER)
            return
        for rec in recs.tolist():
            block = self._view(rec, BlockKey(self.table.key(rec)))
            self.queue.push(rec, score(block))

    def ready_records(self) -> tuple[list[BlockKey], np.ndarray]:
        """The keys of every READY record and their slots (one per pool for each, flat, as
        uint64), in one pass over the arrays: what a journal snapshot holds."""
        flags = np.frombuffer(self.flags, np.uint8)
        recs = np.flatnonzero(flags == (_ATTACHED | _READY))
        keys = cast("list[BlockKey]", self.table.keys(recs))
        columns = [recs] + [np.frombuffer(c, np.uint32)[recs] for c in self.other_slots]
        return keys, np.stack(columns, axis=1).astype(np.uint64).ravel()

    # -- checks ----------------------------------------------------------------------------

    def audit(self) -> dict[str, int]:
        """Where every slot is, for soak and debugging checks (never on a hot path).

        ``quarantined`` slots belong to no record in the index and are not free: legitimate
        while a transfer may still write them (a withdrawn fill), a leak once nothing is in
        flight. ``double`` counts slots handed out twice (free and in a record, in two
        records): always a bug. ``view_mismatch`` counts keys whose record disagrees with
        the key it is filed under."""
        attached = [rec for rec in self.table.records().tolist() if self.flags[rec] & _ATTACHED]
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
            if self.table.find(key) != rec or not self.flags[rec] & _ATTACHED
        )
        return {
            "blocks": len(self.table),
            "filling": sum(1 for rec in attached if self.flags[rec] & _FILLING),
            "claims": sum(self.claims[rec] for rec in attached),
            "free": min((p.free for p in self.pools), default=0),
            "quarantined": quarantined,
            "double": double,
            "view_mismatch": mismatch
            + abs(self.ready_count - sum(1 for r in attached if self.flags[r] & _READY)),
            "queued": len(self.queue),
        }
