"""Serving a pool group whose holder died: a runtime over the group's pools, on the group's
control endpoint, as a task of the guard service's supervisor nursery.

The runtime is built like any other (``runtime/build.py``) and starts warm from the group's
journal, so it holds exactly the blocks the dead worker had committed. It has no engine
(no bindings, no framework regions: nothing is ever pinned) and is only a source: peers'
pulls aimed at the dead worker's incarnation are refused at once (``Over``), after which
they ask this new incarnation and get whatever it holds. It runs in the service's own trio
loop; its blocking NIXL setup and teardown go through ``trio.to_thread``.

If the group's terms name G3 files, the server opens them too (their locks died with the
holder), keeps the journal's G3 records that the files still vouch for, as the next holder
would, and serves those blocks through bounce slots of its own (``runtime/bounce.py``):
each is read from its file, checked against its record, and written to the peer with the
pull's G2 blocks. The server never writes the files, and never evicts to make room.

To hand the group back, the server's task is cancelled: the runtime then stops in order
(it waits for writes and G3 reads in flight, bounded by ``abandon_timeout_ms``), flushes
its mirror and closes the G3 files, so the next holder recovers the same state and can lock
the files. A transfer still in flight then keeps the files open and the group unusable.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import attrs
import trio

from kvcr.config import (
    InstanceG3Options,
    KVCRBackendConfigs,
    KVCRConfig,
    LocalDramOptions,
    RemoteFWDramOptions,
)
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.guard.pools import GroupMapping
from kvcr.guard.rules import Terms
from kvcr.runtime.bounce import BounceBuffer
from kvcr.runtime.build import bounce_for, build
from kvcr.runtime.context import Journal
from kvcr.runtime.memory import MemoryMap
from kvcr.runtime.mirror import Followed
from kvcr.transport.factory import nixl_factory

_WILDCARDS = {"", "0.0.0.0", "::", "*"}
_instances = itertools.count(1)


def agent_name(index: int) -> str:
    """A new NIXL agent name for a server of group ``index`` (peers tell incarnations
    apart by it)."""
    return f"kvcr-guard-{os.getpid()}-g{index}-{next(_instances)}"


def server_configs(
    name: str, terms: Terms, mapping: GroupMapping
) -> tuple[KVCRConfig, KVCRBackendConfigs]:
    """The config of a server of the group: its pools as the holder laid them out, and its
    G3 files, which the holder's claim named already expanded for its instance."""
    layouts = list(terms.layouts)
    pools = [
        (pool, address, size)
        for (pool, _), address, (_, size) in zip(
            layouts, mapping.pool_addresses, mapping.layout.pools
        )
    ]
    config = KVCRConfig(name, layouts)
    g3 = None
    if terms.g3 is not None:
        paths = tuple(Path(p) for p in terms.g3.paths)
        g3 = InstanceG3Options(
            paths=paths,
            capacity_bytes_per_file=terms.g3.capacity_bytes_per_file,
            backend=terms.g3.backend,
            backend_options=dict(terms.g3.backend_options),
            templates=paths,
        )
    backends = KVCRBackendConfigs(
        local_dram=LocalDramOptions(pools=pools),
        g3=g3,
        remote_fw_dram=RemoteFWDramOptions(eager_ctrl_connect=False, backend=terms.backend),
    )
    return config, backends


def group_memory(
    terms: Terms, mapping: GroupMapping, bounce: BounceBuffer | None = None
) -> MemoryMap:
    """The memory map a server of the group has: its pools, no engine regions, and the
    bounce slots of its G3 blocks, if it has any."""
    config, backends = server_configs("map", terms, mapping)
    assert backends.local_dram is not None
    return MemoryMap(
        config.nixl_agent_name, config.pool_layouts, backends.local_dram.pools, [], bounce
    )


@attrs.define(eq=False)
class Standby:
    """A NIXL transport opened over a held group's pools ahead of a takeover: creating the
    agent and preparing a descriptor per slot takes ~0.3 s at a million slots, which a
    takeover then does not wait for."""

    name: str
    transport: Any
    bounce: BounceBuffer | None  # registered with the transport: the server's to use

    @classmethod
    def open(cls, index: int, terms: Terms, mapping: GroupMapping) -> Standby:
        """Blocking (NIXL set-up): run it off the service's loop."""
        name = agent_name(index)
        config, backends = server_configs(name, terms, mapping)
        bounce = bounce_for(config, backends, peers=True)
        memory = group_memory(terms, mapping, bounce)
        transport = nixl_factory(config, backends)()
        try:
            transport.open_local(memory.segments)
        except BaseException:
            transport.close()
            raise
        return cls(name, transport, bounce)

    def close(self) -> None:
        """Blocking: deregister and close the unused transport."""
        self.transport.close()


