"""Assembling a runtime: config, pools, transport and the engine's bindings in; one
:class:`Runtime` and what it shares with the engine side out.

Every runtime is built here, by :func:`build`, whoever runs it: the facade (``KVCR()``, in a
thread of its own), the in-loop test harness (``kvcr.testing``) and the guard service (a
dead worker's pool group, as a task of the service's supervisor nursery).

What a runtime is made of falls into two values:

- :class:`~kvcr.runtime.context.Context`: what the runtime reads and nobody changes;
- :class:`~kvcr.runtime.context.Shared`: what the engine's threads and the runtime's share.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import attrs
import trio

from kvcr.bindings import NOTIFIED, KVCRBindings
from kvcr.config import FrameworkControl, KVCRBackendConfigs, KVCRConfig, for_instance
from kvcr.policy import G3LRUPolicy, KVCachePolicy, LRUPolicy
from kvcr.runtime.bounce import BounceBuffer, bounce_slot_count
from kvcr.runtime.context import Context, Journal, Shared
from kvcr.runtime.engine_calls import EngineCalls, EngineSide
from kvcr.runtime.inbox import Inbox
from kvcr.runtime.memory import MemoryMap
from kvcr.runtime.ops import Outbox
from kvcr.runtime.residency import index_options
from kvcr.runtime.runtime import Runtime
from kvcr.store.index import BlockIndex, Published
from kvcr.store.slots import slot_pools
from kvcr.telemetry import Telemetry
from kvcr.tracing import Tracing
from kvcr.transport.auth import cluster_key_from_env
from kvcr.transport.base import Transport
from kvcr.types import BlockKey, CacheTier


@attrs.frozen(eq=False)
class Built:
    runtime: Runtime
    context: Context
    shared: Shared
    engine: EngineSide | None  # None without bindings: nothing to call (the guard)


def resolve_policy(bindings: KVCRBindings | None, backend_configs: KVCRBackendConfigs) -> Any:
    """The bindings' policy, or the default for the configured tiers; a policy whose
    required tiers are not configured is a ValueError."""
    policy = bindings.policy if bindings is not None else None
    if policy is None:
        policy = G3LRUPolicy() if backend_configs.g3 is not None else LRUPolicy()
    tiers = {CacheTier.LOCAL_G2} if backend_configs.local_dram is not None else set()
    if backend_configs.g3 is not None:
        tiers.add(CacheTier.G3)
    required = frozenset(getattr(policy, "required_tiers", frozenset()))
    if not required <= tiers:
        missing = sorted(t.name for t in required - tiers)
        raise ValueError(
            f"KVCRBindings: policy {type(policy).__name__} requires tier(s) {missing}, "
            "which this configuration does not have"
        )
    return policy


def g2_index(
    memory: MemoryMap, policy: KVCachePolicy, journal: Journal | None
) -> tuple[BlockIndex, Journal | None]:
    """Local G2's block index: the one the guard built by following the group's journal,
    if its pools match ours, else an empty one (the journal is then replayed at start)."""
    pools = slot_pools(memory.pool_names, memory.block_sizes, memory.pool_slots)
    followed = journal.followed if journal is not None else None
    if followed is not None and [p.capacity for p in followed.index.pools] == [
        p.capacity for p in pools
    ]:
        return followed.index, journal
    if journal is not None:
        journal = attrs.evolve(journal, followed=None)
    return BlockIndex(pools, **index_options(policy)), journal


def bounce_for(
    config: KVCRConfig, backend_configs: KVCRBackendConfigs, peers: bool
) -> BounceBuffer | None:
    """The bounce buffer of a runtime that serves its G3 blocks to peers (G3, local DRAM and
    a peer plane), else None."""
    g3 = backend_configs.g3
    if g3 is None or backend_configs.local_dram is None or not peers:
        return None
    block = config.pool_layouts[0][1]  # G3 needs exactly one pool
    blocks = len(g3.paths) * (g3.capacity_bytes_per_file // block)
    return BounceBuffer(block, bounce_slot_count(block, blocks))


def build(
    config: KVCRConfig,
    backend_configs: KVCRBackendConfigs,
    transport_factory: Callable[[], Transport],
    *,
    log: Any,
    bindings: KVCRBindings | None = None,
    control: FrameworkControl | None = None,
    journal: Journal | None = None,
    offload_blocking: bool = False,
    bounce: BounceBuffer | None = None,
) -> Built:
    """A runtime, not started yet (``await built.runtime.serve()`` runs it). ``control``
    stands in for ``bindings.framework_control`` when there are no bindings. ``bounce``:
    the bounce buffer a transport opened ahead of the runtime registered (the guard's
    standby); a runtime with G3 and peers maps its own otherwise."""
    # KVCR() has expanded them already (the guard claim needs the files); this covers every
    # other builder, so that no runtime opens a file named after an unexpanded template.
    backend_configs = for_instance(
        config, backend_configs, journal.group if journal is not None else None
    )
    policy = resolve_policy(bindings, backend_configs)
    local = backend_configs.local_dram
    control = bindings.framework_control if bindings is not None else control
    if bounce is None:
        bounce = bounce_for(config, backend_configs, control is not None)
    memory = MemoryMap(
        config.nixl_agent_name,
        config.pool_layouts,
        local.pools if local is not None else [],
        backend_configs.framework_regions,
        bounce,
    )
    op_ids = itertools.count(time.time_ns() // 1000)
    fw_g1 = any(r.mem_type == "VRAM" for r in backend_configs.framework_regions)
    context = Context(
        config=config,
        memory=memory,
        policy=policy,
        source_tier=CacheTier.FW_G1 if fw_g1 else CacheTier.FW_G2,
        control=control,
        remote=backend_configs.remote_fw_dram,
        g3=backend_configs.g3,
        cluster_key=cluster_key_from_env(),
        log=log,
        op_ids=lambda: next(op_ids),
        release_ids=itertools.count(time.time_ns() // 1000),
        offload_blocking=offload_blocking,
        bounce=bounce,
    )
    present = frozenset(
        name
        for name in (*NOTIFIED, "cancel_pin_request")
        if bindings is not None and getattr(bindings, name) is not None
    )
    calls = EngineCalls(present, log)
    runtime: Runtime | None = None
    telemetry = Telemetry(
        bindings.stats_factory if bindings is not None and config.enable_telemetry else None,
        lambda: runtime.gauges() if runtime is not None else {},
        log,
        Tracing.find(config.enable_telemetry, trio.current_time, log),
    )
    open_ops: dict[int, set[BlockKey]] = {}
    index, journal = g2_index(memory, policy, journal)
    shared = Shared(
        commands=Inbox(),
        answers=Inbox(),
        calls=calls,
        outbox=Outbox(open_ops, calls),
        open_ops=open_ops,
        live_handles=set(),
        telemetry=telemetry,
        g2_index=index,
        g3_view=Published(),
    )
    engine = None
    if bindings is not None:
        engine = EngineSide(
            bindings, calls, shared.answers, log, also=telemetry.flush, also_due=telemetry.pending
        )
    runtime = Runtime(context, shared, transport_factory, journal, has_pools=local is not None)
    return Built(runtime, context, shared, engine)
