"""Waiting for a G3 tier's moves in a test: the tier starts a store or a read and calls
back when the transfer is terminal; these wait for that callback and return its keys."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import trio

from kvcr.runtime.g3 import G3Tier, Then
from kvcr.types import BlockKey


async def store(tier: G3Tier, items: Sequence[tuple[BlockKey, int]], what: str) -> set[BlockKey]:
    return await _wait(lambda then: tier.store(items, what, then))


async def read(tier: G3Tier, items: Sequence[tuple[BlockKey, int]], what: str) -> set[BlockKey]:
    return await _wait(lambda then: tier.read(items, what, then))


async def _wait(start: Callable[[Then], object]) -> set[BlockKey]:
    over = trio.Event()
    moved: set[BlockKey] = set()

    def then(_xfer: object, keys: set[BlockKey]) -> None:
        moved.update(keys)
        over.set()

    start(then)
    await over.wait()
    return moved
