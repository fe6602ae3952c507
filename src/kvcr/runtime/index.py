"""The block index of local G2: slots, records, claims and the eviction queue. Pure code.

A key's record owns one slot in every pool. A record is ``FILLING`` while a transfer writes
its slots and ``READY`` once committed. Memory rules kept here:

- a slot returns to the free list only through :meth:`BlockIndex.remove` or
  :meth:`SlotPool.release`, which callers invoke only when no transfer can touch it;
- a block with claims (a transfer reading it, a fetch or ``no_evict`` release handle) is
  never chosen for eviction.

The eviction queue is a lazy min-heap of ``(score, seq, key, version)``: a record's score is
taken from the policy whenever its metadata changes (and its ``version`` bumps), stale heap
entries are skipped when popped, and the heap is rebuilt when stale entries dominate.

``view`` is the published answer to ``query`` (``ready`` for committed keys, ``filling``
for keys being filled, if the tier publishes those): engine threads read it without locks
(single dict lookups are atomic in CPython); only the runtime writes it.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs

from kvcr.types import BlockKey, CacheTier, QueryStatus

if TYPE_CHECKING:
    import trio

HIT = (QueryStatus.HIT, CacheTier.LOCAL_G2)
FETCHING = (QueryStatus.FETCHING, CacheTier.LOCAL_G2)


class SlotPool:
    """Free slots of one pool. Lowest-numbered slots are handed out first."""

    def __init__(self, name: str, block_size: int, capacity: int) -> None:
        self.name = name
        self.block_size = block_size
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def free_slots(self) -> frozenset[int]:
        """The free slots (a copy: O(capacity))."""
        return frozenset(self._free)

    def take(self) -> int:
        return self._free.pop()

    def take_many(self, count: int) -> list[int]:
        """``count`` free slots (the next ones :meth:`take` would hand out), ascending."""
        if count > len(self._free):
            raise IndexError(f"pool {self.name!r}: {count} slots wanted, {len(self._free)} free")
        taken = self._free[len(self._free) - count :]
        del self._free[len(self._free) - count :]
        taken.sort()
        return taken

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def take_these(self, slots: Iterable[int]) -> None:
        """Take specific free slots (recovered blocks occupy the slots they had)."""
        taken = set(slots)
        self._free = [s for s in self._free if s not in taken]


class BlockState(enum.Enum):
    FILLING = "FILLING"
    READY = "READY"


@attrs.define(eq=False)
class Block:
    key: BlockKey
    slots: tuple[int, ...]
    state: BlockState = BlockState.FILLING
    claims: int = 0
    access_count: int = 0
    last_access: float | None = None
    position: int = -1
    version: int = 0
    queued: bool = False  # has a current entry in the eviction queue
    waiters: trio.Event | None = None  # while somebody waits for the fill to end


class JournalSink(Protocol):
    """Where committed residency changes go (the guard's recovery journal)."""

    def committed(self, key: BlockKey, slots: tuple[int, ...]) -> None: ...
    def removed(self, key: BlockKey) -> None: ...
    def flush(self) -> object: ...


class BlockIndex:
    def __init__(
        self,
        pools: list[SlotPool],
        ready: tuple[QueryStatus, CacheTier] = HIT,
        filling: tuple[QueryStatus, CacheTier] | None = FETCHING,
        view: dict[BlockKey, tuple[QueryStatus, CacheTier]] | None = None,
    ) -> None:
        self.pools = pools
        self._ready = ready
        self._filling = filling
        # Committed changes are mirrored here; buffered ones are flushed before any slot is
        # handed out again, so a removal is always published before its slot is rewritten.
        self.journal: JournalSink | None = None
        self.blocks: dict[BlockKey, Block] = {}
        self.view: dict[BlockKey, tuple[QueryStatus, CacheTier]] = {} if view is None else view
        self._heap: list[tuple[float, int, BlockKey, int]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.blocks)

    def get(self, key: BlockKey) -> Block | None:
        return self.blocks.get(key)

    @property
    def free_keys(self) -> int:
        """How many more keys fit without eviction (a key needs a slot in every pool)."""
        return min(pool.free for pool in self.pools)

    def add_filling(self, key: BlockKey, now: float) -> Block:
        return self.add_filling_batch([key], now)[0]

    def add_filling_batch(self, keys: list[BlockKey], now: float) -> list[Block]:
        """Records for ``keys``, in ``FILLING`` state. Each pool's slots are handed out in
        ascending order along the keys, so consecutive keys get adjacent slots whenever the
        free list allows: NIXL merges adjacent descriptors (+40 % at 64 KiB blocks)."""
        for key in keys:
            if key in self.blocks:
                raise KeyError(f"block index: key {key!r} already has a record")
        if self.journal is not None:
            self.journal.flush()
        per_pool = [pool.take_many(len(keys)) for pool in self.pools]
        blocks = [Block(key, slots, last_access=now) for key, slots in zip(keys, zip(*per_pool))]
        self.blocks.update(zip(keys, blocks))
        if self._filling is not None:
            self.view.update(dict.fromkeys(keys, self._filling))
        return blocks

    def commit(self, block: Block, score: float) -> None:
        block.state = BlockState.READY
        self.view[block.key] = self._ready
        self.rescore(block, score)
        if self.journal is not None:
            self.journal.committed(block.key, block.slots)

    def commit_many(self, blocks: Sequence[Block], scores: Sequence[float]) -> None:
        """:meth:`commit` for a batch (the blocks are held, FILLING, and carry no journal)."""
        assert self.journal is None, "commit_many: journaled indexes commit one by one"
        for block, score in zip(blocks, scores):
            block.state = BlockState.READY
            self.rescore(block, score)
        self.view.update(dict.fromkeys([b.key for b in blocks], self._ready))

    def flush_journal(self) -> None:
        if self.journal is not None:
            self.journal.flush()

    def restore(self, records: Sequence[tuple[BlockKey, tuple[int, ...]]]) -> list[Block]:
        """READY records for blocks recovered in the slots they had (checked by the caller:
        in range, one per pool, no slot twice), without recency; the caller queues them."""
        for pool, slots in zip(self.pools, zip(*(s for _, s in records))):
            pool.take_these(slots)
        blocks = []
        for key, slots in records:
            block = Block(key, slots, state=BlockState.READY)
            self.blocks[key] = block
            self.view[key] = self._ready
            blocks.append(block)
        return blocks

    def remove(self, block: Block) -> None:
        """Forget the record and free its slots: only when no transfer touches them."""
        self.detach(block)
        self.release_slots(block)

    def detach(self, block: Block) -> None:
        """Forget the record but keep its slots taken (quarantined): a transfer may still
        write them. :meth:`release_slots` frees them once it cannot."""
        del self.blocks[block.key]
        self.view.pop(block.key, None)
        block.version += 1
        if block.state is BlockState.READY and self.journal is not None:
            self.journal.removed(block.key)

    def holds(self, block: Block) -> bool:
        return self.blocks.get(block.key) is block

    def release_slots(self, block: Block) -> None:
        for pool, slot in zip(self.pools, block.slots):
            pool.release(slot)

    def touch(self, block: Block, now: float) -> None:
        block.access_count += 1
        block.last_access = now

    def rescore(self, block: Block, score: float) -> None:
        block.version += 1
        block.queued = True
        heapq.heappush(self._heap, (score, next(self._seq), block.key, block.version))
        if len(self._heap) > 2 * len(self.blocks) + 64:
            self._compact()

    def dequeue(self, block: Block) -> None:
        """Take a block out of the eviction queue while it is claimed: its entry goes stale
        (skipped when popped) and whoever drops the last claim queues it again."""
        block.version += 1
        block.queued = False

    def evict(self, wanted: int) -> list[Block]:
        """Remove up to ``wanted`` evictable blocks, lowest score first, and return them:
        :meth:`victims` for a tier that drops whatever it evicts, without a step per block
        through a generator. Claimed blocks met on the way leave the queue, as there."""
        out: list[Block] = []
        while len(out) < wanted and (block := self._pop_evictable()) is not None:
            out.append(block)
        for block in out:
            self.remove(block)
        return out

    def _pop_evictable(self) -> Block | None:
        """The lowest-scored evictable block, out of the queue (None when there is none).
        Stale entries are skipped; claimed blocks met on the way leave the queue."""
        while self._heap:
            _, _, key, version = heapq.heappop(self._heap)
            block = self.blocks.get(key)
            if block is None or block.version != version:
                continue
            if not self.evictable(block):
                block.queued = False
                continue
            return block
        return None

    def evictable(self, block: Block) -> bool:
        return block.state is BlockState.READY and block.claims == 0

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
                if self.holds(block):
                    self.rescore(block, score(block))

    def audit(self) -> dict[str, int]:
        """Where every slot is, for soak and debugging checks (never on a hot path).

        ``quarantined`` slots belong to no record and are not free: legitimate while a
        transfer may still write them (a withdrawn fill), a leak once nothing is in flight.
        ``double`` counts slots handed out twice (free and in a record, in two records, or
        free twice): always a bug. ``view_mismatch`` counts keys whose published query
        answer disagrees with their record."""
        double = quarantined = 0
        for p, pool in enumerate(self.pools):
            seen = [0] * pool.capacity
            for slot in pool._free:
                seen[slot] += 1
            for block in self.blocks.values():
                seen[block.slots[p]] += 1
            double += sum(1 for n in seen if n > 1)
            quarantined += sum(1 for n in seen if n == 0)
        wanted = {
            k: HIT if b.state is BlockState.READY else FETCHING for k, b in self.blocks.items()
        }
        mismatch = sum(
            1 for k in wanted.keys() | self.view.keys() if wanted.get(k) != self.view.get(k)
        )
        return {
            "blocks": len(self.blocks),
            "filling": sum(1 for b in self.blocks.values() if b.state is BlockState.FILLING),
            "claims": sum(b.claims for b in self.blocks.values()),
            "free": min((p.free for p in self.pools), default=0),
            "quarantined": quarantined,
            "double": double,
            "view_mismatch": mismatch,
            "heap": len(self._heap),
        }

    def _compact(self) -> None:
        live = [
            entry
            for entry in self._heap
            if (b := self.blocks.get(entry[2])) is not None and b.version == entry[3]
        ]
        heapq.heapify(live)
        self._heap = live
