"""What the block index's batch calls hand back: a lookup (:class:`Found`), records made
FILLING at once (:class:`Filling`) and records claimed at once (:class:`Claim`). Pure code.

Each holds numpy arrays over a batch of keys (records, flags, generations, slots), so the
runtime's hot paths work on masks over them, with no view per key.
"""

from __future__ import annotations

import numpy as np

from kvcr.store.keytable import Probe
from kvcr.store.records import IS_ATTACHED, IS_FILLING, IS_READY, Block
from kvcr.types import BlockKey

_new = tuple.__new__  # a view in one C call, as records.py makes them


class Found:
    """One lookup of a batch of keys (:meth:`BlockIndex.lookup`): each key's record (-1:
    none) and its state flags (0: none), and (``probe``) the key table's lookup, which can
    file the keys it found absent without looking for them again."""

    __slots__ = ("flags", "probe", "recs")

    def __init__(self, recs: np.ndarray, flags: np.ndarray, probe: Probe | None = None) -> None:
        self.recs, self.flags, self.probe = recs, flags, probe

    def held(self) -> np.ndarray:
        """Which keys have a record."""
        held: np.ndarray = self.recs >= 0
        return held

    def subset(self, mask: np.ndarray) -> Found:
        """The lookup of the keys that ``mask`` selects."""
        return Found(self.recs[mask], self.flags[mask])

    @property
    def ready(self) -> np.ndarray:
        """Which keys have a READY record in the index."""
        ready: np.ndarray = self.flags == IS_ATTACHED | IS_READY
        return ready

    @property
    def filling(self) -> np.ndarray:
        """Which keys have a record being filled."""
        filling: np.ndarray = self.flags & IS_FILLING != 0
        return filling


class Filling:
    """Records made FILLING at once (:meth:`BlockIndex.add_fills`), with their keys,
    generations and slots: a deposit fills, commits and settles them with masks over these
    arrays, no view per key (views cost ~1 us each at a thousand keys, with the collector's
    share of them)."""

    __slots__ = ("gens", "keys", "number", "recs", "slots")

    def __init__(
        self,
        keys: list[BlockKey],
        recs: np.ndarray,
        gens: np.ndarray,
        slots: np.ndarray,
        number: int,
    ) -> None:
        # slots: n x pools (its first column: recs); number: the index's
        self.keys, self.recs, self.gens, self.slots, self.number = keys, recs, gens, slots, number

    def __len__(self) -> int:
        return len(self.keys)

    def subset(self, mask: np.ndarray) -> Filling:
        """The records that ``mask`` selects."""
        keys = [key for key, kept in zip(self.keys, mask.tolist()) if kept]
        return Filling(keys, self.recs[mask], self.gens[mask], self.slots[mask], self.number)

    def views(self) -> list[Block]:
        """A view of each record (for the paths that hand blocks on: hooks, release handles)."""
        number = self.number
        return [
            _new(Block, (rec, gen, key, tuple(slots), number))
            for key, rec, gen, slots in zip(
                self.keys, self.recs.tolist(), self.gens.tolist(), self.slots.tolist()
            )
        ]


class Claim:
    """Records claimed at once (:meth:`BlockIndex.claim_ready`), with their generations:
    dropping the claims later touches only the records that are still those."""

    __slots__ = ("gens", "recs")

    def __init__(self, recs: np.ndarray, gens: np.ndarray) -> None:
        self.recs, self.gens = recs, gens

    def __len__(self) -> int:
        return len(self.recs)
