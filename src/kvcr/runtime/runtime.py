"""The runtime: one trio task tree that owns all mutable state of a KVCR instance.

Engine threads never touch this state. They send commands (``runtime/commands.py``) and
read what the runtime publishes (the query views, the outbox, the set of live release
handles): ``Shared`` in ``runtime/build.py``, which also assembles the runtime.

Task tree::

    serve                          until Close, or until its caller cancels it
    └── (shielded body)
        ├── transfers.run          polls in-flight transfers, idle when none
        ├── pins.run, peers.run    engine pins; the peer control plane (if enabled)
        └── ops nursery            one task per operation, each under its deadline
            └── abandonment watchers   log transfers still running past abandon_timeout_ms

Shutdown, on Close or on cancellation alike, cancels the operations (their pending entries
fail with "closed"), then waits up to ``abandon_timeout_ms`` for in-flight transfers to end.
Only then is the transport closed and memory deregistered; if a transfer never ends, the
transport is deliberately leaked, never freed under a live transfer. So the runtime can run
as one task among others (the guard service serves a dead worker's group that way) and be
cancelled like any task. Blocking NIXL setup and teardown run in ``trio.to_thread``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from kvcr.config import InstanceG3Options
from kvcr.g3.files import G3Files
from kvcr.runtime.audit import audit
from kvcr.runtime.commands import (
    Abort,
    Align,
    Close,
    Command,
    Confirm,
    Connect,
    Deliver,
    Deposit,
    Fetch,
    Hinted,
    OpCommand,
    Release,
)
from kvcr.runtime.g3 import G3Tier
from kvcr.runtime.local import LocalG2
from kvcr.runtime.mirror import Mirror, recover
from kvcr.runtime.ops import FAILED, Deadlines, Framework, Operation, RemotePart, record
from kvcr.runtime.part import Part
from kvcr.runtime.peers import Peers, RemotePull
from kvcr.runtime.pins import Pins
from kvcr.runtime.plane import Plane
from kvcr.runtime.remote import Remote
from kvcr.runtime.residency import index_options
from kvcr.runtime.source import Source
from kvcr.runtime.transfers import Transfers, Xfer
from kvcr.store.index import BlockIndex, Published
from kvcr.store.slots import slot_pools
from kvcr.transport.base import Transport
from kvcr.types import BlockKey, CacheTier, InventoryEvent, MemoryRef

if TYPE_CHECKING:
    from kvcr.runtime.build import Context, Journal, Shared


async def _await(coroutine: Any) -> None:
    await coroutine


# Transports whose transfers never ended: kept referenced so their memory registrations
# and agents are never torn down under a transfer that might still run.
_LEAKED: list[object] = []


class Runtime(Part):
    """Built by :func:`kvcr.runtime.build.build`; runs as ``serve``."""

    def __init__(
        self,
        context: Context,
        shared: Shared,
        transport_factory: Callable[[], Transport],
        journal: Journal | None,
        *,
        has_pools: bool,
    ) -> None:
        super().__init__(context, shared)
        self.has_pools = has_pools
        self.g3: G3Tier | None = None
        self.g3_view = Published()  # the file tier's index for query, once it runs
        self.journal = journal  # the guard group's recovery journal, owned from here on
        self.mirror: Mirror | None = None
        memory = self.memory
        pools = slot_pools(memory.pool_names, memory.block_sizes, memory.pool_slots)
        followed = journal.followed if journal is not None else None
        if followed is not None and [p.capacity for p in followed.index.pools] == [
            p.capacity for p in pools
        ]:
            self.index = followed.index
        else:
            if journal is not None:
                self.journal = journal = attrs.evolve(journal, followed=None)
            self.index = BlockIndex(pools, **index_options(context.policy))
        self._transport_factory = transport_factory
        self.transport: Transport | None = None
        self.transfers: Transfers[Transport] | None = None
        self.local: LocalG2 | None = None
        self.peers: Peers | None = None
        self.remote: Remote | None = None
        self.ops: dict[int, Operation] = {}
        self._ops_nursery: trio.Nursery | None = None
        self._root: trio.Nursery | None = None  # lives until the runtime quiesced
        self.closed = trio.Event()
        self.leaked = False  # set at close if memory stayed registered under a live transfer

    # -- lifecycle -----------------------------------------------------------------------

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run until a ``Close`` command or until the caller cancels; either way stop in
        order (see the module docstring): cancelling the caller cuts no transfer off."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._close_when_cancelled)
            # Shielded: the caller's cancellation arrives as a Close command (above), so
            # that shutdown waits for in-flight transfers instead of abandoning them. Every
            # wait of the shutdown is bounded on its own.
            with trio.CancelScope(shield=True):
                await self._run_shielded(task_status)
            nursery.cancel_scope.cancel()

    async def _close_when_cancelled(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            if not self.closed.is_set():
                self.shared.commands.put(Close())

    async def _blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run NIXL's (or a file's) blocking set-up or teardown: off the loop when the loop
        is shared (the guard service's), else right here on the runtime's own thread.

        Off the loop, the agent is created and closed on a worker thread and used on the
        loop's: NIXL's UCX backend without a progress thread creates its workers
        ``UCS_THREAD_MODE_SERIALIZED`` (any thread, one call at a time, not SINGLE), and
        these calls never overlap: set-up ends before the pollers start, teardown begins
        after they stopped, and G3 has an agent of its own."""
        if self.context.offload_blocking:
            return await trio.to_thread.run_sync(fn, *args)
        return fn(*args)

    async def _run_shielded(self, task_status: Any) -> None:
        transport: Transport | None = None
        leaked = False
        try:
            # Creating the agent and registering the pools block for up to seconds on big
            # pools.
            transport = self.transport = await self._blocking(self._transport_factory)
            await self._blocking(transport.open_local, self.memory.segments)
            fine = bool(getattr(transport, "fine_timing", False))
            self.transfers = Transfers(transport, self.log, fine)
            if self.has_pools:
                self.local = LocalG2(self.context, self.shared, self.index, self.transfers)
                if self.journal is not None:
                    await self._start_warm(self.local, self.journal)
            async with trio.open_nursery() as root:
                self._root = root
                root.start_soon(self.transfers.run)
                if self.context.g3 is not None and self.local is not None:
                    await self._start_g3(root, self.local, fine)
                pins = Pins(self.shared.calls, self.shared.answers, self.log)
                root.start_soon(pins.run)
                if self.context.control is not None:
                    await self._start_peers(root, transport, pins)
                async with trio.open_nursery() as ops:
                    self._ops_nursery = ops
                    task_status.started()
                    # Cross-host writes end at UCX's TCP user timeout: say which one holds.
                    timeout = getattr(transport, "user_timeout", None)
                    extra = (
                        {"ucx_tcp_user_timeout": timeout[0], "set_by": timeout[1]}
                        if timeout
                        else {}
                    )
                    self.log.info("runtime_started", pools=self.memory.pool_names, **extra)
                    await self._pump()
                    ops.cancel_scope.cancel()
                if self.peers is not None:
                    await self.peers.source.stop()
                leaked = not await self._quiesce()
                # Pins go back to the engine only now that no transfer reads them.
                await pins.drain(self.config.operation_timeout_ms / 1000)
                root.cancel_scope.cancel()
        finally:
            try:
                await self._release(transport, leaked)
            finally:
                self.closed.set()

    async def _release(self, transport: Transport | None, leaked: bool) -> None:
        """Give back what the runtime holds, unless a transfer might still touch it."""
        try:
            if self.g3 is not None:
                self._close_g3(leaked)
            if self.mirror is not None:
                await self._blocking(self.mirror.close)  # the journal's last flush
            elif self.journal is not None:
                self.journal.buffer.release()
        finally:
            self.leaked = leaked
            if leaked:
                _LEAKED.append(transport)
                self.log.error(
                    "transport_leaked",
                    reason="transfers still in flight at close; memory stays registered",
                )
            elif transport is not None:
                try:
                    await self._blocking(transport.close)  # deregistration
                except BaseException:
                    # Half closed: its registrations may live on. Keep the memory.
                    self.leaked = True
                    _LEAKED.append(transport)
                    raise

    async def _start_g3(self, root: trio.Nursery, local: LocalG2, fine: bool) -> None:
        """Open the G3 files and their NIXL agent (off the loop: file setup and
        registration block), and let the pool spill to them."""
        from kvcr.transport.nixl_files import NixlFileTransport  # the only nixl import here

        opts = self.context.g3
        assert opts is not None
        templates = opts.templates if isinstance(opts, InstanceG3Options) else opts.paths

        def open_files() -> tuple[G3Files, NixlFileTransport]:
            files = G3Files(
                opts.paths,
                opts.capacity_bytes_per_file,
                self.memory.block_sizes[0],
                templates=templates,
                # Without a guard's journal no later instance reads these files.
                ephemeral=self.journal is None,
            )
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
            return files, transport

        files, transport = await self._blocking(open_files)
        self.log.info(
            "g3_paths",
            templates=[str(t) for t in templates],
            files=[str(f.path) for f in files.files],
            orphans_removed=[str(p) for p in files.removed_orphans],
        )
        transfers = Transfers(transport, self.log, fine, busy=True)
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
                self.shared.calls.inventory(InventoryEvent(tuple(restored), CacheTier.G3, False))

    def _g3_gauges(self) -> dict[str, float]:
        assert self.g3 is not None
        pool = self.g3.index.pools[0]
        return {
            "g3_capacity_bytes": pool.capacity * pool.block_size,
            "g3_used_bytes": pool.used * pool.block_size,
            "g3_blocks": self.g3.index.ready_count,
        }

    def _close_g3(self, leaked: bool) -> None:
        assert self.g3 is not None
        if leaked or self.g3.transfers.in_flight:
            self.log.error("g3_kept", reason="G3 transfers in flight at close")
            return
        self.g3.transport.close()
        self.g3.files.close()

    async def _start_warm(self, local: LocalG2, journal: Journal) -> None:
        """Recover the blocks the group's journal holds, then mirror changes into it. The
        replay (up to the journal's 100 MiB) runs off a shared loop; nothing else touches
        this runtime's index yet."""
        if journal.followed is not None:  # the guard followed it: the index is built
            kept, resume = journal.followed.g3, journal.followed.position
            self.log.info("recovered", blocks=len(self.index), g3_records=len(kept), followed=True)
        else:
            replayed, resume = await self._blocking(recover, self.index, journal.buffer, self.log)
            kept = replayed.g3
        # The base policy scores by recency, and recovered blocks have none: one pass.
        self.index.queue_recovered(local.score if local.scores_by_policy else None)
        self.mirror = Mirror(journal.buffer, self.index, kept, journal.group, self.log, resume)
        self.index.journal = self.mirror
        if len(self.index) and self.shared.calls.wants_inventory:
            keys, _ = self.index.ready_records()
            self.shared.calls.inventory(InventoryEvent(tuple(keys), CacheTier.LOCAL_G2, False))

    async def _start_peers(self, nursery: trio.Nursery, transport: Transport, pins: Pins) -> None:
        initialize = getattr(self.context.control, "initialize", None)
        if callable(initialize):
            initialize()  # idempotent on ZmqPeerControlChannel; binds if the adapter did not
        assert self.transfers is not None
        plane = Plane(self.context, transport)
        source = Source(
            self.context, self.shared, plane, self.transfers, self.index, self.local, pins
        )
        self.peers = Peers(self.context, self.shared, plane, source, pins)
        self.remote = Remote(self.context, self.shared, self.peers, self.local, self.index)
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
            for command in await self.shared.commands.get_batch():
                if isinstance(command, Close):
                    return
                try:
                    self._dispatch(command)
                except Exception as exc:  # a bug must not take the whole instance down
                    self.log.exception(
                        "command_failed", command=type(command).__name__, error=repr(exc)
                    )

    # -- commands ------------------------------------------------------------------------

    def _dispatch(self, command: Command) -> None:
        if isinstance(command, (Deposit, Deliver, Fetch)):
            self._start_op(command)
        elif isinstance(command, Release):
            if self.local is not None:
                for handle in command.handles:
                    self.local.release(handle)
        elif isinstance(command, Abort):
            self._abort(command.handle, command.keys)
        elif isinstance(command, Connect):
            if self.peers is not None:
                self.peers.link(command.endpoint)
        elif isinstance(command, Confirm):
            if self.remote is not None:
                self.remote.confirm(command.handle)
        elif isinstance(command, Align):
            if self.local is not None:
                self.local.align(command.keys, command.use_current_time, trio.current_time())
        else:
            raise ValueError(f"runtime: unknown command {command!r}")

    def _start_op(self, command: OpCommand) -> None:
        now = trio.current_time()
        handle, keys = command.handle, command.keys
        pending = self.outbox.pending_set(handle)
        if not keys:
            self.outbox.answer_empty(handle)
            return
        kind = type(command).__name__.lower()
        framework = Framework()
        if isinstance(command, Deposit):
            framework = Framework(sources=tuple(keys))
        elif isinstance(command, Deliver):
            framework = Framework(destination_refs=self._refs_of(command))
        op = Operation(handle, kind, keys, pending, Deadlines.starting(now, self.config), framework)
        body: Any
        if isinstance(command, Deposit):
            if self.local is None:
                self.outbox.fail_pending(op, "deposit: this instance has no local DRAM pools")
                return
            body = self.local.deposit(op, command.sources, command.no_evict, command.hints)
        elif isinstance(command, Deliver):
            body = self._read(op, command.destinations, command.remote)
        else:
            body = self._read(op, None, command.remote)
        assert self._ops_nursery is not None
        self.ops[handle] = op
        self._ops_nursery.start_soon(self._run_op, op, body)

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
        if self.g3 is not None:
            in_g2 = set(resident)
            g3_keys = [k for k in op.keys if k not in in_g2 and k in self.g3]
        remote_keys: list[BlockKey] = []
        if remote is not None and self.remote is not None:
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
                frozenset(remote_keys), remote.request, remote.mode, remote.no_retain
            )
        parts = []
        if resident and self.local is not None:
            if op.kind == "deliver":
                # The lookup holds while nothing runs in between: when local G2 is the only
                # part, awaited at once.
                alone = not g3_keys and not remote_keys
                looked_up = found if alone else None
                parts.append(self.local.deliver(op, destinations, resident, looked_up))
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
                parts.append(self.remote.deliver(op, destinations, remote_keys, remote.endpoint))
            else:
                parts.append(self.remote.fetch(op, remote_keys, remote.endpoint))
        if len(parts) == 1:
            await parts[0]  # the common case: no task hop
        elif parts:
            async with trio.open_nursery() as nursery:
                for part in parts:
                    nursery.start_soon(_await, part)

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
            if op.remote.failed and op.remote.keys:
                self.outbox.failed_hints.append(op.remote.request)
            self.ops.pop(op.handle, None)
            record(op, self.telemetry, self.memory, self.log)
            # In the root nursery: it must keep watching (and probing peers) while the
            # runtime stops, which cancels the operations first.
            if op.xfers and self._root is not None and not self.closed.is_set():
                self._root.start_soon(self._watch_abandoned, op)

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
                kind=op.kind,
                transfers=len(local),
                reason="still in flight past abandon_timeout_ms; its memory stays held",
            )
        for pull in [x for x in op.xfers if isinstance(x, RemotePull)]:
            assert self.peers is not None
            self.peers.quarantine(op, pull)

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

    def audit(self) -> list[str]:
        """Memory held that nobody owns, once quiet (see ``runtime/audit.py``)."""
        return audit(self)

    # -- published state -----------------------------------------------------------------

    def gauges(self) -> dict[str, float]:
        pools = self.index.pools
        return {
            "local_g2_capacity_bytes": sum(p.capacity * p.block_size for p in pools),
            "local_g2_used_bytes": sum(p.used * p.block_size for p in pools),
            "local_g2_blocks": len(self.index),
            "ops_in_flight": len(self.ops),
            "transfers_in_flight": self.transfers.in_flight if self.transfers else 0,
            "release_handles": len(self.shared.live_handles),
            **({"journal_fill_percent": self.mirror.fill_percent} if self.mirror else {}),
            **(self._g3_gauges() if self.g3 is not None else {}),
            **(self.peers.gauges() if self.peers is not None else {}),
        }
