"""Assembling a runtime: config, pools, transport and the engine's bindings in; one
:class:`Runtime` and what it shares with the engine side out.

Every runtime is built here, by :func:`build`, whoever runs it: the facade (``KVCR()``, in a
thread of its own), the in-loop test harness (``kvcr.testing``) and the guard service (a
dead worker's pool group, as a task of the service's supervisor nursery).

What a runtime is made of falls into two values:

- :class:`Context`: what every part reads and nobody changes (config, memory map, policy,
  options, log, id sources). Parts take it instead of a dozen arguments each.
- :class:`Shared`: what crosses the boundary between the engine's threads and the runtime's,
  each piece with one writer per direction (see its fields). Nothing else crosses it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from kvcr.bindings import NOTIFIED, KVCRBindings
from kvcr.config import (
    FrameworkControl,
    G3Options,
    KVCRBackendConfigs,
    KVCRConfig,
    RemoteFWDramOptions,
    for_instance,
)
from kvcr.policy import G3LRUPolicy, KVCachePolicy, LRUPolicy
from kvcr.runtime.engine_calls import EngineCalls, EngineSide
from kvcr.runtime.inbox import Inbox
from kvcr.runtime.memory import MemoryMap
from kvcr.runtime.mirror import Followed
from kvcr.runtime.ops import Outbox
from kvcr.telemetry import Telemetry
from kvcr.transport.auth import cluster_key_from_env
from kvcr.transport.base import Transport
from kvcr.types import BlockKey, CacheTier


@attrs.frozen(eq=False)
class Context:
    """What every part of one runtime reads, fixed for its life."""

    config: KVCRConfig
    memory: MemoryMap
    policy: KVCachePolicy
    source_tier: CacheTier  # what the engine's own memory is (FW_G1 with VRAM regions)
    control: FrameworkControl | None  # the peer control channel, if peers are enabled
    remote: RemoteFWDramOptions
    g3: G3Options | None
    cluster_key: bytes | None  # seals peer messages when set (KVCR_CLUSTER_KEY)
    log: Any
    # OpHandles and ReleaseHandles must not repeat across restarts of the process: both
    # count up from the clock. OpHandles come from the engine's threads too (submit).
    op_ids: Callable[[], int]
    release_ids: Iterator[int]
    # Blocking NIXL set-up and teardown through trio.to_thread: for a loop that others share
    # (the guard service's). A runtime with a thread of its own blocks only itself.
    offload_blocking: bool = False


@attrs.frozen(eq=False)
class Shared:
    """What the engine's threads and the runtime's thread both touch."""

    commands: Inbox  # engine threads put commands; the runtime takes them
    answers: Inbox  # the engine side puts the engine's answers; the runtime takes them
    calls: EngineCalls  # the runtime queues engine calls; the engine side makes them
    outbox: Outbox  # the runtime appends results; poll_completed pops them
    # Submit creates an operation's pending set; the runtime removes keys as it answers.
    open_ops: dict[int, set[BlockKey]]
    live_handles: set[int]  # the runtime adds release handles; release() removes them
    telemetry: Telemetry  # the runtime appends samples; the engine thread applies them


@attrs.frozen(eq=False)
class Journal:
    """A guard pool group's recovery journal, handed to the runtime, which owns it from
    then on: it starts warm from it and mirrors every change into it."""

    buffer: memoryview
    group: int
    # Replayed ahead of time (the guard follows every held group's journal): the runtime
    # takes its index over instead of replaying.
    followed: Followed | None = None


@attrs.frozen(eq=False)
class Built:
    runtime: Any  # runtime.Runtime (imported late: it imports most of this package)
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
) -> Built:
    """A runtime, not started yet (``await built.runtime.serve()`` runs it). ``control``
    stands in for ``bindings.framework_control`` when there are no bindings."""
    from kvcr.runtime.runtime import Runtime

    # KVCR() has expanded them already (the guard claim needs the files); this covers every
    # other builder, so that no runtime opens a file named after an unexpanded template.
    backend_configs = for_instance(
        config, backend_configs, journal.group if journal is not None else None
    )
    policy = resolve_policy(bindings, backend_configs)
    local = backend_configs.local_dram
    memory = MemoryMap(
        config.nixl_agent_name,
        config.pool_layouts,
        local.pools if local is not None else [],
        backend_configs.framework_regions,
    )
    op_ids = itertools.count(time.time_ns() // 1000)
    fw_g1 = any(r.mem_type == "VRAM" for r in backend_configs.framework_regions)
    context = Context(
        config=config,
        memory=memory,
        policy=policy,
        source_tier=CacheTier.FW_G1 if fw_g1 else CacheTier.FW_G2,
        control=bindings.framework_control if bindings is not None else control,
        remote=backend_configs.remote_fw_dram,
        g3=backend_configs.g3,
        cluster_key=cluster_key_from_env(),
        log=log,
        op_ids=lambda: next(op_ids),
        release_ids=itertools.count(time.time_ns() // 1000),
        offload_blocking=offload_blocking,
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
    )
    open_ops: dict[int, set[BlockKey]] = {}
    shared = Shared(
        commands=Inbox(),
        answers=Inbox(),
        calls=calls,
        outbox=Outbox(open_ops, calls),
        open_ops=open_ops,
        live_handles=set(),
        telemetry=telemetry,
    )
    engine = None
    if bindings is not None:
        engine = EngineSide(bindings, calls, shared.answers, log, also=telemetry.flush)
    runtime = Runtime(context, shared, transport_factory, journal, has_pools=local is not None)
    return Built(runtime, context, shared, engine)
