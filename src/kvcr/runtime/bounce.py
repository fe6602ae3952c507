"""Bounce slots: host memory in which a source stages G3 blocks on their way to a peer.

A peer's pull is served by one NIXL write from registered host memory. A block that is
only in G3 (the file tier) is first read into a bounce slot, then written from there with
the pull's local G2 blocks. Bounce slots are memory of their own, not slots of the pools:
a worker's pool is full whenever it spills (that is when G3 gets blocks), so free pool
slots would be there exactly when G3 has nothing; and the guard, serving a dead worker's
group, must not evict the blocks the next holder recovers in order to make room. So a
runtime with G3 and peers maps a small anonymous buffer (:class:`BounceBuffer`), which
both of its NIXL agents register like the pools (its descriptors follow the pools' and
the engine regions', ``memory.py``), and lends its slots out one pull at a time
(:class:`BounceSlots`).

A slot is lent until nothing can touch it any more: the G3 read into it and the peer
write out of it are both terminal. A pull that gives up (deadline, probe, close) while
its read is in flight leaves its slots to the read's completion. Pulls that find every
slot lent get their G3 keys as misses (a partial answer, as for any key the source lacks).
"""

from __future__ import annotations

import ctypes
import mmap

# Bytes of bounce memory a runtime maps: at most this many bytes of G3 blocks are on their
# way to peers at once (fewer when G3 holds fewer blocks). Anonymous memory: only the pages
# a read touched become resident.
BOUNCE_BYTES = 64 << 20


def bounce_slot_count(block: int, g3_blocks: int) -> int:
    """How many bounce slots of ``block`` bytes a runtime whose G3 holds ``g3_blocks``
    blocks maps: :data:`BOUNCE_BYTES`' worth, no more than G3 holds, at least one."""
    return max(1, min(BOUNCE_BYTES // block, g3_blocks))


class BounceBuffer:
    """``slots`` blocks of ``block`` bytes of anonymous memory, page-aligned. It must live as
    long as a transport registers it: whoever keeps a leaked transport keeps this too."""

    def __init__(self, block: int, slots: int) -> None:
        if block <= 0 or slots <= 0:
            raise ValueError(f"bounce buffer: {slots} slots of {block} bytes")
        self.block = block
        self.slots = slots
        self._mmap = mmap.mmap(-1, block * slots, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = ctypes.c_char.from_buffer(self._mmap)
        try:
            self.addr = ctypes.addressof(view)
        finally:
            del view  # no export left behind: the mapping stays closable

    def read(self, slot: int) -> bytes:
        """Slot ``slot``'s bytes (for tests)."""
        return self._mmap[slot * self.block : (slot + 1) * self.block]


class BounceSlots:
    """Lends the descriptor indices ``[base, base + count)`` of a bounce buffer."""

    def __init__(self, base: int, count: int) -> None:
        self.base = base
        self.count = count
        self._free = list(range(base + count - 1, base - 1, -1))  # lowest index lent first

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, wanted: int) -> list[int]:
        """Up to ``wanted`` free descriptors, now lent."""
        n = min(wanted, len(self._free))
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        taken.reverse()
        return taken

    def give(self, descriptors: list[int]) -> None:
        """Descriptors lent by :meth:`take`, free again (nothing touches them any more)."""
        free = set(self._free)
        for desc in descriptors:
            if not self.base <= desc < self.base + self.count:
                raise ValueError(f"bounce slots: descriptor {desc} is not one of ours")
            if desc in free:
                raise ValueError(f"bounce slots: descriptor {desc} was given back twice")
            free.add(desc)
        self._free.extend(reversed(descriptors))
