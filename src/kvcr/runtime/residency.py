"""What local G2 holds and for how long: the policy's hooks, claims and release handles,
and room (eviction by policy score, spills to G3, the low watermark).

A block is resident while it is in the index. A *claim* keeps it there (out of the eviction
queue): an operation's transfer reading it, a source's write, or a release handle the engine
holds. The last claim going puts it back in the queue with a fresh score. The operations
that move bytes (``local.py``) build on this.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypedDict

import trio

from kvcr.config import KVCRConfig
from kvcr.policy import HOOKS as POLICY_HOOKS
from kvcr.policy import KVCachePolicy
from kvcr.runtime.engine_calls import EngineCalls
from kvcr.runtime.fill_waiters import FillWaiters
from kvcr.runtime.g3 import G3Tier
from kvcr.runtime.memory import MemoryMap
from kvcr.runtime.ops import Outbox
from kvcr.runtime.transfers import Transfers
from kvcr.store.batches import Claim
from kvcr.store.index import BlockIndex
from kvcr.store.records import Block, BlockState
from kvcr.transport.base import Transport
from kvcr.types import (
    BlockKey,
    BlockMeta,
    CacheTier,
    InventoryEvent,
    PlacementAction,
    PlacementFailure,
    ReleaseHandle,
)

_G2 = frozenset({CacheTier.LOCAL_G2})
_G3 = frozenset({CacheTier.G3})
_DROP = (PlacementAction.DROP, None)
_NONE: frozenset[CacheTier] = frozenset()


def custom_hooks(policy: KVCachePolicy) -> frozenset[str]:
    """The hooks ``policy`` defines itself (the others are KVCachePolicy's defaults, which
    the tier applies directly: no BlockMeta, no call)."""
    return frozenset(
        hook
        for hook in POLICY_HOOKS
        if getattr(type(policy), hook, None) is not getattr(KVCachePolicy, hook)
    )


class IndexOptions(TypedDict):
    score_is_recency: bool
    policy_metadata: bool


def index_options(policy: KVCachePolicy) -> IndexOptions:
    """How a block index serves ``policy``: the base policy scores by recency alone (one
    array for both), and only a policy's own hooks read access counts and positions."""
    hooks = custom_hooks(policy)
    return {"score_is_recency": "eviction_score" not in hooks, "policy_metadata": bool(hooks)}


