"""Local G2: deposit, deliver and fetch against KVCR-owned host-DRAM pools (what stays
resident, and for how long, is ``residency.py``).

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

from collections.abc import Iterable, Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np
import trio

from kvcr.runtime.ops import DROPPED, FAILED, SUCCESS, Operation
from kvcr.runtime.residency import Residency
from kvcr.runtime.transfers import Xfer
from kvcr.store.batches import Claim, Filling, Found
from kvcr.store.records import Block, BlockState
from kvcr.telemetry import SCOPE_G3_DELIVER
from kvcr.transport.base import TransportError
from kvcr.types import (
    BlockKey,
    BlockMeta,
    CacheTier,
    InventoryEvent,
    OpEntryResult,
    OpEntryStatus,
    PlacementAction,
)

_STORE = (PlacementAction.COPY_TO, CacheTier.LOCAL_G2)
_NONE: frozenset[CacheTier] = frozenset()


class LocalG2(Residency):
    """Deposit, deliver and fetch against the pools (see the module docstring)."""

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
                    await self.fill_waiters.wait(block)
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
        found = None  # when set: ``new`` are keys it found absent
        pending, index = op.pending, self.index
        live = keys if pending.issuperset(keys) else [k for k in keys if k in pending]
        if not self._wants("decide_ingest"):
            # The usual case: every key not in the index is stored, nothing to ask per key.
            found = index.lookup_to_fill(live)
            held = found.held()
            new = (
                list(live) if not held.any() else [k for k, h in zip(live, held.tolist()) if not h]
            )
            if len(new) == len(live):
                live = []
            else:  # the others are in the index: the loop below sees to them
                fresh = set(new)
                live = [k for k in live if k not in fresh]
        for key in live:
            block = index.get(key)
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
        if granted:
            fill = self.index.add_fills(new[:granted], now, found)
            await self._fill(op, fill, sources, no_evict)
        return waits

    async def _fill(
        self,
        op: Operation,
        fill: Filling,
        sources: Mapping[BlockKey, tuple[int, ...]],
        no_evict: bool,
    ) -> None:
        bases = self.memory.pool_base
        keys = fill.keys
        op.fills.append(fill)
        # Each key's descriptors in pool order, as its sources are (one pass in C).
        src = list(chain.from_iterable(map(sources.__getitem__, keys)))
        if len(bases) == 1:  # one pool, the usual case: one descriptor a key, the record's
            dst = (fill.recs + bases[0]).tolist()
        else:
            dst = (fill.slots + np.array(bases, dtype=np.intp)).ravel().tolist()
        nbytes = len(fill) * self.memory.bytes_per_key

        def settle(xfer: Xfer) -> None:
            self.outbox.xfer_terminal(op, xfer)
            self._settle_fill(op, fill, xfer.ok, no_evict)

        try:
            xfer = self.transfers.start(dst, src, f"deposit op {op.handle}", nbytes, settle)
        except TransportError as exc:
            op.failure = str(exc)
            self._settle_fill(op, fill, False, no_evict)
            return
        await self._follow(op, xfer, keys)

    @staticmethod
    async def _follow(op: Operation, xfer: Xfer | None, keys: Iterable[BlockKey]) -> None:
        """Wait for the operation's transfer (when still in flight), recorded as touching
        ``keys``: the operation's deadline may end the wait, not the transfer, whose
        completion work runs when it is terminal (and reports the abandoned memory)."""
        if xfer is not None and not xfer.done.is_set():
            op.xfers[xfer] = frozenset(keys)
            await xfer.done.wait()

    def _settle_fill(self, op: Operation, fill: Filling, ok: bool, no_evict: bool) -> None:
        """End the fill of ``fill``'s records: commit what arrived for keys still pending,
        drop the rest, and answer. With masks over the batch's arrays: a view per key only
        for what needs one (a policy's hooks, release handles, a failure)."""
        index, keys, pending = self.index, fill.keys, op.pending
        op.fills.remove(fill)
        held = index.held(fill)
        every_held = bool(held.all())
        if not every_held:  # withdrawn while the transfer ran: their slots are free now
            for block in fill.subset(~held).views():
                index.release_slots(block)
        everything = every_held and pending.issuperset(keys)
        if not ok:
            done = fill.subset(np.zeros(len(fill), dtype=bool))
        elif everything:
            done = fill
        else:
            done = fill.subset(held & np.fromiter(map(pending.__contains__, keys), bool))
        hooked = no_evict or self.scores_by_policy or self._wants("on_ingest")
        views = done.views() if hooked else []
        index.commit_fills(done, self.scores(views) if self.scores_by_policy else None)
        if self._wants("on_ingest"):
            for block in views:
                self.ingested(block, self.source_tier)
        answers = {b.key: self._stored(b, no_evict) for b in views} if no_evict else {}
        if len(done) < int(held.sum()):
            # Failed, timed out or aborted: a late success never becomes a success, and
            # the engine may already be reusing the source memory.
            for block in fill.subset(held).views():
                if block.state is BlockState.FILLING:
                    index.remove(block)
                    if op.live(block.key):
                        answers[block.key] = FAILED
        self.fill_waiters.over_many(fill)
        index.flush_journal()  # committed before the engine hears of it
        op.moved += len(done)
        if len(done):
            self.callbacks.inventory(InventoryEvent(tuple(done.keys), CacheTier.LOCAL_G2, False))
        if not ok:
            op.failure = op.failure or "deposit: the transfer into local G2 failed"
        if answers or no_evict:
            answers.update(dict.fromkeys([k for k in done.keys if k not in answers], SUCCESS))
            self.outbox.answer(op, answers)
        else:
            self.outbox.answer_all(op, done.keys, SUCCESS)

    def withdraw(self, op: Operation, keys: Sequence[BlockKey]) -> None:
        """The operation gave up on ``keys`` (deadline, abort, close) while their fill may be
        in flight: they leave the index at once (a query says MISS, waiters stop waiting),
        but their slots stay taken until the transfer is terminal."""
        wanted = set(keys)
        filling = [op.filling.get(key) for key in keys]
        for fill in op.fills:
            filling += [block for block in fill.views() if block.key in wanted]
        for block in filling:
            if block is None or not self.index.holds(block):
                continue
            self.index.detach(block)
            self.fill_waiters.over(block)

    # -- deliver ---------------------------------------------------------------------------

    async def deliver(
        self,
        op: Operation,
        destinations: Mapping[BlockKey, tuple[int, ...]],
        keys: Sequence[BlockKey],
        found: Found | None = None,
    ) -> None:
        """Copy ``keys`` (in local G2) into the engine's ``destinations``; ``found``: their
        lookup, when nothing ran since it was made."""
        # One lookup, then claims, sources and answers by arrays: no view per block.
        pending, index = op.pending, self.index
        if found is None or not pending.issuperset(keys):
            keys = [k for k in keys if k in pending]
            found = index.lookup(keys)
        if found.filling.any():
            await self.wait_fills([k for k, f in zip(keys, found.filling.tolist()) if f])
            keys = [k for k in keys if k in pending]
            found = index.lookup(keys)
        claim = index.claim_ready(found, trio.current_time())
        claimed = keys
        if len(claim) < len(keys):
            ready = found.ready.tolist()
            claimed = [k for k, ok in zip(keys, ready) if ok]
            missing = [k for k, ok in zip(keys, ready) if not ok]
            op.failure = op.failure or f"deliver: {len(missing)} keys are not in local G2"
            self.outbox.answer(op, dict.fromkeys(missing, FAILED))
        if not claimed:
            return
        dst = [d for k in claimed for d in destinations[k]]
        slots = index.slots_of(claim.recs) + np.array(self.memory.pool_base, dtype=np.intp)
        src: list[int] = slots.ravel().tolist()

        def settle(xfer: Xfer) -> None:
            self.outbox.xfer_terminal(op, xfer)
            self._settle_deliver(op, claimed, claim, xfer.ok)

        nbytes = len(claimed) * self.memory.bytes_per_key
        try:
            xfer = self.transfers.start(dst, src, f"deliver op {op.handle}", nbytes, settle)
        except TransportError as exc:
            op.failure = str(exc)
            self._settle_deliver(op, claimed, claim, False)
            return
        await self._follow(op, xfer, claimed)

    def _settle_deliver(
        self, op: Operation, keys: Sequence[BlockKey], claim: Claim, ok: bool
    ) -> None:
        self.unclaim_records(claim)
        if not ok:
            op.failure = op.failure or "deliver: the transfer from local G2 failed"
        answered = self.outbox.answer_all(op, keys, SUCCESS if ok else FAILED)
        if ok:
            op.moved += answered

    # -- fetch -----------------------------------------------------------------------------

    def fetch_ready(self, op: Operation, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Claim and answer the keys that are ready now; the keys still being filled are
        returned for :meth:`fetch`. Synchronous on purpose: the runtime calls it before the
        rest of the operation (a peer or G3 part that makes room) can evict these blocks."""
        filling = self.index.filling(keys)
        if filling:
            later = set(filling)
            self._claim_fetched(op, [k for k in keys if k not in later])
        else:
            self._claim_fetched(op, keys)
        return filling

    async def fetch(self, op: Operation, keys: Sequence[BlockKey]) -> None:
        await self.wait_fills(keys)
        self._claim_fetched(op, keys)

    def _claim_fetched(self, op: Operation, keys: Sequence[BlockKey]) -> None:
        now = trio.current_time()
        answers: dict[BlockKey, OpEntryResult] = {}
        for key, block in zip(keys, self.index.ready_views(keys)):
            if not op.live(key):
                continue
            if block is None:
                answers[key] = FAILED
                continue
            self.index.touch(block, now)
            answers[key] = self.claimed_entry(block)
        if len(answers) != sum(1 for a in answers.values() if a.success):
            op.failure = op.failure or "fetch: some keys are not in local G2"
        self.outbox.answer(op, answers)

    # -- G3 --------------------------------------------------------------------------------

    async def deliver_g3(
        self,
        op: Operation,
        destinations: Mapping[BlockKey, tuple[int, ...]],
        keys: Sequence[BlockKey],
    ) -> None:
        """Read G3 blocks straight into the engine's destinations."""
        assert self.g3 is not None
        live = [k for k in keys if op.live(k)]

        def settle(xfer: Xfer | None, got: set[BlockKey]) -> None:
            if xfer is not None:
                self.outbox.xfer_terminal(op, xfer)
            if len(got) < len(live):
                op.failure = op.failure or "deliver: some G3 blocks could not be read back"
            self.outbox.answer(op, {k: SUCCESS if k in got else FAILED for k in live})

        items = [(k, destinations[k][0]) for k in live]
        xfer = self.g3.read(items, f"deliver op {op.handle}", settle, SCOPE_G3_DELIVER)
        await self._follow(op, xfer, live)  # bytes are counted under g3_deliver

    async def fetch_g3(self, op: Operation, keys: Sequence[BlockKey]) -> None:
        """Fill G2 slots from G3; each success is claimed like any fetch."""
        assert self.g3 is not None
        live = [k for k in keys if op.live(k) and self.index.get(k) is None]
        granted = await self.make_room(len(live), f"fetch op {op.handle}")
        self.outbox.answer(op, dict.fromkeys(live[granted:], FAILED))
        blocks = self.index.add_filling_batch(live[:granted], trio.current_time())
        for block in blocks:
            op.filling[block.key] = block

        def settle(xfer: Xfer | None, got: set[BlockKey]) -> None:
            if xfer is not None:
                self.outbox.xfer_terminal(op, xfer)
            for block in blocks:
                op.filling.pop(block.key, None)
                if not self.index.holds(block):  # withdrawn meanwhile; the read is over
                    self.index.release_slots(block)
                    self.fill_waiters.over(block)
            answers = self.commit_fetched(op, blocks, got, CacheTier.G3)
            if len(got) < len(live):
                op.failure = op.failure or "fetch: some G3 blocks could not be read back"
            self.outbox.answer(op, answers)

        base = self.memory.pool_base[0]
        items = [(b.key, base + b.slots[0]) for b in blocks]
        xfer = self.g3.read(items, f"fetch op {op.handle}", settle)
        await self._follow(op, xfer, [b.key for b in blocks])  # bytes: under g3_fill

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
            self.fill_waiters.over(block)
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
