"""The runtime: one trio task tree that owns all mutable state of a KVCR instance.

Engine threads never touch this state. They enqueue commands into the inbox and read what
the runtime publishes (the query view, the outbox, the set of live release handles).

Task tree::

    serve
    ├── transfers.run              polls in-flight transfers, idle when none
    └── ops nursery                one task per operation, each under its deadline
        └── abandonment watchers   log transfers still running past abandon_timeout_ms

Shutdown cancels the operations (their pending entries fail with "closed"), then waits up to
``abandon_timeout_ms`` for in-flight transfers to end. Only then is the transport closed
and memory deregistered; if a transfer never ends, the transport is deliberately leaked,
never freed under a live transfer.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from typing import Any

import trio

from kvcr.config import KVCRConfig
from kvcr.g3.files import G3Files
from kvcr.policy import KVCachePolicy
from kvcr.runtime.engine_calls import EngineCalls
from kvcr.runtime.g3 import G3Tier
from kvcr.runtime.inbox import Inbox
from kvcr.runtime.index import BlockIndex, BlockState, SlotPool
from kvcr.runtime.local import LocalG2
from kvcr.runtime.memory import MemoryMap
from kvcr.runtime.mirror import Mirror, recover
from kvcr.runtime.ops import FAILED, Operation, Outbox
from kvcr.runtime.peers import Peers
from kvcr.runtime.pins import Pins
from kvcr.runtime.remote import Remote
from kvcr.runtime.transfers import Transfers, Xfer
from kvcr.telemetry import SCOPE_LOCAL_DELIVER, SCOPE_LOCAL_FETCH, SCOPE_LOCAL_FILL, Telemetry
from kvcr.transport.base import Transport
from kvcr.types import BlockKey, CacheTier, InventoryEvent

SCOPES = {"deposit": SCOPE_LOCAL_FILL, "deliver": SCOPE_LOCAL_DELIVER, "fetch": SCOPE_LOCAL_FETCH}
REMOTE_SCOPES = {"deliver": "remote_deliver", "fetch": "remote_fetch"}


async def _run(coroutine: Any) -> None:
    await coroutine


# Transports whose transfers never ended: kept referenced so their memory registrations
# and agents are never torn down under a transfer that might still run.
_LEAKED: list[object] = []


class Runtime:
    def __init__(
        self,
        *,
        config: KVCRConfig,
        memory: MemoryMap,
        has_pools: bool,
        policy: KVCachePolicy,
        source_tier: CacheTier,
        callbacks: EngineCalls,
        engine_answers: Inbox,
        transport_factory: Callable[[], Transport],
        telemetry: Telemetry,
        open_ops: dict[int, set[BlockKey]],
        live_handles: set[int],
        release_ids: itertools.count,
        bindings: Any,
        remote_options: Any,
        op_ids: Callable[[], int],
        log: Any,
        journal: memoryview | None = None,
        group: int | None = None,
        g3_options: Any = None,
        cluster_key: bytes | None = None,
    ) -> None:
        self.bindings = bindings
        self.cluster_key = cluster_key
        self.g3_options = g3_options
        self.g3: G3Tier | None = None
        self.g3_view: dict[BlockKey, Any] = {}  # published for query, like index.view
        self.journal = journal  # the guard group's recovery journal, owned from here on
        self.group = group
        self.mirror: Mirror | None = None
        self.remote_options = remote_options
        self.op_ids = op_ids
        self.config = config
        self.memory = memory
        self.has_pools = has_pools
        self.policy = policy
        self.source_tier = source_tier
        self.callbacks = callbacks  # what the runtime asks of the engine, in order
        self.engine_answers = engine_answers  # and what the engine answered
        self.telemetry = telemetry
        self.log = log
        self.inbox = Inbox()
        self.outbox = Outbox(open_ops, callbacks)
        self.live_handles = live_handles
        self.release_ids = release_ids
        pools = [
            SlotPool(name, block, slots)
            for name, block, slots in zip(memory.pool_names, memory.block_sizes, memory.pool_slots)
        ]
        self.index = BlockIndex(pools)
        self._transport_factory = transport_factory
        self.transport: Transport | None = None
        self.transfers: Transfers[Transport] | None = None
        self.local: LocalG2 | None = None
        self.peers: Peers | None = None
        self.remote: Remote | None = None
        self.ops: dict[int, Operation] = {}
        self._ops_nursery: trio.Nursery | None = None
        self.closed = trio.Event()
        self.leaked = False  # set at close if memory stayed registered under a live transfer

    # -- lifecycle -----------------------------------------------------------------------

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        transport: Transport | None = None
        leaked = False
        try:
            transport = self.transport = self._transport_factory()
            transport.open_local(self.memory.segments)
            fine = bool(getattr(transport, "fine_timing", False))
            self.transfers = Transfers(transport, self.log, fine)
            if self.has_pools:
                self.local = LocalG2(
                    memory=self.memory,
                    index=self.index,
                    transfers=self.transfers,
                    outbox=self.outbox,
                    policy=self.policy,
                    watermark_percent=self.config.capacity_low_watermark_percent,
                    live_handles=self.live_handles,
                    release_ids=self.release_ids,
                    source_tier=self.source_tier,
                    callbacks=self.callbacks,
                    log=self.log,
                )
                if self.journal is not None:
                    self._start_warm(self.local, self.journal)
            async with trio.open_nursery() as root:
                root.start_soon(self.transfers.run)
                if self.g3_options is not None and self.local is not None:
                    self._start_g3(root, self.local, fine)
                pins = Pins(self.callbacks, self.engine_answers, self.log)
                root.start_soon(pins.run)
                if self.bindings.framework_control is not None:
                    await self._start_peers(root, transport, pins)
                async with trio.open_nursery() as ops:
                    self._ops_nursery = ops
                    task_status.started()
                    self.log.info("runtime_started", pools=self.memory.pool_names)
                    await self._pump()
                    ops.cancel_scope.cancel()
                if self.peers is not None:
                    await self.peers.source.stop()
                leaked = not await self._quiesce()
                # Pins go back to the engine only now that no transfer reads them.
                await pins.drain(self.config.operation_timeout_ms / 1000)
                root.cancel_scope.cancel()
        finally:
            if self.g3 is not None:
                self._close_g3(leaked)
            if self.mirror is not None:
                self.mirror.close()
            elif self.journal is not None:
                self.journal.release()
            self.leaked = leaked
            if leaked:
                _LEAKED.append(transport)
                self.log.error(
                    "transport_leaked",
                    reason="transfers still in flight at close; memory stays registered",
                )
            elif transport is not None:
                transport.close()
            self.closed.set()

    def _start_g3(self, root: trio.Nursery, local: LocalG2, fine: bool) -> None:
        """Open the G3 files and their NIXL agent, and let the pool spill to them."""
        from kvcr.transport.nixl_files import NixlFileTransport  # the only nixl import here

        opts = self.g3_options
        files = G3Files(opts.paths, opts.capacity_bytes_per_file, self.memory.block_sizes[0])
        try:
            transport = NixlFileTransport(
                f"{self.config.nixl_agent_name}-g3", opts.backend, dict(opts.backend_options)
            )
            transport.open(
                self.memory.segments, [(f.fd, f.size) for f in files.files], files.slot_rows()
            )
        except BaseException:
            files.close()
            raise
        transfers = Transfers(transport, self.log, fine)
        root.start_soon(transfers.run)
        self.g3 = G3Tier(
            files=files,
            transport=transport,
            transfers=transfers,
            score=local.g3_score,
            on_removed=local.g3_removed,
            log=self.log,
            telemetry=self.telemetry,
            journal=self.mirror,
            view=self.g3_view,
        )
        local.g3, local.spawn = self.g3, root.start_soon
        if self.mirror is not None:
            restored = self.g3.restore(dict(self.mirror.g3_records))
            if restored:
                self.callbacks.inventory(InventoryEvent(tuple(restored), CacheTier.G3, False))

    def _g3_gauges(self) -> dict[str, float]:
        assert self.g3 is not None
        pool = self.g3.index.pools[0]
        return {
            "g3_capacity_bytes": pool.capacity * pool.block_size,
            "g3_used_bytes": pool.used * pool.block_size,
            "g3_blocks": len(self.g3.view),
        }

    def _close_g3(self, leaked: bool) -> None:
        assert self.g3 is not None
        if leaked or self.g3.transfers.in_flight:
            self.log.error("g3_kept", reason="G3 transfers in flight at close")
            return
        self.g3.transport.close()
        self.g3.files.close()

    def _start_warm(self, local: LocalG2, buf: memoryview) -> None:
        """Recover the blocks the group's journal holds, then mirror changes into it."""
        blocks, kept = recover(self.index, buf, self.log)
        for block in blocks:
            self.index.rescore(block, local.score(block))
        self.mirror = Mirror(buf, self.index, kept, self.group, self.log)
        self.index.journal = self.mirror
        if blocks:
            keys = tuple(block.key for block in blocks)
            self.callbacks.inventory(InventoryEvent(keys, CacheTier.LOCAL_G2, False))

    async def _start_peers(self, nursery: trio.Nursery, transport: Transport, pins: Pins) -> None:
        channel = self.bindings.framework_control
        initialize = getattr(channel, "initialize", None)
        if callable(initialize):
            initialize()  # idempotent on ZmqPeerControlChannel; binds if the adapter did not
        assert self.transfers is not None
        self.peers = Peers(
            channel=channel,
            transport=transport,
            transfers=self.transfers,
            memory=self.memory,
            index=self.index,
            local=self.local,
            pins=pins,
            outbox=self.outbox,
            config=self.config,
            retry_interval_s=self.remote_options.metadata_retry_interval_ms / 1000,
            telemetry=self.telemetry,
            op_ids=self.op_ids,
            log=self.log,
            cluster_key=self.cluster_key,
        )
        self.remote = Remote(
            peers=self.peers,
            local=self.local,
            memory=self.memory,
            index=self.index,
            outbox=self.outbox,
            log=self.log,
        )
        await nursery.start(self.peers.run)

    async def _quiesce(self) -> bool:
        """Wait, up to abandon_timeout_ms, until nothing can touch our memory: no local or
        source transfer in flight, and no peer still allowed to write into a pull's
        destination. False if something still might."""
        assert self.transfers is not None
        peers = self.peers
        with trio.move_on_after(self.config.abandon_timeout_ms / 1000):
            await self.transfers.wait_idle()
            if self.g3 is not None:
                await self.g3.transfers.wait_idle()
            while peers is not None and peers.pulls_in_flight():
                await trio.sleep(0.005)
        return self.transfers.in_flight == 0 and not (peers and peers.pulls_in_flight())

    async def _pump(self) -> None:
        while True:
            for command in await self.inbox.get_batch():
                if command[0] == "close":
                    return
                try:
                    self._dispatch(command)
                except Exception as exc:  # a bug must not take the whole instance down
                    self.log.exception("command_failed", command=command[0], error=repr(exc))

    # -- commands ------------------------------------------------------------------------

    def _dispatch(self, command: tuple) -> None:
        name = command[0]
        if name in ("deposit", "deliver", "fetch"):
            self._start_op(name, *command[1:])
        elif name == "release":
            if self.local is not None:
                for handle in command[1]:
                    self.local.release(handle)
        elif name == "abort":
            self._abort(command[1], command[2])
        elif name == "connect":
            if self.peers is not None:
                self.peers.link(command[1])
        elif name == "align":
            if self.local is not None:
                self.local.align(command[1], command[2], trio.current_time())
        else:
            raise ValueError(f"runtime: unknown command {name!r}")

    def _start_op(self, kind: str, handle: int, keys: list[BlockKey], *args: Any) -> None:
        now = trio.current_time()
        pending = self.outbox.pending_set(handle)
        if not keys:
            self.outbox.answer_empty(handle)
            return
        op = Operation(
            handle=handle,
            kind=kind,
            keys=keys,
            pending=pending,
            started=now,
            deadline=now + self.config.operation_timeout_ms / 1000,
            abandon_at=now + self.config.abandon_timeout_ms / 1000,
        )
        if kind == "deposit":
            sources, no_evict, hints = args
            op.framework_sources = tuple(keys)
            if self.local is None:
                self.outbox.fail_pending(op, "deposit: this instance has no local DRAM pools")
                return
            body = self.local.deposit(op, sources, no_evict, hints)
        else:
            if kind == "deliver":
                destinations, refs, remote = args
                op.framework_destinations = refs
            else:
                destinations, remote = None, args[0]
            body = self._read(op, destinations, remote)
        assert self._ops_nursery is not None
        self.ops[handle] = op
        self._ops_nursery.start_soon(self._run_op, op, body)

    async def _read(
        self,
        op: Operation,
        destinations: Any,
        remote: tuple[str, object, frozenset[BlockKey]] | None,
    ) -> None:
        """deliver or fetch: keys in local G2 locally, keys the request's hint covers from
        the hinted peer, both at once; other keys fail."""
        resident = [k for k in op.keys if self.index.get(k) is not None]
        g3_keys: list[BlockKey] = []
        if self.g3 is not None:
            in_g2 = set(resident)
            g3_keys = [k for k in op.keys if k not in in_g2 and k in self.g3]
        remote_keys: list[BlockKey] = []
        if remote is not None and self.remote is not None:
            held = set(resident).union(g3_keys)
            remote_keys = [k for k in op.keys if k not in held and k in remote[2]]
        op.remote_keys = frozenset(remote_keys)
        if remote_keys and remote is not None:
            op.hint_request = remote[1]
        missing = set(op.keys).difference(resident, remote_keys, g3_keys)
        if missing:
            op.failure = f"{op.kind}: {len(missing)} keys are neither local nor covered by a hint"
            self.outbox.answer(op, dict.fromkeys(missing, FAILED))
        parts = []
        if resident and self.local is not None:
            if op.kind == "deliver":
                parts.append(self.local.deliver(op, destinations, resident))
            elif filling := self.local.fetch_ready(op, resident):
                # The ready keys are claimed already: making room for the other parts
                # cannot evict them.
                parts.append(self.local.fetch(op, filling))
        elif resident:
            self.outbox.answer(op, dict.fromkeys(resident, FAILED))
        if g3_keys:
            assert self.local is not None
            if op.kind == "deliver":
                parts.append(self.local.deliver_g3(op, destinations, g3_keys))
            else:
                parts.append(self.local.fetch_g3(op, g3_keys))
        if remote_keys:
            assert self.remote is not None and remote is not None
            if op.kind == "deliver":
                parts.append(self.remote.deliver(op, destinations, remote_keys, remote[0]))
            else:
                parts.append(self.remote.fetch(op, remote_keys, remote[0]))
        if len(parts) == 1:
            await parts[0]  # the common case: no task hop
        elif parts:
            async with trio.open_nursery() as nursery:
                for part in parts:
                    nursery.start_soon(_run, part)

    async def _run_op(self, op: Operation, body: Any) -> None:
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
            if self.local is not None:
                self.local.withdraw(op, list(op.pending))
            self.outbox.fail_pending(op, op.failure or reason or f"{op.kind}: failed")
            if op.remote_failed and op.remote_keys:
                self.outbox.failed_hints.append(op.hint_request)
            self.ops.pop(op.handle, None)
            self._record(op)
            if (
                any(isinstance(x, Xfer) for x in op.xfers)
                and self._ops_nursery is not None
                and not self.closed.is_set()
            ):
                self._ops_nursery.start_soon(self._watch_abandoned, op)

    def _record(self, op: Operation) -> None:
        seconds = trio.current_time() - op.started
        pools, per_key = len(self.memory.block_sizes), self.memory.bytes_per_key
        local_keys = len(op.keys) - len(op.remote_keys)
        if local_keys or not op.remote_keys:
            ok = len(op.ok_keys - op.remote_keys)
            self.telemetry.operation(
                SCOPES[op.kind], seconds, ok, local_keys, op.moved * pools, op.moved * per_key
            )
        if op.remote_keys:
            ok = len(op.ok_keys & op.remote_keys)
            moved = op.moved_remote
            self.telemetry.operation(
                REMOTE_SCOPES[op.kind],
                seconds,
                ok,
                len(op.remote_keys),
                moved * pools,
                moved * per_key,
            )
        if op.failure and len(op.ok_keys) < len(op.keys):
            self.log.info(
                "op_failed",
                op=op.handle,
                kind=op.kind,
                failed=len(op.keys) - len(op.ok_keys),
                reason=op.failure,
            )

    async def _watch_abandoned(self, op: Operation) -> None:
        with trio.move_on_at(op.abandon_at):
            while xfers := [x for x in op.xfers if isinstance(x, Xfer)]:
                await xfers[0].done.wait()
            return
        self.log.warning(
            "transfer_abandoned",
            op=op.handle,
            kind=op.kind,
            transfers=len(op.xfers),
            reason="still in flight past abandon_timeout_ms; its memory stays held",
        )

    def _abort(self, handle: int, keys: list[BlockKey] | None) -> None:
        op = self.ops.get(handle)
        if op is None:
            return
        targets = list(op.pending) if keys is None else [k for k in keys if k in op.pending]
        if not targets:
            return
        op.failure = op.failure or f"{op.kind}: aborted"
        if self.local is not None:
            self.local.withdraw(op, targets)
        self.outbox.answer(op, dict.fromkeys(targets, FAILED))
        if not op.pending:
            op.scope.cancel()

    # -- accounting (tests) --------------------------------------------------------------

    def audit(self) -> list[str]:
        """Memory held that nobody owns, once the runtime is quiet (no transfer, pull or
        source write in flight): slots outside the index, claims without a release handle,
        pins not handed back. Internal: for tests and debugging; empty means clean."""
        slots = self.index.audit()
        problems = [
            f"{slots[what]} {meaning}"
            for what, meaning in (
                ("double", "slots handed out twice"),
                ("quarantined", "slots held with no record"),
                ("view_mismatch", "keys whose query answer disagrees with their record"),
            )
            if slots[what]
        ]
        if self.transfers is not None and self.transfers.in_flight:
            problems.append(f"{self.transfers.in_flight} transfers in flight")
        holders = collections.Counter(self.local.handles.values()) if self.local else {}
        for key, block in self.index.blocks.items():
            if block.claims != holders.get(key, 0):
                problems.append(
                    f"key {key!r}: {block.claims} claims, {holders.get(key, 0)} release handles"
                )
            if block.state is not BlockState.READY:
                problems.append(f"key {key!r}: still filling")
        if self.local is not None and set(self.local.handles) != self.live_handles:
            problems.append("release handles: the runtime's and the facade's differ")
        if self.ops:
            problems.append(f"{len(self.ops)} operations still open")
        if self.peers is not None:
            if self.peers.pulls_in_flight():
                problems.append(f"{self.peers.pulls_in_flight()} pulls in flight")
            if self.peers.source.jobs:
                problems.append(f"{len(self.peers.source.jobs)} source jobs open")
            if self.peers.pins.outstanding:
                problems.append(f"{self.peers.pins.outstanding} engine pins outstanding")
        return problems

    # -- published state -----------------------------------------------------------------

    def gauges(self) -> dict[str, float]:
        pools = self.index.pools
        return {
            "local_g2_capacity_bytes": sum(p.capacity * p.block_size for p in pools),
            "local_g2_used_bytes": sum(p.used * p.block_size for p in pools),
            "local_g2_blocks": len(self.index),
            "ops_in_flight": len(self.ops),
            "transfers_in_flight": self.transfers.in_flight if self.transfers else 0,
            "release_handles": len(self.live_handles),
            **({"journal_fill_percent": self.mirror.fill_percent} if self.mirror else {}),
            **(self._g3_gauges() if self.g3 is not None else {}),
            **(self.peers.gauges() if self.peers is not None else {}),
        }
