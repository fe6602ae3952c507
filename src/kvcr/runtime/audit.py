"""Accounting of a quiet runtime, for tests and debugging: memory held that nobody owns."""

from __future__ import annotations

import collections

from kvcr.runtime.links import Links
from kvcr.runtime.local import LocalG2
from kvcr.runtime.ops import Operation
from kvcr.runtime.pins import Pins
from kvcr.runtime.source import Source
from kvcr.runtime.transfers import Transfers
from kvcr.store.index import BlockIndex
from kvcr.store.records import BlockState
from kvcr.transport.base import Transport


def audit(
    *,
    index: BlockIndex,
    transfers: Transfers[Transport] | None,
    local: LocalG2 | None,
    live_handles: set[int],
    ops: dict[int, Operation],
    links: Links | None,
    source: Source | None,
    pins: Pins | None,
) -> list[str]:
    """Memory held that nobody owns, once the runtime is quiet (no transfer, pull or
    source write in flight): slots outside the index, claims without a release handle,
    pins not handed back. Internal: for tests and debugging; empty means clean."""
    slots = index.audit()
    problems = [
        f"{slots[what]} {meaning}"
        for what, meaning in (
            ("double", "slots handed out twice"),
            ("quarantined", "slots held with no record"),
            ("view_mismatch", "keys whose query answer disagrees with their record"),
        )
        if slots[what]
    ]
    if transfers is not None and transfers.in_flight:
        problems.append(f"{transfers.in_flight} transfers in flight")
    holders = collections.Counter(local.handles.values()) if local else {}
    for block in index.blocks():
        key = block.key
        if block.claims != holders.get(key, 0):
            problems.append(
                f"key {key!r}: {block.claims} claims, {holders.get(key, 0)} release handles"
            )
        if block.state is not BlockState.READY:
            problems.append(f"key {key!r}: still filling")
    if local is not None and set(local.handles) != live_handles:
        problems.append("release handles: the runtime's and the facade's differ")
    if ops:
        problems.append(f"{len(ops)} operations still open")
    if links is not None and links.pulls_in_flight():
        problems.append(f"{links.pulls_in_flight()} pulls in flight")
    if source is not None and source.jobs:
        problems.append(f"{len(source.jobs)} source jobs open")
    if pins is not None and pins.outstanding:
        problems.append(f"{pins.outstanding} engine pins outstanding")
    return problems
