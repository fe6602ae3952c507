"""Local G2: deposit, deliver and fetch against KVCR-owned host-DRAM pools.

Each operation is one task (started by the runtime under the operation's deadline) and
moves all its blocks in one transfer. Keys shared between operations share work: a key
being filled by one deposit is awaited by others (a deliver or fetch of it, or a second
deposit), and if that fill fails or is aborted the waiting deposit fills it from its own
source.

Completion work runs in the transfer's ``on_terminal`` callback, not in the operation task:
when the task has been cancelled (deadline, abort, close) the transfer may still be
running, and its slots and claims must be held until it is not.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import trio

from kvcr.policy import HOOKS as POLICY_HOOKS
from kvcr.policy import KVCachePolicy
from kvcr.runtime.index import Block, BlockIndex, BlockState
from kvcr.runtime.memory import MemoryMap
from kvcr.runtime.ops import DROPPED, FAILED, SUCCESS, Operation, Outbox
from kvcr.runtime.transfers import Transfers, Xfer
from kvcr.telemetry import SCOPE_G3_DELIVER
from kvcr.transport.base import Transport, TransportError
from kvcr.types import (
    BlockKey,
    BlockMeta,
    CacheTier,
    InventoryEvent,
    OpEntryResult,
    OpEntryStatus,
    PlacementAction,
    PlacementFailure,
    ReleaseHandle,
)

if TYPE_CHECKING:
    from kvcr.runtime.g3 import G3Tier

_G2 = frozenset({CacheTier.LOCAL_G2})
_G3 = frozenset({CacheTier.G3})
_STORE = (PlacementAction.COPY_TO, CacheTier.LOCAL_G2)
_DROP = (PlacementAction.DROP, None)
_NONE: frozenset[CacheTier] = frozenset()


async def wait_filled(block: Block) -> None:
    """Wait until ``block``'s fill is over, committed or not. The event is made only when
    somebody waits: most fills have no waiter."""
    if block.waiters is None:
        block.waiters = trio.Event()
    await block.waiters.wait()


def fill_over(block: Block) -> None:
    if block.waiters is not None:
        block.waiters.set()
        block.waiters = None


class LocalG2:
    def __init__(
        self,
        *,
        memory: MemoryMap,
        index: BlockIndex,
        transfers: Transfers[Transport],
        outbox: Outbox,
        policy: KVCachePolicy,
        watermark_percent: int,
        live_handles: set[int],
        release_ids: itertools.count,
        source_tier: CacheTier,
        callbacks: Any,
        log: Any,
    ) -> None:
        self.memory = memory
        self.index = index
        self.transfers = transfers
        self.outbox = outbox
        self.policy = policy
        self.live_handles = live_handles
        self.release_ids = release_ids
        self.source_tier = source_tier
        self.callbacks = callbacks
        self.log = log
        self.handles: dict[int, BlockKey] = {}
        # Hooks the policy leaves as KVCachePolicy's defaults are not called: the default is
        # applied directly, which saves a BlockMeta and a call per key on the hot paths.
        self._hooks = {
            hook: None
            if getattr(type(policy), hook, None) is getattr(KVCachePolicy, hook)
            else getattr(policy, hook)
            for hook in POLICY_HOOKS
        }
        self.watermark = [math.ceil(p.capacity * watermark_percent / 100) for p in index.pools]
        # The file tier, once the runtime has started it; spills run as tasks of ``spawn``.
        self.g3: G3Tier | None = None
        self.spawn: Callable[..., None] | None = None
        self._spilling = 0  # G2 blocks on their way to G3: their slots free up when stored
        self._spilled = trio.Event()

    # -- policy plumbing -------------------------------------------------------------------

    def meta(self, block: Block, resident: frozenset[CacheTier] | None = None) -> BlockMeta:
        if resident is None:
            resident = _G2 if block.state is BlockState.READY else _NONE
            if self.g3 is not None and block.key in self.g3:
                resident = resident | _G3
        return BlockMeta(
            block.key,
            self.memory.bytes_per_key,
            block.access_count,
            block.last_access,
            resident,
            block.position,
        )

    def score(self, block: Block) -> float:
        if self._hooks["eviction_score"] is None:  # the base policy: least recently used
            return block.last_access if block.last_access is not None else float("-inf")
        score: float = self._policy("eviction_score", 0.0, self.meta(block), CacheTier.LOCAL_G2)
        return score

    def _policy(self, hook: str, default: Any, *args: Any) -> Any:
        fn = self._hooks[hook]
        if fn is None:
            return default
        try:
            return fn(*args)
        except Exception as exc:
            self.log.error("policy_hook_failed", hook=hook, error=repr(exc))
            return default

    def _wants(self, hook: str) -> bool:
        return self._hooks[hook] is not None

    def decide_ingest(
        self,
        meta: BlockMeta,
        source: CacheTier,
        required_local: bool,
        default: tuple[PlacementAction, CacheTier | None],
        hints: Mapping[str, Any] | None,
    ) -> tuple[PlacementAction, CacheTier | None]:
        if not self._wants("decide_ingest"):
            return default
        decision: tuple[PlacementAction, CacheTier | None] = self._policy(
            "decide_ingest", default, meta, source, required_local, hints, None
        )
        return decision

    def ingested(self, block: Block, source: CacheTier) -> None:
        if self._wants("on_ingest"):
            self._policy("on_ingest", None, self.meta(block), source)

    # -- claims and release handles ----------------------------------------------------------

    def claim(self, block: Block, now: float) -> None:
        """An access that holds the block until ``unclaim``: out of the eviction queue
        meanwhile, queued again with a fresh score when the last claim goes."""
        block.claims += 1
        self.index.touch(block, now)
        if block.queued:
            self.index.dequeue(block)

    def unclaim(self, block: Block) -> None:
        block.claims -= 1
        if block.claims == 0 and not block.queued and self.index.holds(block):
            self.index.rescore(block, self.score(block))

    def hold(self, block: Block) -> ReleaseHandle:
        """A claim the engine drops with ``release``: the block stays resident until then."""
        block.claims += 1
        if block.queued:
            self.index.dequeue(block)
        handle = ReleaseHandle(next(self.release_ids))
        self.handles[handle] = block.key
        self.live_handles.add(handle)
        return handle

    def release(self, handle: int) -> None:
        key = self.handles.pop(handle, None)
        block = self.index.get(key) if key is not None else None
        if block is not None:
            self.unclaim(block)

    # -- room ------------------------------------------------------------------------------

    def reserve(self, wanted: int, what: str) -> int:
        """Make room for up to ``wanted`` keys, evicting by policy score; returns how many
        fit. Tells the engine (capacity_needed_callback) when policy cannot free enough
        room for the request plus the low watermark."""
        pools = self.index.pools
        coming = self._spilling  # slots that spills in flight will free
        deficit = max(wanted + wm - p.free - coming for p, wm in zip(pools, self.watermark))
        if deficit > 0:
            self.evict(deficit)
        granted = min(wanted, self.index.free_keys)
        short = [
            (p.name, wanted + wm - p.free - self._spilling)
            for p, wm in zip(pools, self.watermark)
            if wanted + wm - p.free - self._spilling > 0
        ]
        if short:
            self.log.info("capacity_needed", op=what, pools=short, granted=granted, wanted=wanted)
            self.callbacks.capacity_needed(short)
        return granted

    async def make_room(self, wanted: int, what: str) -> int:
        """:meth:`reserve`, then, while spills to G3 are on their way and would free what
        is missing, wait for them (within the operation's deadline)."""
        granted = self.reserve(wanted, what)
        while granted < wanted and self._spilling:
            await self._spilled.wait()
            granted = min(wanted, self.index.free_keys)
        return granted

    def evict(self, count: int) -> int:
        removed: list[BlockKey] = []
        spills: list[Block] = []
        victims = self.index.victims(self.score)
        with contextlib.closing(victims):
            for block in victims:
                if len(removed) + len(spills) >= count:
                    break
                if self._wants("decide_eviction"):
                    action, tier = self._policy(
                        "decide_eviction", _DROP, self.meta(block), CacheTier.LOCAL_G2
                    )
                    if action is PlacementAction.KEEP:
                        continue
                    if action is PlacementAction.MOVE_TO and tier is CacheTier.G3 and self.g3:
                        # The slot stays until the G3 copy is committed: claimed meanwhile.
                        block.claims += 1
                        block.queued = False
                        spills.append(block)
                        continue
                self.index.remove(block)
                if self._wants("on_remove"):
                    self._policy("on_remove", None, self.meta(block, _NONE))
                removed.append(block.key)
        if spills:
            assert self.spawn is not None
            self._spilling += len(spills)
            self.spawn(self._spill, spills)
        if removed:
            self.callbacks.inventory(InventoryEvent(tuple(removed), CacheTier.LOCAL_G2, True))
        return len(removed)

    async def _spill(self, blocks: list[Block]) -> None:
        """Store evicted blocks in G3, then free their G2 slots; a failed store goes to the
        policy's ``decide_recovery`` (the default drops the block)."""
        assert self.g3 is not None
        base = self.memory.pool_base[0]  # G3 needs exactly one pool
        try:
            stored = await self.g3.store([(b.key, base + b.slots[0]) for b in blocks], "spill")
        except Exception as exc:  # a bug must not leak the claims
            self.log.exception("spill_failed", error=repr(exc))
            stored = set()
        finally:
            self._spilling -= len(blocks)
        removed: list[BlockKey] = []
        for block in blocks:
            block.claims -= 1
            if not self.index.holds(block):
                continue
            if block.key not in stored:
                failure = PlacementFailure(
                    (PlacementAction.MOVE_TO, CacheTier.G3),
                    CacheTier.LOCAL_G2,
                    "G3 store failed",
                    1,
                )
                action, _ = self._policy("decide_recovery", _DROP, self.meta(block), failure)
                if action is PlacementAction.KEEP:
                    if block.claims == 0:
                        self.index.rescore(block, self.score(block))  # back in the queue
                    continue
            if block.claims:  # read meanwhile: it stays in G2 too, until evicted again
                continue
            self.index.remove(block)
            removed.append(block.key)
        if stored:
            self.callbacks.inventory(InventoryEvent(tuple(stored), CacheTier.G3, False))
        if removed:
            self.callbacks.inventory(InventoryEvent(tuple(removed), CacheTier.LOCAL_G2, True))
        self._spilled.set()
        self._spilled = trio.Event()

    # -- waiting for fills in progress ---------------------------------------------------------

    async def wait_fills(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            block = self.index.get(key)
            if block is not None and block.state is BlockState.FILLING:
                await wait_filled(block)

    # -- deposit ---------------------------------------------------------------------------

    async def deposit(
        self,
        op: Operation,
        sources: Mapping[BlockKey, tuple[int, ...]],
        no_evict: bool,
        hints: Mapping[str, Any] | None,
    ) -> None:
        todo = list(op.keys)
        while todo:
            waits = await self._deposit_round(op, todo, sources, no_evict, hints)
            todo = []
            for key, block in waits:
                if block.state is BlockState.FILLING and self.index.holds(block):
                    await wait_filled(block)
                if not op.live(key):
                    continue
                if self.index.holds(block) and block.state is BlockState.READY:
                    self.outbox.answer(op, {key: self._stored(block, no_evict)})
                else:
                    todo.append(key)  # the fill we waited for failed: fill from our source

    def _stored(self, block: Block, no_evict: bool) -> OpEntryResult:
        if no_evict:
            return OpEntryResult(OpEntryStatus.SUCCESS, release_handle=self.hold(block))
        return SUCCESS

    async def _deposit_round(
        self,
        op: Operation,
        keys: Sequence[BlockKey],
        sources: Mapping[BlockKey, tuple[int, ...]],
        no_evict: bool,
        hints: Mapping[str, Any] | None,
    ) -> list[tuple[BlockKey, Block]]:
        now = trio.current_time()
        answers: dict[BlockKey, OpEntryResult] = {}
        waits: list[tuple[BlockKey, Block]] = []
        new: list[BlockKey] = []
        for key in keys:
            if not op.live(key):
                continue
            block = self.index.get(key)
            if block is None:
                action = _STORE[0]
                if self._wants("decide_ingest"):
                    meta = BlockMeta(key, self.memory.bytes_per_key, 0, None, _NONE)
                    action, _ = self.decide_ingest(meta, self.source_tier, False, _STORE, hints)
                if action is PlacementAction.DROP:
                    answers[key] = DROPPED
                else:
                    new.append(key)
            elif block.state is BlockState.READY:
                self.index.touch(block, now)
                self.index.rescore(block, self.score(block))
                answers[key] = self._stored(block, no_evict)
            else:
                waits.append((key, block))
        granted = await self.make_room(len(new), f"deposit op {op.handle}") if new else 0
        for key in new[granted:]:
            answers[key] = FAILED
        if new[granted:]:
            op.failure = (
                f"deposit: no free slot for {len(new) - granted} of {len(new)} new keys "
                f"(capacity {self.index.pools[0].capacity} blocks per pool, claimed or "
                "no_evict blocks cannot be evicted)"
            )
        self.outbox.answer(op, answers)
        blocks = self.index.add_filling_batch(new[:granted], now)
        if blocks:
            await self._fill(op, blocks, sources, no_evict)
        return waits

    async def _fill(
        self,
        op: Operation,
        blocks: list[Block],
        sources: Mapping[BlockKey, tuple[int, ...]],
        no_evict: bool,
    ) -> None:
        dst: list[int] = []
        src: list[int] = []
        bases = self.memory.pool_base
        filling = op.filling
        for block in blocks:
            filling[block.key] = block
            dst.extend(base + slot for base, slot in zip(bases, block.slots))
            src.extend(sources[block.key])
        nbytes = len(blocks) * self.memory.bytes_per_key
        keys = frozenset(b.key for b in blocks)

        def settle(xfer: Xfer) -> None:
            self.outbox.xfer_terminal(op, xfer)
            self._settle_fill(op, blocks, xfer.ok, no_evict)

        try:
            xfer = self.transfers.start(dst, src, f"deposit op {op.handle}", nbytes, settle)
        except TransportError as exc:
            op.failure = str(exc)
            self._settle_fill(op, blocks, False, no_evict)
            return
        if not xfer.done.is_set():
            op.xfers[xfer] = keys
            await xfer.done.wait()

    def _settle_fill(self, op: Operation, blocks: list[Block], ok: bool, no_evict: bool) -> None:
        answers: dict[BlockKey, OpEntryResult] = {}
        added: list[BlockKey] = []
        for block in blocks:
            op.filling.pop(block.key, None)
            if not self.index.holds(block):  # withdrawn while the transfer ran
                self.index.release_slots(block)
                continue
            if ok and op.live(block.key):
                self.index.commit(block, self.score(block))
                self.ingested(block, self.source_tier)
                answers[block.key] = self._stored(block, no_evict)
                added.append(block.key)
            else:
                # Failed, timed out or aborted: a late success never becomes a success,
                # and the engine may already be reusing the source memory.
                self.index.remove(block)
                if op.live(block.key):
                    answers[block.key] = FAILED
            fill_over(block)
        self.index.flush_journal()  # committed before the engine hears of it
        op.moved += len(added)
        if added:
            self.callbacks.inventory(InventoryEvent(tuple(added), CacheTier.LOCAL_G2, False))
        if not ok:
            op.failure = op.failure or "deposit: the transfer into local G2 failed"
        self.outbox.answer(op, answers)

    def withdraw(self, op: Operation, keys: Sequence[BlockKey]) -> None:
        """The operation gave up on ``keys`` (deadline, abort, close) while their fill may be
        in flight: they leave the index at once (a query says MISS, waiters stop waiting),
        but their slots stay taken until the transfer is terminal."""
        for key in keys:
            block = op.filling.get(key)
            if block is None or not self.index.holds(block):
                continue
            self.index.detach(block)
            fill_over(block)

    # -- deliver ---------------------------------------------------------------------------

    async def deliver(
        self,
        op: Operation,
        destinations: Mapping[BlockKey, tuple[int, ...]],
        keys: Sequence[BlockKey],
    ) -> None:
        await self.wait_fills(keys)
        now = trio.current_time()
        answers: dict[BlockKey, OpEntryResult] = {}
        claimed: list[Block] = []
        bases = self.memory.pool_base
        dst: list[int] = []
        src: list[int] = []
        for key in keys:
            if not op.live(key):
                continue
            block = self.index.get(key)
            if block is None or block.state is not BlockState.READY:
                answers[key] = FAILED
                continue
            self.claim(block, now)
            claimed.append(block)
            dst.extend(destinations[key])
            src.extend(base + slot for base, slot in zip(bases, block.slots))
        if answers:
            op.failure = op.failure or f"deliver: {len(answers)} keys are not in local G2"
        self.outbox.answer(op, answers)
        if not claimed:
            return

        def settle(xfer: Xfer) -> None:
            self.outbox.xfer_terminal(op, xfer)
            self._settle_deliver(op, claimed, xfer.ok)

        nbytes = len(claimed) * self.memory.bytes_per_key
        try:
            xfer = self.transfers.start(dst, src, f"deliver op {op.handle}", nbytes, settle)
        except TransportError as exc:
            op.failure = str(exc)
            self._settle_deliver(op, claimed, False)
            return
        if not xfer.done.is_set():
            op.xfers[xfer] = frozenset(b.key for b in claimed)
            await xfer.done.wait()

    def _settle_deliver(self, op: Operation, claimed: list[Block], ok: bool) -> None:
        answers: dict[BlockKey, OpEntryResult] = {}
        for block in claimed:
            self.unclaim(block)
            if op.live(block.key):
                answers[block.key] = SUCCESS if ok else FAILED
        if ok:
            op.moved += len(answers)
        else:
            op.failure = op.failure or "deliver: the transfer from local G2 failed"
        self.outbox.answer(op, answers)

    # -- fetch -----------------------------------------------------------------------------

    def fetch_ready(self, op: Operation, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Claim and answer the keys that are ready now; the keys still being filled are
        returned for :meth:`fetch`. Synchronous on purpose: the runtime calls it before the
        rest of the operation (a peer or G3 part that makes room) can evict these blocks."""
        filling = [
            k
            for k in keys
            if (b := self.index.get(k)) is not None and b.state is BlockState.FILLING
        ]
        self._claim_fetched(op, [k for k in keys if k not in filling] if filling else keys)
        return filling

    async def fetch(self, op: Operation, keys: Sequence[BlockKey]) -> None:
        await self.wait_fills(keys)
        self._claim_fetched(op, keys)

    def _claim_fetched(self, op: Operation, keys: Sequence[BlockKey]) -> None:
        now = trio.current_time()
        answers: dict[BlockKey, OpEntryResult] = {}
        for key in keys:
            if not op.live(key):
                continue
            block = self.index.get(key)
            if block is None or block.state is not BlockState.READY:
                answers[key] = FAILED
                continue
            self.index.touch(block, now)
            answers[key] = self.claimed_entry(block)
        if len(answers) != sum(1 for a in answers.values() if a.success):
            op.failure = op.failure or "fetch: some keys are not in local G2"
        self.outbox.answer(op, answers)

    # -- G3 --------------------------------------------------------------------------------

    def g3_score(self, block: Block) -> float:
        if self._hooks["eviction_score"] is None:
            return block.last_access if block.last_access is not None else float("-inf")
        meta = BlockMeta(
            block.key,
            self.memory.bytes_per_key,
            block.access_count,
            block.last_access,
            _G3,
            block.position,
        )
        score: float = self._policy("eviction_score", 0.0, meta, CacheTier.G3)
        return score

    def g3_removed(self, keys: list[BlockKey]) -> None:
        """G3 evicted (or stopped trusting) ``keys``: inventory, and ``on_remove`` for those
        with no copy left in G2 either."""
        self.callbacks.inventory(InventoryEvent(tuple(keys), CacheTier.G3, True))
        if self._wants("on_remove"):
            for key in keys:
                if self.index.get(key) is None:
                    meta = BlockMeta(key, self.memory.bytes_per_key, 0, None, _NONE)
                    self._policy("on_remove", None, meta)

    async def deliver_g3(
        self,
        op: Operation,
        destinations: Mapping[BlockKey, tuple[int, ...]],
        keys: Sequence[BlockKey],
    ) -> None:
        """Read G3 blocks straight into the engine's destinations."""
        assert self.g3 is not None
        live = [k for k in keys if op.live(k)]
        got = await self.g3.read(
            [(k, destinations[k][0]) for k in live], f"deliver op {op.handle}", SCOPE_G3_DELIVER
        )
        answers = {k: SUCCESS if k in got else FAILED for k in live if op.live(k)}
        if len(got) < len(live):
            op.failure = op.failure or "deliver: some G3 blocks could not be read back"
        self.outbox.answer(op, answers)  # bytes are counted under g3_deliver

    async def fetch_g3(self, op: Operation, keys: Sequence[BlockKey]) -> None:
        """Fill G2 slots from G3; each success is claimed like any fetch."""
        assert self.g3 is not None
        live = [k for k in keys if op.live(k) and self.index.get(k) is None]
        granted = await self.make_room(len(live), f"fetch op {op.handle}")
        answers: dict[BlockKey, OpEntryResult] = dict.fromkeys(live[granted:], FAILED)
        blocks = self.index.add_filling_batch(live[:granted], trio.current_time())
        base = self.memory.pool_base[0]
        for block in blocks:
            op.filling[block.key] = block
        try:
            got = await self.g3.read(
                [(b.key, base + b.slots[0]) for b in blocks], f"fetch op {op.handle}"
            )
        finally:
            for block in blocks:
                op.filling.pop(block.key, None)
        for block in blocks:
            if not self.index.holds(block):  # withdrawn meanwhile; the read is over
                self.index.release_slots(block)
                fill_over(block)
        answers.update(self.commit_fetched(op, blocks, got, CacheTier.G3))
        if sum(1 for a in answers.values() if a.success) < len(live):
            op.failure = op.failure or "fetch: some G3 blocks could not be read back"
        self.outbox.answer(op, answers)  # bytes are counted under g3_fill

    def commit_fetched(
        self, op: Operation, blocks: list[Block], arrived: set[BlockKey], source: CacheTier
    ) -> dict[BlockKey, OpEntryResult]:
        """End a fetch's fill of ``blocks`` (those still in the index; the caller handles the
        withdrawn ones): the keys that ``arrived`` are committed and claimed, the others
        dropped; journal and inventory follow before the engine hears of them."""
        answers: dict[BlockKey, OpEntryResult] = {}
        added: list[BlockKey] = []
        for block in blocks:
            if not self.index.holds(block):
                continue
            if block.key in arrived and op.live(block.key):
                self.index.commit(block, self.score(block))
                self.ingested(block, source)
                answers[block.key] = self.claimed_entry(block)
                added.append(block.key)
            else:
                self.index.remove(block)  # the fill is over: nothing writes these slots
                if op.live(block.key):
                    answers[block.key] = FAILED
            fill_over(block)
        self.index.flush_journal()
        if added:
            self.callbacks.inventory(InventoryEvent(tuple(added), CacheTier.LOCAL_G2, False))
        return answers

    def claimed_entry(self, block: Block) -> OpEntryResult:
        """A fetch's success: where the block is, and the claim that keeps it there."""
        return OpEntryResult(
            OpEntryStatus.SUCCESS,
            descriptors=[self.memory.slot_ref(p, s) for p, s in enumerate(block.slots)],
            release_handle=self.hold(block),
        )

    # -- alignment -------------------------------------------------------------------------

    def align(self, keys: Sequence[BlockKey], use_current_time: bool, now: float) -> None:
        placed = [
            (position, b)
            for position, k in enumerate(keys)
            if (b := self.index.get(k)) is not None and b.state is BlockState.READY
        ]
        if not placed:
            return
        blocks = [b for _, b in placed]
        if use_current_time:
            anchor = now
        else:
            anchor = max(b.last_access for b in blocks if b.last_access is not None)
        # Earlier positions of a prefix are worth more than later ones: they become the
        # most recent, so a prefix is evicted from its tail.
        for position, block in placed:
            block.position = position
            block.last_access = anchor - position * 1e-9
        # The hook first, then the scores: a policy may score by what the hook taught it.
        if self._wants("on_align_sequence"):
            metas = [self.meta(b) for b in blocks]
            self._policy("on_align_sequence", None, metas, use_current_time)
        for block in blocks:
            self.index.rescore(block, self.score(block))


CapacityCallback = Callable[[list[tuple[str, int]]], None]
