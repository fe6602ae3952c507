"""Waiting for a fill in progress in local G2: one trio event per record somebody waits on.

The runtime's, not the block index's: the store imports no trio.
"""

from __future__ import annotations

import trio

from kvcr.store.batches import Filling
from kvcr.store.records import Block


class FillWaiters:
    """Who waits for a fill in progress: an event per record, keyed by (rec, generation) as
    the index's views name it, made only when somebody waits (most fills have no waiter)."""

    def __init__(self) -> None:
        self._events: dict[tuple[int, int], trio.Event] = {}

    async def wait(self, block: Block) -> None:
        """Wait until ``block``'s fill is over, committed or not."""
        event = self._events.get((block.rec, block.gen))
        if event is None:
            event = self._events[(block.rec, block.gen)] = trio.Event()
        await event.wait()

    def over(self, block: Block) -> None:
        event = self._events.pop((block.rec, block.gen), None)
        if event is not None:
            event.set()

    def over_many(self, fill: Filling) -> None:
        """Wake whoever waits for the fill of one of ``fill``'s records (usually nobody)."""
        if self._events:
            for record in zip(fill.recs.tolist(), fill.gens.tolist()):
                event = self._events.pop(record, None)
                if event is not None:
                    event.set()
