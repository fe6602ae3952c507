"""The block index of one tier: what ``query`` answers, fills and commits, claims and the
eviction order. Pure code.

A block with claims (a transfer reading it, a fetch or ``no_evict`` release handle) is never
chosen for eviction. ``query`` reads :meth:`BlockIndex.answers` from engine threads without
locks (the key table is safe to read while the runtime writes; see its module); only the
runtime writes.

Its records and their views are ``records.py``'s, what a journal replay does to them is
``recovery.py``'s, the pools' free slots are ``slots.py``'s and the batch results
``batches.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import cast

import numpy as np

from kvcr.store.batches import Claim, Filling, Found
from kvcr.store.records import IS_ATTACHED, IS_FILLING, IS_READY, Block
from kvcr.store.recovery import Recovery
from kvcr.store.slots import SlotPool
from kvcr.types import BlockKey, CacheTier, QueryStatus

Answer = tuple[QueryStatus, CacheTier | None]
HIT = (QueryStatus.HIT, CacheTier.LOCAL_G2)
FETCHING = (QueryStatus.FETCHING, CacheTier.LOCAL_G2)
MISS: Answer = (QueryStatus.MISS, None)
_new = tuple.__new__  # a view in one C call, as records.py makes them


class Published:
    """A tier's index as engine threads see it for ``query``: set once the tier runs (the
    file tier starts after the facade exists)."""

    def __init__(self) -> None:
        self.index: BlockIndex | None = None


class BlockIndex(Recovery):
    """One tier's index: its records (:class:`Records`, which a journal replay fills through
    :class:`Recovery`) and what the runtime does with them."""

    def __init__(
        self,
        pools: list[SlotPool],
        ready: Answer = HIT,
        filling: Answer | None = FETCHING,
        *,
        score_is_recency: bool = False,
        policy_metadata: bool = True,
    ) -> None:
        """``ready``, ``filling``: what ``query`` answers of a READY, a FILLING record (None:
        MISS). For the others see :class:`Records`."""
        super().__init__(pools, score_is_recency=score_is_recency, policy_metadata=policy_metadata)
        # What query answers, by a record's flags.
        self._answers: list[Answer] = [MISS] * 8
        self._answers[IS_ATTACHED | IS_READY] = ready
        if filling is not None:
            self._answers[IS_ATTACHED | IS_FILLING] = filling

    def ready_views(self, keys: Sequence[BlockKey]) -> list[Block | None]:
        """A view of each key's record if it is READY, else None: for the hot paths that
        read many keys at once."""
        recs, flags = self._flags_of(keys)
        ready = flags == IS_ATTACHED | IS_READY
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
        return [key for key, f in zip(keys, (flags & IS_FILLING).tolist()) if f]

    def answers(self, keys: Sequence[BlockKey]) -> list[Answer]:
        """What ``query`` says of each key (engine threads, no locks): one call into the
        compiled key table, which reads each record's flags."""
        answers: list[Answer] = self.table.answers(keys, self.flags, self._answers)
        return answers

    def answer(self, key: BlockKey) -> Answer:
        rec = self.table.find(key)
        return MISS if rec < 0 else self._answers[self.flags[rec]]

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
        at = self._first.take_many(len(keys))
        if probe is None:
            holders = self.table.add_many(keys, at)
        else:
            holders = self.table.add_probed(probe, rows, at)
        if (holders >= 0).any():
            self._unfile(keys, at, holders)
        self._flags_np[at] = IS_ATTACHED | IS_FILLING
        np.frombuffer(self.claims, np.uint32)[at] = 0
        np.frombuffer(self.recency, np.float64)[at] = now
        if self.access_counts is not None and self.positions is not None:
            np.frombuffer(self.access_counts, np.uint32)[at] = 0
            np.frombuffer(self.positions, np.int32)[at] = -1
        gens = np.frombuffer(self.gen, np.uint32).take(at)
        columns = [at]
        for pool, column in zip(self._others, self.other_slots):
            taken = pool.take_many(len(keys))
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

    def held(self, fill: Filling) -> np.ndarray:
        """Which records of ``fill`` are still in the index (not withdrawn)."""
        return self._held(fill.recs, fill.gens)

    def commit(self, block: Block, score: float) -> None:
        self.flags[block.rec] = IS_ATTACHED | IS_READY
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
        np.frombuffer(self.flags, np.uint8)[recs] = IS_ATTACHED | IS_READY
        self.requeue(recs, scores)
        self.ready_count += len(recs)
        if self.journal is not None:
            slots = np.array([b[3] for b in blocks], dtype=np.uint64)
            self.journal.committed_many([b[2] for b in blocks], slots)

    def commit_fills(self, fill: Filling, scores: Sequence[float] | None) -> None:
        """:meth:`commit_many` for held records of :meth:`add_fills`."""
        if not len(fill):
            return
        self._flags_np[fill.recs] = IS_ATTACHED | IS_READY
        self.requeue(fill.recs, scores)
        self.ready_count += len(fill)
        if self.journal is not None:
            self.journal.committed_many(fill.keys, fill.slots)

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
            np.frombuffer(self.flags, np.uint8)[recs] & IS_ATTACHED != 0
        )
        at = recs[held & (claims[recs] > 0)]
        claims[at] -= 1
        back: np.ndarray = at[(claims[at] == 0) & (self.queue.queued_np[at] == 0)]
        return back

    def align(self, keys: Sequence[BlockKey], now: float | None) -> np.ndarray:
        """Place the READY ones of ``keys`` as one sequence, in one pass over the arrays:
        each gets its position, and a recency from ``now`` (None: the most recent of
        theirs) that falls with the position, so that a prefix is evicted from its tail.
        Returns their records (queue them again with :meth:`requeue`)."""
        every = self.table.find_many(keys)
        # A key without a record (-1) reads the last record's flags: masked out after.
        ready = (self._flags_np.take(every) & IS_READY != 0) & (every >= 0)
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

    def unclaim_scored(
        self, block: Block, score: Callable[[Block], float], now: float | None = None
    ) -> None:
        """Drop one claim; the last one queues the block again with a fresh ``score``
        (``now``: an access that ended now)."""
        if self.unclaim(block):
            if now is not None:
                self.touch(block, now)
            self.rescore(block, score(block))

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
            recs.extend(at[(flags[at] == IS_ATTACHED | IS_READY) & (claims[at] == 0)].tolist())
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
            if flags[rec] == IS_ATTACHED | IS_READY and claims[rec] == 0:
                return self._view(rec, BlockKey(self.table.key(rec)))
        return None

    def evictable(self, block: Block) -> bool:
        return self.holds(block) and bool(self.flags[block.rec] & IS_READY) and not block.claims

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
