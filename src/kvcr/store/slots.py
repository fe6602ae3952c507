"""Free slots of a pool: which of its slots hold a block, handed out lowest first. Pure code.

A pool is one of the memory regions a block index files records in (a key's record owns one
slot in every pool); :func:`slot_pools` makes them from a memory map's plain values.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from kvcr.store.native import take_free


class SlotPool:
    """Free slots of one pool: a byte per slot (0: free). Lowest-numbered slots are handed
    out first."""

    def __init__(self, name: str, block_size: int, capacity: int) -> None:
        self.name = name
        self.block_size = block_size
        self.capacity = capacity
        self.taken = bytearray(capacity)
        self._free = capacity
        self._low = 0  # no free slot below this one

    @property
    def free(self) -> int:
        return self._free

    @property
    def used(self) -> int:
        return self.capacity - self._free

    @property
    def free_slots(self) -> frozenset[int]:
        """The free slots (O(capacity): for checks, not hot paths)."""
        return frozenset(np.flatnonzero(np.frombuffer(self.taken, np.uint8) == 0).tolist())

    def take(self) -> int:
        return int(self.take_many(1)[0])

    def take_many(self, count: int) -> np.ndarray:
        """``count`` free slots (the lowest ones), ascending (intp): one scan in the
        compiled core."""
        if count > self._free:
            raise IndexError(f"pool {self.name!r}: {count} slots wanted, {self._free} free")
        slots, self._low = take_free(self.taken, self._low, count)
        self._free -= count
        return np.frombuffer(slots, np.intp)

    def release_many(self, slots: np.ndarray) -> None:
        """:meth:`release` for many distinct slots at once."""
        taken = np.frombuffer(self.taken, np.uint8)
        if not taken[slots].all():
            raise ValueError(f"pool {self.name!r}: a slot released twice")
        taken[slots] = 0
        self._free += len(slots)
        self._low = min(self._low, int(slots.min()))

    def release(self, slot: int) -> None:
        if not self.taken[slot]:
            raise ValueError(f"pool {self.name!r}: slot {slot} released twice")
        self.taken[slot] = 0
        self._free += 1
        self._low = min(self._low, slot)

    def take_these(self, slots: Iterable[int]) -> None:
        """Take specific free slots (recovered blocks occupy the slots they had)."""
        for slot in slots:
            if self.taken[slot]:
                raise ValueError(f"pool {self.name!r}: slot {slot} is taken")
            self.taken[slot] = 1
            self._free -= 1

    def take_checked(self, slots: np.ndarray) -> None:
        """:meth:`take_these` for slots the caller checked free, in range and distinct."""
        np.frombuffer(self.taken, np.uint8)[slots] = 1
        self._free -= len(slots)


def slot_pools(
    names: Sequence[str], block_sizes: Sequence[int], slot_counts: Sequence[int]
) -> list[SlotPool]:
    """A slot pool for each pool of a memory map: its name, block size and slot count."""
    return [
        SlotPool(name, block, slots) for name, block, slots in zip(names, block_sizes, slot_counts)
    ]
