"""The values one runtime is made of, below every part that reads them.

- :class:`Context`: what the runtime reads and nobody changes (config, memory map, policy,
  options, log, id sources). The assembler (``build.py``) makes it; the runtime hands each
  part the fields that part names in its constructor, never the whole value.
- :class:`Shared`: what crosses the boundary between the engine's threads and the runtime's,
  each piece with one writer per direction (see its fields). Nothing else crosses it.
- :class:`Journal`: a guard pool group's recovery journal, handed to the runtime, and the
  hold's link to the service (:class:`GuardTie`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import attrs

from kvcr.config import FrameworkControl, G3Options, KVCRConfig, RemoteFWDramOptions
from kvcr.policy import KVCachePolicy
from kvcr.runtime.bounce import BounceBuffer
from kvcr.runtime.engine_calls import EngineCalls
from kvcr.runtime.inbox import Inbox
from kvcr.runtime.memory import MemoryMap
from kvcr.runtime.mirror import Followed
from kvcr.runtime.ops import Outbox
from kvcr.store.index import BlockIndex, Published
from kvcr.telemetry import Telemetry
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
    # Where G3 blocks are staged on their way to a peer (``bounce.py``); the memory map
    # names its slots. Referenced here so that it lives as long as the runtime.
    bounce: BounceBuffer | None = None


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
    # What query reads without a lock: local G2's index (the runtime writes it) and the file
    # tier's, published once that tier runs (after the facade exists).
    g2_index: BlockIndex
    g3_view: Published


@attrs.frozen(eq=False)
class Journal:
    """A guard pool group's recovery journal, handed to the runtime, which owns it from
    then on: it starts warm from it and mirrors every change into it."""

    buffer: memoryview
    group: int
    # Replayed ahead of time (the guard follows every held group's journal): the runtime
    # takes its index over instead of replaying.
    followed: Followed | None = None
    # The lease's link to the service (a worker's hold): the runtime keeps it from its loop.
    tie: GuardTie | None = None


class GuardTie(Protocol):
    """A hold's link to the guard service (``guard/lease_link.py``), as the runtime uses
    it: it beats from the runtime's loop, calls ``lost()`` when the service is gone and
    ``back()`` once a restarted one let the group re-attach."""

    async def keep(self, lost: Callable[[], None], back: Callable[[], None]) -> None: ...
