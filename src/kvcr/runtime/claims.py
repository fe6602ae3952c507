"""What holds a block in local G2 from the runtime's side: claims, and waiters on a fill.

A *claim* keeps a block resident and out of the eviction queue (a read, a write to a peer, a
release handle); the last claim going queues it again with a fresh score. A task that needs
a block another operation is filling waits for that fill to be over, committed or not.
Local G2 (``residency.py``) and the file tier (``g3.py``) both hold blocks this way.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from kvcr.store.index import Block, BlockIndex


async def wait_filled(block: Block) -> None:
    """Wait until ``block``'s fill is over, committed or not. The event is made only when
    somebody waits: most fills have no waiter."""
    if block.waiters is None:
        block.waiters = trio.Event()
    await block.waiters.wait()


def claim(index: BlockIndex, block: Block, now: float | None = None) -> None:
    """Hold ``block`` in ``index`` (a read, a write to a peer, a release handle): out of
    the eviction queue until the last claim goes; ``now`` counts as an access."""
    index.claim(block, now)


def unclaim(
    index: BlockIndex, block: Block, score: Callable[[Block], float], now: float | None = None
) -> None:
    """Drop one claim; the last one queues the block again with a fresh score (``now``: an
    access that ended now)."""
    if index.unclaim(block):
        if now is not None:
            index.touch(block, now)
        index.rescore(block, score(block))


def fill_over(block: Block) -> None:
    if block.waiters is not None:
        block.waiters.set()
        block.waiters = None
