"""The eviction queue of a block index: records in eviction order, lowest score first (ties:
lowest record first). Pure code over two arrays indexed by record, and no object per record.

A record is in the queue while ``queued[rec]`` is set; ``score[rec]`` is its key. Popping
serves from a *batch*: the lowest ``k`` queued records, chosen and sorted with numpy in one
pass over the arrays (``k`` grows with the queue, so that pass costs O(1) per pop), and
ending at the *limit* (the batch's last key). Records pushed meanwhile with a key at or
below the limit go to a small heap beside it; records pushed above it cannot come before
any of the batch and are found by the next pass. An entry whose record left the queue or
changed its score since is skipped when met. So the order is exact, not approximate: every
queued record at or below the limit has an entry in the batch or the heap.
"""

from __future__ import annotations

import array
import heapq
import math

import numpy as np

BATCH_MIN = 1024
# A pass picks at least 1/8 of the queue: its cost is mostly one read of the whole queue,
# shared by the pops it serves (at a million queued, ~0.16 ms per 1,024 pops and pushes,
# against ~0.57 ms at 1/32). Pushes at or below the batch's limit go to the heap, so a
# policy whose scores are not recencies sends about this share of its pushes there.
BATCH_SHARE = 8


_NO_SCORES = np.empty(0, dtype=np.float64)
_NO_RECS = np.empty(0, dtype=np.intp)


class EvictionQueue:
    def __init__(self, capacity: int, batch_min: int = BATCH_MIN) -> None:
        self._batch_min = batch_min
        self.score = array.array("d", bytes(8 * capacity))
        self.queued = bytearray(capacity)
        self._score_np = np.frombuffer(self.score, dtype=np.float64)
        self._queued_np = np.frombuffer(self.queued, dtype=np.uint8)
        self.count = 0
        # The batch, ascending by (score, rec): arrays, not lists (a list of a million
        # queued records' batch costs ~2 ms to make and ~50 B an entry).
        self._scores, self._recs = _NO_SCORES, _NO_RECS
        self._cursor = 0
        self._heap: list[tuple[float, int]] = []
        self._limit: tuple[float, int] | None = None  # while a batch is being served

    def __len__(self) -> int:
        return self.count

    def push(self, rec: int, score: float) -> None:
        """Queue ``rec`` with ``score`` (again, if it is queued: its old entry goes stale).
        A NaN score (a policy's bug) counts as +inf: NaN has no place in an order."""
        if math.isnan(score):
            score = math.inf
        if not self.queued[rec]:
            self.queued[rec] = 1
            self.count += 1
        self.score[rec] = score
        if self._limit is not None and (score, rec) <= self._limit:
            heapq.heappush(self._heap, (score, rec))

    def push_many(self, recs: np.ndarray, scores: np.ndarray) -> None:
        """:meth:`push` for distinct records at once."""
        scores = np.where(np.isnan(scores), math.inf, scores)
        self.count += int(np.count_nonzero(self._queued_np[recs] == 0))
        self._queued_np[recs] = 1
        self._score_np[recs] = scores
        if self._limit is not None:
            score, rec = self._limit
            below = (scores < score) | ((scores == score) & (recs <= rec))
            for entry in zip(scores[below].tolist(), recs[below].tolist()):
                heapq.heappush(self._heap, entry)

    def push_all(self, recs: np.ndarray, score: float) -> None:
        """Queue every record of ``recs`` (none queued yet) with one ``score``."""
        self._score_np[recs] = score
        self._queued_np[recs] = 1
        self.count += len(recs)
        self._forget_batch()  # the next pop chooses among them too

    def drop(self, rec: int) -> None:
        """Take ``rec`` out of the queue (its entries go stale)."""
        if self.queued[rec]:
            self.queued[rec] = 0
            self.count -= 1

    def drop_many(self, recs: np.ndarray) -> None:
        """:meth:`drop` for distinct records at once."""
        self.count -= int(np.count_nonzero(self._queued_np[recs]))
        self._queued_np[recs] = 0

    @property
    def queued_np(self) -> np.ndarray:
        """``queued`` as a numpy array (a view)."""
        return self._queued_np

    def pop(self) -> int | None:
        """The queued record with the lowest (score, rec), out of the queue; None if the
        queue is empty."""
        score, queued = self.score, self.queued
        while True:
            if self._cursor < len(self._recs):
                entry = (float(self._scores[self._cursor]), int(self._recs[self._cursor]))
                if self._heap and self._heap[0] < entry:
                    entry = heapq.heappop(self._heap)
                else:
                    self._cursor += 1
            elif self._heap:
                entry = heapq.heappop(self._heap)
            elif self.count:
                self._choose_batch()
                continue
            else:
                self._forget_batch()
                return None
            s, rec = entry
            if queued[rec] and score[rec] == s:
                queued[rec] = 0
                self.count -= 1
                return rec

    def pop_many(self, wanted: int) -> list[int]:
        """Up to ``wanted`` records, in order, out of the queue: :meth:`pop`, a slice of the
        batch at a time while no record queued since comes before it."""
        out: list[int] = []
        while len(out) < wanted:
            if self._heap or self._cursor >= len(self._recs):
                rec = self.pop()
                if rec is None:
                    break
                out.append(rec)
                continue
            end = min(len(self._recs), self._cursor + wanted - len(out))
            recs = self._recs[self._cursor : end]
            fresh = (self._queued_np[recs] == 1) & (
                self._score_np[recs] == self._scores[self._cursor : end]
            )
            self._cursor = end
            got = recs[fresh]
            self._queued_np[got] = 0
            self.count -= len(got)
            out.extend(got.tolist())
        return out

    def _forget_batch(self) -> None:
        self._scores, self._recs = _NO_SCORES, _NO_RECS
        self._cursor, self._heap, self._limit = 0, [], None

    def _choose_batch(self) -> None:
        """The lowest ``k`` queued records by (score, rec), sorted: one pass over the
        arrays."""
        recs = np.flatnonzero(self._queued_np)
        scores = self._score_np[recs]
        k = min(len(recs), max(self._batch_min, len(recs) // BATCH_SHARE))
        if k < len(recs):
            kth = np.partition(scores, k - 1)[k - 1]
            below = np.flatnonzero(scores < kth)
            # Ties at the boundary: the lowest records (recs is ascending).
            ties = np.flatnonzero(scores == kth)[: k - len(below)]
            pick = np.concatenate([below, ties])
            recs, scores = recs[pick], scores[pick]
        order = np.lexsort((recs, scores))
        self._scores, self._recs = scores[order], recs[order]
        self._cursor, self._heap = 0, []
        self._limit = (float(self._scores[-1]), int(self._recs[-1])) if len(recs) else None
