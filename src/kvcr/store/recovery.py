"""A block index's records as a journal replay makes them, and as a snapshot reads them.
Pure code.

A replayed record is READY in the slots it had, with no recency and not queued until the
replay is over (:meth:`Recovery.queue_recovered`). A record from outside is never trusted to
point at memory: slots out of range, taken or named twice leave its key out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import numpy as np

from kvcr.store.records import IS_ATTACHED, IS_READY, NEVER, Block, Records
from kvcr.store.slots import SlotPool
from kvcr.types import BlockKey


class Recovery(Records):
    """What replaying a journal and taking a snapshot do to the records."""

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
        self._flags_np[recs] = IS_ATTACHED | IS_READY
        np.frombuffer(self.claims, np.uint32)[recs] = 0
        np.frombuffer(self.recency, np.float64)[recs] = NEVER
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
        recs = np.flatnonzero((flags == (IS_ATTACHED | IS_READY)) & (queued == 0))
        if score is None:
            self.queue.push_all(recs, NEVER)
            return
        for rec in recs.tolist():
            block = self._view(rec, BlockKey(self.table.key(rec)))
            self.queue.push(rec, score(block))

    def ready_records(self) -> tuple[list[BlockKey], np.ndarray]:
        """The keys of every READY record and their slots (one per pool for each, flat, as
        uint64), in one pass over the arrays: what a journal snapshot holds."""
        flags = np.frombuffer(self.flags, np.uint8)
        recs = np.flatnonzero(flags == (IS_ATTACHED | IS_READY))
        keys = cast("list[BlockKey]", self.table.keys(recs))
        columns = [recs] + [np.frombuffer(c, np.uint32)[recs] for c in self.other_slots]
        return keys, np.stack(columns, axis=1).astype(np.uint64).ravel()
