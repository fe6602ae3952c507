"""Running the engine's operations: start one per command, read each key from where it is
(local G2, G3, the hinted peer), answer under its deadline, abort, and watch what a failed
operation left in flight.

An operation runs as one task of the runtime's operations nursery, its body under a cancel
scope whose deadline is ``operation_timeout_ms``. When the body ends (done, timed out, aborted
or closed) every key still pending fails, once, with the reason. Transfers it started may
outlive it: they stay in ``op.xfers``, holding their memory, until each is terminal; an
abandonment watcher, in the root nursery so that it outlives the operations at close,
reports what is still in flight at ``abandon_timeout_ms`` and probes the peers again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from kvcr.config import KVCRConfig
from kvcr.runtime.commands import Deliver, Deposit, Fetch, Hinted, OpCommand
from kvcr.runtime.destination import Destination
from kvcr.runtime.g3 import G3Tier
from kvcr.runtime.lifecycle import RemotePull
from kvcr.runtime.local import LocalG2
from kvcr.runtime.memory import MemoryMap
from kvcr.runtime.ops import (
    FAILED,
    Deadlines,
    Framework,
    Operation,
    OpKind,
    Outbox,
    RemotePart,
    record,
)
from kvcr.runtime.transfers import Xfer
from kvcr.store.index import BlockIndex
from kvcr.telemetry import Telemetry
from kvcr.types import BlockKey, MemoryRef

KINDS: Mapping[type, OpKind] = {
    Deposit: OpKind.DEPOSIT,
    Deliver: OpKind.DELIVER,
    Fetch: OpKind.FETCH,
}


async def _await(coroutine: Awaitable[None]) -> None:
    await coroutine


@attrs.define
class Tiers:
    """Where an operation's keys can be: set as the runtime starts each part."""

    local: LocalG2 | None = None
    g3: G3Tier | None = None
    destination: Destination | None = None  # the peers a router hint names