class Residency:
    def __init__(
        self,
        *,
        index: BlockIndex,
        transfers: Transfers[Transport],
        policy: KVCachePolicy,
        memory: MemoryMap,
        config: KVCRConfig,
        calls: EngineCalls,  # the policy's and the engine's notifications (inventory, ...)
        outbox: Outbox,
        live_handles: set[int],  # release handles the engine holds (Shared.live_handles)
        release_ids: Iterator[int],
        source_tier: CacheTier,
        log: Any,
    ) -> None:
        self.index = index
        self.transfers = transfers
        self.fill_waiters = FillWaiters()
        self.policy = policy
        self.memory = memory
        self.config = config
        self.outbox = outbox
        self.log = log
        self.live_handles = live_handles
        self.release_ids = release_ids
        self.source_tier = source_tier
        self.callbacks = calls
        self.abandon_s = config.abandon_timeout_ms / 1000
        watermark_percent = config.capacity_low_watermark_percent
        self.handles: dict[int, BlockKey] = {}
        self._drop_at_release: set[int] = set()  # no_retain fetches' release handles
        # Hooks the policy leaves as KVCachePolicy's defaults are not called: the default is
        # applied directly, which saves a BlockMeta and a call per key on the hot paths.
        custom = custom_hooks(policy)
        self._hooks = {
            hook: getattr(policy, hook) if hook in custom else None for hook in POLICY_HOOKS
        }
        self.watermark = [math.ceil(p.capacity * watermark_percent / 100) for p in index.pools]
        # The file tier, once the runtime has started it; spills run as tasks of ``spawn``.
        self.g3: G3Tier | None = None
        self.spawn: Callable[..., None] | None = None
        self._spilling = 0  # G2 blocks on their way to G3: their slots free up when stored
        self._spilled = trio.Event()

    # -- policy plumbing -------------------------------------------------------------------

    @property
    def scores_by_policy(self) -> bool:
        """Whether the policy scores blocks itself (else: by recency)."""
        return self._hooks["eviction_score"] is not None

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

    def score(self, block: Block, tier: CacheTier = CacheTier.LOCAL_G2) -> float:
        """``block``'s eviction score in ``tier`` (its G2 record, or its G3 one)."""
        if self._hooks["eviction_score"] is None:  # the base policy: least recently used
            return block.last_access if block.last_access is not None else float("-inf")
        meta = self.meta(block, None if tier is CacheTier.LOCAL_G2 else _G3)
        score: float = self._policy("eviction_score", 0.0, meta, tier)
        return score

    def scores(self, blocks: Sequence[Block]) -> list[float] | None:
        """The blocks' G2 eviction scores, or None when they are their recency (the base
        policy: the index reads them from its arrays)."""
        if self._hooks["eviction_score"] is None:
            return None
        return [self.score(block) for block in blocks]

    def unclaim_records(self, claim: Claim) -> None:
        """:meth:`unclaim` for records claimed at once (``BlockIndex.claim_ready``)."""
        back = self.index.unclaim_records(claim)
        if len(back):
            blocks = self.index.views(back) if self.scores_by_policy else []
            self.index.requeue(back, self.scores(blocks))

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
        """An access that holds the block until ``unclaim``: out of the eviction queue."""
        self.index.claim(block, now)

    def unclaim(self, block: Block) -> None:
        self.index.unclaim_scored(block, self.score)

    def hold(self, block: Block) -> ReleaseHandle:
        """A claim the engine drops with ``release``: the block stays resident until then."""
        self.index.claim(block)
        handle = ReleaseHandle(next(self.release_ids))
        self.handles[handle] = block.key
        self.live_handles.add(handle)
        return handle

    def release(self, handle: int) -> None:
        key = self.handles.pop(handle, None)
        block = self.index.get(key) if key is not None else None
        if block is not None:
            self.unclaim(block)
        if handle in self._drop_at_release:
            self._drop_at_release.discard(handle)
            if key is not None:
                self.drop_unclaimed([key], "no_retain")

    def drop_at_release(self, handles: Iterable[ReleaseHandle | None]) -> None:
        """A ``no_retain`` fetch: its blocks leave local G2 when the engine releases them
        (unless another claim holds them then: that reader keeps them until it is done)."""
        self._drop_at_release.update(h for h in handles if h is not None)

    def drop_unclaimed(self, keys: Iterable[BlockKey], why: str) -> list[BlockKey]:
        """Remove the READY, unclaimed blocks of ``keys`` from local G2 (a claimed one is
        being read: it stays); journal and inventory follow. Returns the keys removed."""
        removed: list[BlockKey] = []
        for key in keys:
            block = self.index.get(key)
            if block is None or block.state is not BlockState.READY or block.claims:
                continue
            self.index.remove(block)
            if self._wants("on_remove"):
                self._policy("on_remove", None, self.meta(block, _NONE))
            removed.append(key)
        if removed:
            self.index.flush_journal()
            self.log.debug("blocks_dropped", why=why, keys=len(removed))
            self.callbacks.inventory(InventoryEvent(tuple(removed), CacheTier.LOCAL_G2, True))
        return removed

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
        if not self._wants("decide_eviction") and not self._wants("on_remove"):
            # Nothing to ask the policy per block: the index evicts in one pass.
            dropped = self.index.evict(count)
            if dropped:
                self.callbacks.inventory(InventoryEvent(tuple(dropped), CacheTier.LOCAL_G2, True))
            return len(dropped)
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
                        # The slot stays until the G3 copy is committed: claimed meanwhile
                        # (and out of the queue: the victims already are).
                        block.claims += 1
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
        """Store evicted blocks in G3; their G2 slots are freed once the store is over
        (:meth:`_spilled_over`). Waiting for room stops at ``abandon_timeout_ms``: a store
        still running then is reported, and its blocks stay claimed until it ends."""
        assert self.g3 is not None
        base = self.memory.pool_base[0]  # G3 needs exactly one pool
        items = [(b.key, base + b.slots[0]) for b in blocks]
        over = False

        def settle(_xfer: object, stored: set[BlockKey]) -> None:
            nonlocal over
            over = True
            self._spilled_over(blocks, stored)

        try:
            xfer = self.g3.store(items, "spill", settle)
            if xfer is not None:
                with trio.move_on_after(self.abandon_s):
                    await xfer.done.wait()
                if not xfer.done.is_set():
                    self.log.warning(
                        "transfer_abandoned",
                        what="spill",
                        blocks=len(blocks),
                        reason="still in flight past abandon_timeout_ms; its memory stays held",
                    )
        except Exception as exc:  # a bug must not leak the claims
            self.log.exception("spill_failed", error=repr(exc))
            if not over:
                self._spilled_over(blocks, set())
        finally:
            self._spilling -= len(blocks)
            self._spilled.set()
            self._spilled = trio.Event()

    def _spilled_over(self, blocks: list[Block], stored: set[BlockKey]) -> None:
        """The spill of ``blocks`` is over (``stored``: the keys now in G3): their G2 claims
        end; a failed store goes to the policy's ``decide_recovery`` (the default drops the
        block)."""
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

    # -- waiting for fills in progress ---------------------------------------------------------

    async def wait_fills(self, keys: Sequence[BlockKey]) -> None:
        for key in self.index.filling(keys):
            block = self.index.get(key)
            if block is not None and block.state is BlockState.FILLING:
                await self.fill_waiters.wait(block)

    # -- G3 --------------------------------------------------------------------------------

    def g3_score(self, block: Block) -> float:
        return self.score(block, CacheTier.G3)

    def g3_removed(self, keys: list[BlockKey]) -> None:
        """G3 evicted (or stopped trusting) ``keys``: inventory, and ``on_remove`` for those
        with no copy left in G2 either."""
        self.callbacks.inventory(InventoryEvent(tuple(keys), CacheTier.G3, True))
        if self._wants("on_remove"):
            for key in keys:
                if self.index.get(key) is None:
                    meta = BlockMeta(key, self.memory.bytes_per_key, 0, None, _NONE)
                    self._policy("on_remove", None, meta)

    # -- alignment -------------------------------------------------------------------------

    def align(self, keys: Sequence[BlockKey], use_current_time: bool, now: float) -> None:
        # Earlier positions of a prefix are worth more than later ones: they become the
        # most recent, so a prefix is evicted from its tail.
        recs = self.index.align(keys, now if use_current_time else None)
        if not len(recs):
            return
        hook, scored = self._wants("on_align_sequence"), self.scores_by_policy
        blocks = self.index.views(recs) if hook or scored else []
        # The hook first, then the scores: a policy may score by what the hook taught it.
        if hook:
            metas = [self.meta(b) for b in blocks]
            self._policy("on_align_sequence", None, metas, use_current_time)
        self.index.requeue(recs, self.scores(blocks) if scored else None)
