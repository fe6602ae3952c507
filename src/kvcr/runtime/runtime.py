"""The runtime: one trio task tree that owns all mutable state of a KVCR instance.

Engine threads never touch this state. They send commands (``runtime/commands.py``) and
read what the runtime publishes (the query views, the outbox, the set of live release
handles): ``Shared`` in ``runtime/context.py``. ``runtime/build.py`` assembles the runtime;
the runtime starts its parts in order, handing each what its constructor names, and routes
each command through one table (:attr:`Runtime.handlers`).

Task tree::

    serve                          until Close, or until its caller cancels it
    └── (shielded body)
        ├── transfers.run          polls in-flight transfers, idle when none
        ├── pins.run               engine pins
        ├── plane.run              the peer plane's receive and progress loops (if enabled)
        ├── abandonment watchers   what a failed operation left in flight, until it ends
        └── ops nursery            one task per operation (``operations.py``)

Shutdown, on Close or on cancellation alike, cancels the operations (their pending entries
fail with "closed"), then waits up to ``abandon_timeout_ms`` for in-flight transfers to end.
Only then is the transport closed and memory deregistered; if a transfer never ends, the
transport is deliberately leaked, never freed under a live transfer. So the runtime can run
as one task among others (the guard service serves a dead worker's group that way) and be
cancelled like any task. Blocking NIXL setup and teardown run in ``trio.to_thread``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import trio

from kvcr.config import InstanceG3Options
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
    Release,
)
from kvcr.runtime.context import Context, Journal, Shared
from kvcr.runtime.g3 import G3Tier, open_g3
from kvcr.runtime.links import Links
from kvcr.runtime.local import LocalG2
from kvcr.runtime.mirror import Mirror, recover
from kvcr.runtime.operations import Operations, Tiers
from kvcr.runtime.peers import Peers
from kvcr.runtime.pins import Pins
from kvcr.runtime.plane import Plane
from kvcr.runtime.source import Source
from kvcr.runtime.transfers import Transfers
from kvcr.transport.base import Transport
from kvcr.types import CacheTier, InventoryEvent

# Transports whose transfers never ended: kept referenced so their memory registrations
# and agents are never torn down under a transfer that might still run.
_LEAKED: list[object] = []


class Runtime:
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
        self.context = context
        self.shared = shared
        self.config = config = context.config
        self.memory = context.memory
        self.log = context.log
        self.telemetry = shared.telemetry
        self.outbox = shared.outbox
        self.has_pools = has_pools
        self.index = shared.g2_index
        self.g3_view = shared.g3_view
        self.journal = journal  # the guard group's recovery journal, owned from here on
        self.mirror: Mirror | None = None
        self.guard_attached = journal is not None  # until its tie says the service is gone
        self._transport_factory = transport_factory
        self.transport: Transport | None = None
        self.transfers: Transfers[Transport] | None = None
        self.tiers = Tiers()  # local G2, G3 and the peers' destination side, once started
        self.pins: Pins | None = None
        self.peers: Peers | None = None  # the peer control plane and both sides, if enabled
        self.operations = Operations(
            index=self.index,
            tiers=self.tiers,
            memory=self.memory,
            config=config,
            outbox=self.outbox,
            telemetry=self.telemetry,
            log=self.log,
        )
        self.ops = self.operations.ops
        self.closed = trio.Event()
        self.leaked = False  # set at close if memory stayed registered under a live transfer
        # Every command but Close (which ends the pump), by its type.
        self.handlers: Mapping[type[Command], Callable[[Any], None]] = {
            Deposit: self.operations.start,
            Deliver: self.operations.start,
            Fetch: self.operations.start,
            Abort: lambda c: self.operations.abort(c.handle, c.keys),
            Release: self._release_handles,
            Connect: self._connect,
            Confirm: self._confirm,
            Align: self._align,
        }

    @property
    def local(self) -> LocalG2 | None:
        return self.tiers.local

    @property
    def g3(self) -> G3Tier | None:
        return self.tiers.g3

    @property
    def plane(self) -> Plane | None:
        return self.peers.plane if self.peers is not None else None

    @property
    def links(self) -> Links | None:
        return self.peers.links if self.peers is not None else None

    @property
    def source(self) -> Source | None:
        return self.peers.source if self.peers is not None else None

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
                self.tiers.local = self._local_g2(self.transfers)
                if self.journal is not None:
                    await self._start_warm(self.tiers.local, self.journal)
            async with trio.open_nursery() as root:
                self.operations.root = root
                root.start_soon(self.transfers.run)
                if self.context.g3 is not None and self.tiers.local is not None:
                    await self._start_g3(root, self.tiers.local, fine)
                if self.journal is not None and self.journal.tie is not None:
                    root.start_soon(self.journal.tie.keep, self._guard_lost, self._guard_back)
                pins = self.pins = Pins(self.shared.calls, self.shared.answers, self.log)
                root.start_soon(pins.run)
                if self.context.control is not None:
                    await self._start_peers(root, transport, pins)
                async with trio.open_nursery() as ops:
                    self.operations.nursery = ops
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
                if self.source is not None:
                    await self.source.stop()
                leaked = not await self._quiesce()
                # Pins go back to the engine only now that no transfer reads them.
                await pins.drain(self.config.operation_timeout_ms / 1000)
                root.cancel_scope.cancel()
        finally:
            self.operations.root = None
            try:
                await self._release(transport, leaked)
            finally:
                self.closed.set()

    async def _release(self, transport: Transport | None, leaked: bool) -> None:
        """Give back what the runtime holds, unless a transfer might still touch it."""
        try:
            if self.g3 is not None:
                self.g3.close(leaked)
            if self.mirror is not None:
                await self._blocking(self.mirror.close)  # the journal's last flush
            elif self.journal is not None:
                self.journal.buffer.release()
        finally:
            self.leaked = leaked
            if leaked:
                # The G3 agent and the bounce buffer too: they register the same memory.
                _LEAKED.extend([transport, self.g3, self.context.bounce])
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

    def _local_g2(self, transfers: Transfers[Transport]) -> LocalG2:
        context, shared = self.context, self.shared
        return LocalG2(
            index=self.index,
            transfers=transfers,
            policy=context.policy,
            memory=self.memory,
            config=self.config,
            calls=shared.calls,
            outbox=self.outbox,
            live_handles=shared.live_handles,
            release_ids=context.release_ids,
            source_tier=context.source_tier,
            log=self.log,
        )

    async def _start_g3(self, root: trio.Nursery, local: LocalG2, fine: bool) -> None:
        """Open the G3 files and their NIXL agent (off the loop: file setup and
        registration block), and let the pool spill to them."""
        opts = self.context.g3
        assert opts is not None
        templates = opts.templates if isinstance(opts, InstanceG3Options) else opts.paths
        # Without a guard's journal no later instance reads these files.
        ephemeral = self.journal is None
        name = f"{self.config.nixl_agent_name}-g3"
        files, transport = await self._blocking(
            open_g3, opts, templates, self.memory, name, ephemeral
        )
        self.log.info(
            "g3_paths",
            templates=[str(t) for t in templates],
            files=[str(f.path) for f in files.files],
            orphans_removed=[str(p) for p in files.removed_orphans],
        )
        transfers = Transfers(transport, self.log, fine, busy=True)
        root.start_soon(transfers.run)
        g3 = self.tiers.g3 = G3Tier(
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
        local.g3, local.spawn = g3, root.start_soon
        if self.mirror is not None:
            restored = g3.restore(dict(self.mirror.g3_records))
            if restored:
                self.shared.calls.inventory(InventoryEvent(tuple(restored), CacheTier.G3, False))

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

    def _guard_lost(self) -> None:
        """The guard service is gone: serving goes on, the journal stops (``mirror.py``)."""
        self.guard_attached = False
        if self.mirror is not None:
            self.mirror.detach()

    def _guard_back(self) -> None:
        """Re-attached to a restarted service: journal again, from a snapshot."""
        self.guard_attached = True
        if self.mirror is not None:
            self.mirror.attach()

    async def _start_peers(self, nursery: trio.Nursery, transport: Transport, pins: Pins) -> None:
        assert self.transfers is not None
        peers = self.peers = Peers.assemble(
            self.context,
            transport=transport,
            transfers=self.transfers,
            index=self.index,
            local=self.tiers.local,
            g3=self.tiers.g3,  # started first: its blocks are served to peers too
            pins=pins,
            outbox=self.outbox,
            telemetry=self.telemetry,
        )
        self.tiers.destination = peers.destination
        await nursery.start(peers.plane.run, peers.sides())

    async def _quiesce(self) -> bool:
        """Wait, up to abandon_timeout_ms, until nothing can touch our memory: no local or
        source transfer in flight, and no peer still allowed to write into a pull's
        destination. False if something still might."""
        assert self.transfers is not None
        links = self.links
        with trio.move_on_after(self.config.abandon_timeout_ms / 1000):
            await self.transfers.wait_idle()
            if self.g3 is not None:
                await self.g3.transfers.wait_idle()
            while links is not None and links.pulls_in_flight():
                await trio.sleep(0.005)
        # A G3 transfer counts as much as any: a read may still write into the pools (or
        # the bounce slots), and the files must not be handed to a successor under it.
        g3_busy = self.g3 is not None and self.g3.transfers.in_flight > 0
        return (
            self.transfers.in_flight == 0
            and not g3_busy
            and not (links and links.pulls_in_flight())
        )

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
        handler = self.handlers.get(type(command))
        if handler is None:
            raise ValueError(f"runtime: unknown command {command!r}")
        handler(command)

    def _release_handles(self, command: Release) -> None:
        if self.tiers.local is not None:
            for handle in command.handles:
                self.tiers.local.release(handle)

    def _connect(self, command: Connect) -> None:
        if self.links is not None:
            self.links.link(command.endpoint)

    def _confirm(self, command: Confirm) -> None:
        if self.tiers.destination is not None:
            self.tiers.destination.confirm(command.handle)

    def _align(self, command: Align) -> None:
        if self.tiers.local is not None:
            self.tiers.local.align(command.keys, command.use_current_time, trio.current_time())

    def audit(self) -> list[str]:
        """Memory held that nobody owns, once quiet (see ``runtime/audit.py``)."""
        return audit(
            index=self.index,
            transfers=self.transfers,
            local=self.tiers.local,
            live_handles=self.shared.live_handles,
            ops=self.ops,
            links=self.links,
            source=self.source,
            pins=self.pins if self.plane is not None else None,
        )

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
            **(self._recovery_gauges() if self.mirror else {}),
            **(self.g3.gauges() if self.g3 is not None else {}),
            **(self.peers.gauges() if self.peers is not None else {}),
        }

    def _recovery_gauges(self) -> dict[str, float]:
        assert self.mirror is not None
        return {
            "journal_fill_percent": self.mirror.fill_percent,
            "recovery_disabled": 0.0 if self.mirror.recording else 1.0,
            "guard_attached": 1.0 if self.guard_attached else 0.0,
        }
