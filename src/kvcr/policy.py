"""Admission and eviction policy (contract: ``kvcr.policy``).

A policy is consulted by kvcr's runtime thread only, one call at a time, so it needs no
locking; unlike the engine callbacks of ``KVCRBindings`` (made on the engine's thread), its
hooks never run on the engine's thread, so a hook must not touch engine state that the
engine mutates without a lock. The runtime asks:

- ``decide_ingest`` whether a block offered to a KVCR-owned tier is stored there
  (anything but ``DROP`` stores it in local G2);
- ``eviction_score`` how valuable a resident block is: the lowest score is evicted first.
  The score is taken whenever a block's metadata changes (ingest, access, alignment), so
  it should be a function of the ``BlockMeta`` it receives and of the policy's own state;
- ``decide_eviction`` what happens to a block chosen for eviction: ``(DROP, None)``, or
  ``(MOVE_TO, G3)`` to spill it to the file tier; ``KEEP`` refuses this eviction;
- ``decide_recovery`` what to do after a placement failed (a failed spill, say).

``on_ingest``, ``on_remove`` and ``on_align_sequence`` let a policy keep its own state.
A policy that needs a tier lists it in ``required_tiers``; ``KVCR`` refuses to start
without that tier.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from kvcr.types import (
    BlockKey,
    BlockMeta,
    CacheTier,
    PlacementAction,
    PlacementDecision,
    PlacementFailure,
)

#: The methods a policy object must have (a duck-typed policy needs all of them).
HOOKS = (
    "decide_ingest",
    "eviction_score",
    "decide_eviction",
    "on_ingest",
    "on_remove",
    "on_align_sequence",
    "decide_recovery",
)

STORE_LOCAL: PlacementDecision = (PlacementAction.COPY_TO, CacheTier.LOCAL_G2)
DROP: PlacementDecision = (PlacementAction.DROP, None)
SPILL_TO_G3: PlacementDecision = (PlacementAction.MOVE_TO, CacheTier.G3)


class KVCachePolicy:
    """Base policy: store everything, evict least recently used, drop on eviction."""

    required_tiers: frozenset[CacheTier] = frozenset()

    def decide_ingest(
        self,
        meta: BlockMeta,
        source: CacheTier,
        required_local: bool,
        router_hints: Mapping[str, Any] | None = None,
        framework_hints: Mapping[str, Any] | None = None,
    ) -> PlacementDecision:
        return STORE_LOCAL

    def eviction_score(self, meta: BlockMeta, source: CacheTier) -> float:
        return meta.last_access if meta.last_access is not None else float("-inf")

    def decide_eviction(self, meta: BlockMeta, source: CacheTier) -> PlacementDecision:
        return DROP

    def on_ingest(self, meta: BlockMeta, source: CacheTier) -> None:
        return None

    def on_remove(self, meta: BlockMeta) -> None:
        return None

    def on_align_sequence(self, blocks: Sequence[BlockMeta], use_current_time: bool) -> None:
        return None

    def decide_recovery(self, meta: BlockMeta, failure: PlacementFailure) -> PlacementDecision:
        return DROP


class LRUPolicy(KVCachePolicy):
    """Evict the block whose last access is oldest."""


class FIFOPolicy(KVCachePolicy):
    """Evict the block that entered a tier first; accesses do not change the order."""

    def __init__(self) -> None:
        self._order: dict[tuple[BlockKey, CacheTier], int] = {}
        self._counter = itertools.count()

    def on_ingest(self, meta: BlockMeta, source: CacheTier) -> None:
        for tier in meta.resident_tiers:
            self._order.setdefault((meta.block_key, tier), next(self._counter))

    def on_remove(self, meta: BlockMeta) -> None:
        for tier in CacheTier:
            self._order.pop((meta.block_key, tier), None)

    def eviction_score(self, meta: BlockMeta, source: CacheTier) -> float:
        order = self._order.get((meta.block_key, source))
        if order is None:
            # Not seen by on_ingest yet (the runtime scores before the hook on a new block).
            order = self._order[(meta.block_key, source)] = next(self._counter)
        return float(order)


class _SpillToG3:
    """Mixin: blocks evicted from local G2 move to G3; blocks evicted from G3 are dropped;
    a failed spill drops the block."""

    required_tiers: frozenset[CacheTier] = frozenset({CacheTier.G3})

    def decide_eviction(self, meta: BlockMeta, source: CacheTier) -> PlacementDecision:
        if source is CacheTier.LOCAL_G2 and CacheTier.G3 not in meta.resident_tiers:
            return SPILL_TO_G3
        return DROP


class G3LRUPolicy(_SpillToG3, LRUPolicy):
    """LRU in each tier; G2 evictions spill to G3."""


class G3FIFOPolicy(_SpillToG3, FIFOPolicy):
    """FIFO in each tier; G2 evictions spill to G3."""