class Operations:
    def __init__(
        self,
        *,
        index: BlockIndex,
        tiers: Tiers,
        memory: MemoryMap,
        config: KVCRConfig,
        outbox: Outbox,
        telemetry: Telemetry,
        log: Any,
    ) -> None:
        self.index = index
        self.tiers = tiers
        self.memory = memory
        self.config = config
        self.outbox = outbox
        self.telemetry = telemetry
        self.log = log
        self.ops: dict[int, Operation] = {}
        self.nursery: trio.Nursery | None = None  # the operations' tasks
        # Abandonment watchers: they outlive the operations, until the runtime quiesced.
        self.root: trio.Nursery | None = None

    def start(self, command: OpCommand) -> None:
        now = trio.current_time()
        handle, keys = command.handle, command.keys
        pending = self.outbox.pending_set(handle)
        if not keys:
            self.outbox.answer_empty(handle)
            return
        kind = KINDS[type(command)]
        framework = Framework()
        if isinstance(command, Deposit):
            framework = Framework(sources=tuple(keys))
        elif isinstance(command, Deliver):
            framework = Framework(destination_refs=self._refs_of(command))
        op = Operation(handle, kind, keys, pending, Deadlines.starting(now, self.config), framework)
        if self.telemetry.tracing is not None:
            op.phases = []
        body: Awaitable[None]
        if isinstance(command, Deposit):
            if self.tiers.local is None:
                self.outbox.fail_pending(op, "deposit: this instance has no local DRAM pools")
                return
            body = self.tiers.local.deposit(op, command.sources, command.no_evict, command.hints)
        elif isinstance(command, Deliver):
            body = self._read(op, command.destinations, command.remote)
        else:
            body = self._read(op, None, command.remote)
        assert self.nursery is not None
        self.ops[handle] = op
        self.nursery.start_soon(self._run, op, body)

    def _refs_of(self, command: Deliver) -> Callable[[], tuple[MemoryRef, ...]]:
        """The engine refs a deliver writes into, worked out when asked."""
        destinations, memory = command.destinations, self.memory
        return lambda: memory.refs_of(d for key in command.keys for d in destinations[key])

    def _elsewhere(
        self, op: Operation, resident: list[BlockKey], remote: Hinted | None
    ) -> tuple[list[BlockKey], list[BlockKey]]:
        """The keys of ``op`` not in local G2 that G3 holds, and those the hint covers; the
        rest are answered failed."""
        g3_keys: list[BlockKey] = []
        g3 = self.tiers.g3
        if g3 is not None:
            in_g2 = set(resident)
            g3_keys = [k for k in op.keys if k not in in_g2 and k in g3]
        remote_keys: list[BlockKey] = []
        if remote is not None and self.tiers.destination is not None:
            held = set(resident).union(g3_keys)
            remote_keys = [k for k in op.keys if k not in held and k in remote.keys]
        missing = set(op.keys).difference(resident, remote_keys, g3_keys)
        if missing:
            op.failure = f"{op.kind}: {len(missing)} keys are neither local nor covered by a hint"
            self.outbox.answer(op, dict.fromkeys(missing, FAILED))
        return g3_keys, remote_keys

    async def _read(self, op: Operation, destinations: Any, remote: Hinted | None) -> None:
        """deliver or fetch: keys in local G2 locally, keys the request's hint covers from
        the hinted peer, both at once; other keys fail."""
        found = self.index.lookup(op.keys)
        in_g2 = found.held()
        resident = op.keys  # all of them, usually: nothing else to work out
        g3_keys: list[BlockKey] = []
        remote_keys: list[BlockKey] = []
        if not in_g2.all():
            resident = [k for k, h in zip(op.keys, in_g2.tolist()) if h]
            found = found.subset(in_g2)
            g3_keys, remote_keys = self._elsewhere(op, resident, remote)
        if remote_keys and remote is not None:
            op.remote = RemotePart(
                frozenset(remote_keys), remote.request, remote.move, remote.no_retain
            )
            op.remote.hint_age = remote.hint_age
        deliver = op.kind is OpKind.DELIVER
        local, destination = self.tiers.local, self.tiers.destination
        parts = []
        if resident and local is not None:
            if deliver:
                # The lookup holds while nothing runs in between: when local G2 is the only
                # part, awaited at once.
                alone = not g3_keys and not remote_keys
                looked_up = found if alone else None
                parts.append(local.deliver(op, destinations, resident, looked_up))
            elif filling := local.fetch_ready(op, resident):
                # The ready keys are claimed already: making room for the other parts
                # cannot evict them.
                parts.append(local.fetch(op, filling))
        elif resident:
            self.outbox.answer(op, dict.fromkeys(resident, FAILED))
        if g3_keys:
            assert local is not None
            if deliver:
                parts.append(local.deliver_g3(op, destinations, g3_keys))
            else:
                parts.append(local.fetch_g3(op, g3_keys))
        if remote_keys:
            assert destination is not None and remote is not None
            if deliver:
                parts.append(destination.deliver(op, destinations, remote_keys, remote.endpoint))
            else:
                parts.append(destination.fetch(op, remote_keys, remote.endpoint))
        if len(parts) == 1:
            await parts[0]  # the common case: no task hop
        elif parts:
            async with trio.open_nursery() as nursery:
                for part in parts:
                    nursery.start_soon(_await, part)

    async def _run(self, op: Operation, body: Awaitable[None]) -> None:
        timed_out = False
        try:
            op.scope.deadline = op.deadline
            with op.scope:
                await body
            timed_out = op.scope.cancelled_caught and op.deadline <= trio.current_time()
        finally:
            reason = "closed" if not timed_out else None
            if timed_out:
                reason = f"{op.kind}: timed out after {self.config.operation_timeout_ms} ms"
            if self.tiers.local is not None:
                self.tiers.local.withdraw(op, list(op.pending))
            self.outbox.fail_pending(op, op.failure or reason or f"{op.kind}: failed")
            if op.remote.failed and op.remote.keys:
                self.outbox.failed_hints.append(op.remote.request)
            self.ops.pop(op.handle, None)
            record(op, self.telemetry, self.memory, self.log)
            # In the root nursery: it must keep watching (and probing peers) while the
            # runtime stops, which cancels the operations first.
            if op.xfers and self.root is not None:
                self.root.start_soon(self._watch_abandoned, op)

    async def _watch_abandoned(self, op: Operation) -> None:
        """What the failed operation left in flight (local transfers, pulls a peer may still
        write) must end by ``abandon_timeout_ms``; what has not is reported then, and its
        memory stays held until it ends."""
        with trio.move_on_at(op.abandon_at):
            while op.xfers:  # each one leaves op.xfers when it ends
                await next(iter(op.xfers)).done.wait()
            return
        local = [x for x in op.xfers if isinstance(x, Xfer)]
        if local:
            self.log.warning(
                "transfer_abandoned",
                op=op.handle,
                kind=op.kind.value,
                transfers=len(local),
                reason="still in flight past abandon_timeout_ms; its memory stays held",
            )
        for pull in [x for x in op.xfers if isinstance(x, RemotePull)]:
            assert self.tiers.destination is not None
            self.tiers.destination.quarantine(op, pull)

    def abort(self, handle: int, keys: list[BlockKey] | None) -> None:
        op = self.ops.get(handle)
        if op is None:
            return
        targets = list(op.pending) if keys is None else [k for k in keys if k in op.pending]
        if not targets:
            return
        op.failure = op.failure or f"{op.kind}: aborted"
        if self.tiers.local is not None:
            self.tiers.local.withdraw(op, targets)
        self.outbox.answer(op, dict.fromkeys(targets, FAILED))
        if not op.pending:
            op.scope.cancel()
