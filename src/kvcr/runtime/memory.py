"""Where every descriptor lives: KVCR pool slots and engine region elements.

The memory map is fixed at startup and never changes, so engine threads may read it while
the runtime runs: ``resolve`` turns an engine ``MemoryRef`` into a global descriptor index
on the calling thread, and a bad ref is rejected before anything is enqueued.

Descriptor numbering: pools first, in ``pool_layouts`` order (slot ``s`` of pool ``p`` is
``pool_base[p] + s``), then framework regions in their configured order, then the bounce
slots (``bounce.py``: G3 blocks on their way to a peer), if the runtime has any.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import numpy as np

from kvcr.runtime.bounce import BounceBuffer
from kvcr.transport.base import Descriptors, Segment
from kvcr.types import BlockKey, MemoryRef, PoolBlockLayouts, RegionDescriptor


class MemoryMap:
    def __init__(
        self,
        agent_name: str,
        pool_layouts: PoolBlockLayouts,
        pools: Sequence[tuple[str, int, int]],
        framework_regions: Sequence[RegionDescriptor],
        bounce: BounceBuffer | None = None,
    ) -> None:
        self.agent_name = agent_name
        self.pool_names = [name for name, _ in pool_layouts]
        self.block_sizes = [size for _, size in pool_layouts]
        self._pool_count = len(self.block_sizes)
        by_name = {name: (addr, size) for name, addr, size in pools}
        self.segments: list[Segment] = []
        self.pool_base: list[int] = []
        self.pool_slots: list[int] = []
        base = 0
        for name, block in pool_layouts:
            # Without local DRAM (peer reuse only) the pools exist with no slots.
            addr, size = by_name.get(name, (0, 0))
            slots = size // block
            if slots:
                self.segments.append(Segment(f"pool:{name}", addr, block, slots))
            self.pool_base.append(base)
            self.pool_slots.append(slots)
            base += slots
        self.regions: dict[str, tuple[RegionDescriptor, int]] = {}
        for region in framework_regions:
            self.segments.append(
                Segment(
                    f"region:{region.label}", region.addr, region.size, region.count, region.stride
                )
            )
            self.regions[region.label] = (region, base)
            base += region.count
        # Bounce slots are one block of the one pool each (G3 needs exactly one pool).
        self.bounce_base, self.bounce_slots = base, 0
        if bounce is not None:
            if self._pool_count != 1 or bounce.block != self.block_sizes[0]:
                raise ValueError(
                    f"bounce buffer: {bounce.block}-byte slots need exactly one pool of that "
                    f"block size, the layout has {list(zip(self.pool_names, self.block_sizes))}"
                )
            self.segments.append(Segment("bounce", bounce.addr, bounce.block, bounce.slots))
            self.bounce_slots = bounce.slots
            base += bounce.slots
        # For the one-pool fast path of resolve_blocks: regions whose elements fit the pool.
        one = self.block_sizes[0] if self._pool_count == 1 else -1
        self._fitting = {
            label: (region.count, first)
            for label, (region, first) in self.regions.items()
            if region.size == one
        }
        self._region_at = [(first, label) for label, (_, first) in self.regions.items()]
        self.descriptor_count = base
        self.bytes_per_key = sum(self.block_sizes)
        self.descriptors = Descriptors(self.segments)

    def ranges(self, descs: Sequence[int]) -> list[tuple[int, int]]:
        """(address, bytes) of each descriptor: what a peer writes into."""
        addrs, sizes = self.descriptors.lookup(np.asarray(descs, dtype=np.int64))
        return list(zip(addrs.tolist(), sizes.tolist()))

    def slot_ref(self, pool: int, slot: int) -> MemoryRef:
        return MemoryRef(
            end_point_name=self.agent_name, label=self.pool_names[pool], element_index=slot
        )

    def resolve_blocks(
        self, what: str, blocks: Mapping[Any, object]
    ) -> dict[BlockKey, tuple[int, ...]]:
        """Descriptor indices of each key's engine refs (one per pool), or ValueError naming
        the first bad key or ref (as :meth:`resolve_key` does)."""
        if self._pool_count == 1:
            resolved = self._resolve_one_pool(blocks)
            if resolved is not None:
                return resolved
        out: dict[BlockKey, tuple[int, ...]] = {}
        for position, (key, refs) in enumerate(blocks.items()):
            if not isinstance(key, bytes):
                raise ValueError(f"{what}: key #{position} must be bytes, got {type(key).__name__}")
            out[BlockKey(key)] = self.resolve_key(what, position, key, refs)
        return out

    def _resolve_one_pool(
        self, blocks: Mapping[Any, object]
    ) -> dict[BlockKey, tuple[int, ...]] | None:
        """:meth:`resolve_blocks` for one pool, in one loop on the engine's thread (a
        thousand keys a call): None at the first thing not plainly right, for the slow
        path to name."""
        agent, fitting = self.agent_name, self._fitting
        out: dict[bytes, tuple[int, ...]] = {}
        for key, refs in blocks.items():
            if type(key) is not bytes or type(refs) not in (list, tuple) or len(refs) != 1:  # type: ignore[arg-type]
                return None
            ref = refs[0]  # type: ignore[index]
            if type(ref) is not MemoryRef or ref.end_point_name != agent:
                return None
            region = fitting.get(ref.label)
            index = ref.element_index
            if region is None or type(index) is not int or not 0 <= index < region[0]:
                return None
            out[key] = (region[1] + index,)
        return cast("dict[BlockKey, tuple[int, ...]]", out)  # keys checked: bytes

    def refs_of(self, descs: Iterable[int]) -> tuple[MemoryRef, ...]:
        """The engine refs of region descriptors (those :meth:`resolve_key` gave)."""
        starts = [first for first, _ in self._region_at]
        refs = []
        for desc in descs:
            first, label = self._region_at[bisect.bisect_right(starts, desc) - 1]
            refs.append(
                MemoryRef(end_point_name=self.agent_name, label=label, element_index=desc - first)
            )
        return tuple(refs)

    def resolve_key(self, what: str, position: int, key: object, refs: object) -> tuple[int, ...]:
        """Descriptor indices of a key's engine refs, one per pool, or ValueError naming the
        key's position, the ref, the region and the limit."""
        if (type(refs) is list or type(refs) is tuple) and len(refs) == self._pool_count:
            if self._pool_count == 1:
                return (self._resolve_ref(what, position, 0, refs[0]),)
            return tuple([self._resolve_ref(what, position, p, r) for p, r in enumerate(refs)])
        if not isinstance(refs, (list, tuple)):
            raise ValueError(
                f"{what}: key #{position} ({key!r}): refs must be a list of MemoryRef, "
                f"got {type(refs).__name__}"
            )
        raise ValueError(
            f"{what}: key #{position} ({key!r}) has {len(refs)} refs, the pool layout "
            f"{self.pool_names} needs one per pool ({len(self.block_sizes)})"
        )

    def _resolve_ref(self, what: str, position: int, pool: int, ref: object) -> int:
        # The fast path checks everything without building a message; the slow path names
        # exactly what is wrong.
        if type(ref) is MemoryRef and ref.end_point_name == self.agent_name:
            entry = self.regions.get(ref.label)
            if entry is not None:
                region, base = entry
                index = ref.element_index
                if (
                    type(index) is int
                    and 0 <= index < region.count
                    and region.size == self.block_sizes[pool]
                ):
                    return base + index
        raise ValueError(self._ref_problem(what, position, pool, ref))

    def _ref_problem(self, what: str, position: int, pool: int, ref: object) -> str:
        where = f"{what}: key #{position} ref {pool}"
        if not isinstance(ref, MemoryRef):
            return f"{where} must be a MemoryRef, got {type(ref).__name__}"
        if ref.end_point_name != self.agent_name:
            return (
                f"{where}: agent {ref.end_point_name!r} is not this instance's agent "
                f"{self.agent_name!r}"
            )
        entry = self.regions.get(ref.label)
        if entry is None:
            return (
                f"{where}: region {ref.label!r} is not a registered framework region "
                f"(labels: {sorted(self.regions)})"
            )
        region, _base = entry
        index = ref.element_index
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < region.count:
            return (
                f"{where}: element_index {index!r} is out of range for region {ref.label!r} "
                f"(count {region.count})"
            )
        return (
            f"{where}: region {ref.label!r} has {region.size}-byte elements, pool "
            f"{self.pool_names[pool]!r} has {self.block_sizes[pool]}-byte blocks"
        )
