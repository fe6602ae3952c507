"""Claims: what keeps a block resident in a tier's index and out of its eviction queue (a
read, a write to a peer, a release handle). The last claim going queues the block again with
a fresh score. Local G2 (``residency.py``) and the file tier (``g3.py``) both hold blocks
this way.
"""

from __future__ import annotations

from collections.abc import Callable

from kvcr.store.index import Block, BlockIndex


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
