"""Destination side of peer reuse: ``deliver`` into engine memory and ``fetch`` into local
G2 from the peer a router hint names.

Both send one pull (see ``peers.py``) and wait for the source's answer under the
operation's deadline. A partial answer is normal: the keys the source wrote succeed, the
rest fail. If the operation gives up first, the pull is abandoned: memory the source may
still write stays held (engine memory is reported ``uncertain``; fetch slots stay
quarantined) until the source confirms it is over.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import trio

from kvcr.runtime.local import LocalG2
from kvcr.runtime.ops import DROPPED, FAILED, SUCCESS, Operation
from kvcr.runtime.part import Part
from kvcr.runtime.peers import Peers, RemotePull
from kvcr.store.index import BlockIndex
from kvcr.transport.base import TransportError
from kvcr.types import (
    BlockKey,
    BlockMeta,
    CacheTier,
    OpEntryResult,
    PlacementAction,
)

if TYPE_CHECKING:
    from kvcr.runtime.build import Context, Shared

_STORE = (PlacementAction.COPY_TO, CacheTier.LOCAL_G2)
MAX_UNCONFIRMED = 4096  # move pulls awaiting the engine's poll; older ones are never confirmed


class Remote(Part):
    def __init__(
        self,
        context: Context,
        shared: Shared,
        peers: Peers,
        local: LocalG2 | None,
        index: BlockIndex,
    ) -> None:
        super().__init__(context, shared)
        self.peers = peers
        self.local = local
        self.index = index
        # Operation -> (endpoint, pull request, indices that succeeded), for a move pull
        # whose source may drop its copies once the engine has taken the results.
        self._unconfirmed: OrderedDict[int, tuple[str, int, list[int]]] = OrderedDict()

    def confirm(self, handle: int) -> None:
        """The engine has taken every result of operation ``handle``: a move pull's source
        may now drop what it wrote."""
        entry = self._unconfirmed.pop(handle, None)
        if entry is not None:
            self.peers.confirm(*entry)

    def _await_confirm(
        self,
        op: Operation,
        endpoint: str,
        pull: RemotePull | None,
        keys: Sequence[BlockKey],
        answers: Mapping[BlockKey, OpEntryResult],
    ) -> None:
        if op.remote.mode != "move" or pull is None:
            return
        indices = [i for i in pull.written if (a := answers.get(keys[i])) is not None and a.success]
        if not indices:
            return
        self._unconfirmed[op.handle] = (endpoint, pull.req, indices)
        if len(self._unconfirmed) > MAX_UNCONFIRMED:
            # The engine never polled that one: its source keeps its copies (the safe side).
            old, _ = self._unconfirmed.popitem(last=False)
            self.log.info("move_unconfirmed", op=old, reason="results never polled")

    async def _pull(
        self,
        op: Operation,
        endpoint: str,
        keys: list[BlockKey],
        dst: list[tuple[int, int]],
        sent: list[RemotePull],
        on_over: Any = None,
    ) -> RemotePull | None:
        """Send the pull and wait for its answer; None if it could not be sent. ``sent``
        receives the pull once it is on its way (then the source may write)."""
        # Anything but keys written (nothing, an error, the deadline while setting up or
        # waiting) is a failed remote operation: it marks the request's hint failed.
        op.remote.failed = True
        for attempt in (1, 2):
            try:
                pull = await self.peers.pull(op, endpoint, keys, dst, op.remote.mode == "move")
            except TransportError as exc:
                op.failure = str(exc)
                return None
            sent.append(pull)
            if on_over is not None:
                pull.on_over.append(on_over)
            try:
                await pull.done.wait()
            finally:
                if not pull.done.is_set():
                    self.peers.abandon(pull)
            # A pull turned away unread (by a restarted source's new incarnation, or by a
            # source that had no greeting from us) was never acted on: asking again, after
            # greeting the endpoint again, is safe (once).
            if not (pull.turned_away and attempt == 1):
                break
            self.log.info("pull_resent", op=op.handle, endpoint=endpoint, reason=pull.reason)
        if pull.written:
            op.remote.failed = False
        else:
            op.failure = op.failure or f"{op.kind}: the source had none of the keys ({pull.reason})"
        return pull

    async def deliver(
        self,
        op: Operation,
        destinations: Mapping[BlockKey, tuple[int, ...]],
        keys: Sequence[BlockKey],
        endpoint: str,
    ) -> None:
        pending = op.pending
        keys = [k for k in keys if k in pending]
        dst = self.memory.ranges([d for k in keys for d in destinations[k]])
        pull = await self._pull(op, endpoint, keys, dst, [])
        written = {keys[i] for i in pull.written} if pull is not None else set()
        answers = {k: SUCCESS if k in written else FAILED for k in keys if k in pending}
        op.remote.moved += sum(1 for a in answers.values() if a.success)
        self._partial(op, answers)
        self._await_confirm(op, endpoint, pull, keys, answers)
        self.outbox.answer(op, answers)

    @staticmethod
    def _partial(op: Operation, answers: Mapping[BlockKey, OpEntryResult]) -> None:
        """Name a partial answer as the operation's failure (for its op_failed log)."""
        missing = sum(1 for a in answers.values() if not a.success)
        if missing:
            op.failure = op.failure or f"{op.kind}: the source lacked {missing} of the keys"

    async def fetch(self, op: Operation, keys: Sequence[BlockKey], endpoint: str) -> None:
        local = self.local
        if local is None:
            op.failure = "fetch: this instance has no local DRAM pools to fetch into"
            self.outbox.answer(op, dict.fromkeys(keys, FAILED))
            return
        answers: dict[BlockKey, OpEntryResult] = {}
        accepted: list[BlockKey] = []
        for key in keys:
            if not op.live(key):
                continue
            meta = BlockMeta(key, self.memory.bytes_per_key, 0, None, frozenset())
            action, _ = local.decide_ingest(meta, CacheTier.REMOTE_G2, True, _STORE, None)
            if action is PlacementAction.DROP:
                answers[key] = DROPPED
            elif self.index.get(key) is not None:
                answers[key] = FAILED  # filled meanwhile by someone else: not ours to claim
            else:
                accepted.append(key)
        granted = local.reserve(len(accepted), f"fetch op {op.handle}") if accepted else 0
        for key in accepted[granted:]:
            answers[key] = FAILED
        self.outbox.answer(op, answers)
        now = trio.current_time()
        blocks = self.index.add_filling_batch(accepted[:granted], now)
        if not blocks:
            return
        for block in blocks:
            op.filling[block.key] = block
        bases = self.memory.pool_base
        dst = self.memory.ranges(
            [base + slot for b in blocks for base, slot in zip(bases, b.slots)]
        )
        keys = [b.key for b in blocks]
        released: set[int] = set()

        def free_withdrawn() -> None:
            # The source can no longer write: slots of records the operation gave up on
            # (withdrawn from the index) are free again.
            for block in blocks:
                if not self.index.holds(block) and id(block) not in released:
                    released.add(id(block))
                    self.index.release_slots(block)

        sent: list[RemotePull] = []
        try:
            pull = await self._pull(op, endpoint, keys, dst, sent, free_withdrawn)
        finally:
            if not sent:  # never asked for: nothing can write these slots
                for block in blocks:
                    if self.index.holds(block):
                        self.index.remove(block)
                        local.fill_waiters.over(block)
        for block in blocks:
            op.filling.pop(block.key, None)
        if pull is None:
            return  # never asked for: the blocks were removed above
        # Withdrawn blocks are left to free_withdrawn, which frees them once the source is over.
        written = {keys[i] for i in pull.written}
        answers = local.commit_fetched(op, blocks, written, CacheTier.REMOTE_G2)
        op.remote.moved += sum(1 for a in answers.values() if a.success)
        if op.remote.no_retain:
            local.drop_at_release(a.release_handle for a in answers.values() if a.success)
        self._partial(op, answers)
        self._await_confirm(op, endpoint, pull, keys, answers)
        self.outbox.answer(op, answers)