class CannotServe(Exception):
    """The group cannot be served (nothing to do with a failure of the service)."""


class _Started:
    """trio's task_status, remembering whether the runtime said it started."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.done = False

    def started(self, value: object = None) -> None:
        self.done = True
        self.inner.started(value)


class GroupServer:
    def __init__(
        self, index: int, runtime: Any, channel: ZmqPeerControlChannel, shared: Any, log: Any
    ) -> None:
        self.index = index
        self.runtime = runtime
        self.channel = channel
        self.shared = shared
        self.log = log
        self.scope = trio.CancelScope()
        self.ended = trio.Event()
        self.failure: str | None = None  # why the runtime stopped on its own, if it did

    def served_blocks(self) -> int:
        """Blocks this server's runtime has written to peers."""
        return int(self.runtime.gauges().get("source_written_blocks", 0))

    def served_g3_blocks(self) -> int:
        """... of which it read from the group's G3 files."""
        return int(self.runtime.gauges().get("source_g3_blocks", 0))

    @classmethod
    def prepare(
        cls,
        index: int,
        terms: Terms,
        mapping: GroupMapping,
        listener: Any,
        log: Any,
        followed: Followed | None = None,
        standby: Standby | None = None,
    ) -> GroupServer:
        """Build the group's runtime over its pools and journal, not started yet
        (CannotServe when the group cannot be served). ``followed``: the journal replayed
        already (the runtime takes its index over instead of replaying); ``standby``: a
        transport opened over the pools already (the runtime takes it over)."""
        host, port = listener.getsockname()[:2]
        advertise = terms.advertise or host
        if advertise in _WILDCARDS:
            raise CannotServe(
                f"group {index}: the endpoint is bound to {host!r} and its holder did not say "
                "which address peers use"
            )
        channel = ZmqPeerControlChannel(host, port, advertise)
        journal_offset, journal_size = mapping.layout.journal
        journal = memoryview(mapping.mmap)[journal_offset : journal_offset + journal_size]
        try:
            channel.adopt_listener(listener.fileno())
            name = standby.name if standby is not None else agent_name(index)
            config, backends = server_configs(name, terms, mapping)
            factory = nixl_factory(config, backends)
            built = build(
                config,
                backends,
                (lambda: standby.transport) if standby is not None else factory,
                log=log.bind(agent=config.nixl_agent_name),
                control=channel,
                journal=Journal(journal, index, followed),
                offload_blocking=True,  # the service's loop serves every group and claim
                bounce=standby.bounce if standby is not None else None,
            )
        except BaseException:
            # Not handed to a runtime: ours to let go of (a live view would keep the group
            # from ever being unmapped).
            journal.release()
            channel.close()
            raise
        return cls(index, built.runtime, channel, built.shared, log)

    async def start(self, nursery: trio.Nursery) -> None:
        """Run the runtime as a task of ``nursery``; returns once it serves. A failure to
        start raises here. Cancelled meanwhile, it returns only once the runtime stopped."""
        await nursery.start(self._serve)
        self.log.info(
            "serving",
            group=self.index,
            blocks=len(self.runtime.index),
            endpoint=self.channel.endpoint,
        )

    async def _serve(self, *, task_status: Any) -> None:
        log = self.log
        started = _Started(task_status)
        try:
            with self.scope:
                await self.runtime.serve(task_status=started)
                self.failure = "its runtime stopped"  # nobody sends it Close: a bug
        except Exception as exc:
            if not started.done:
                raise  # failed to start: nursery.start raises it to the caller
            self.failure = f"its runtime failed: {exc!r}"
            log.exception("serving_failed", group=self.index, error=repr(exc))
        finally:
            self.channel.close()
            # No engine thread can post to them: give their eventfds back now rather than at
            # the next full garbage collection of the runtime's reference cycles.
            self.shared.commands.close()
            self.shared.answers.close()
            self.ended.set()

    @property
    def clean(self) -> bool:
        """Whether no transfer of the runtime can still read the pools: it stopped in order
        and nothing was left in flight (a runtime that failed may have left anything)."""
        return self.ended.is_set() and self.failure is None and not self.runtime.leaked

    async def stop(self) -> bool:
        """Stop serving once no transfer reads the pools; False if a transfer might still
        read them after the abandon deadline (then the group must not be lent again). The
        journal holds what this server held either way."""
        self.scope.cancel()
        await self.ended.wait()
        return self.clean
