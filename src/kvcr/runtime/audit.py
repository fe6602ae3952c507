"""Accounting of a quiet runtime, for tests and debugging: memory held that nobody owns."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from kvcr.store.records import BlockState

if TYPE_CHECKING:
    from kvcr.runtime.runtime import Runtime


def audit(runtime: Runtime) -> list[str]:
    """Memory held that nobody owns, once the runtime is quiet (no transfer, pull or
    source write in flight): slots outside the index, claims without a release handle,
    pins not handed back. Internal: for tests and debugging; empty means clean."""
    slots = runtime.index.audit()
    problems = [
        f"{slots[what]} {meaning}"
        for what, meaning in (
            ("double", "slots handed out twice"),
            ("quarantined", "slots held with no record"),
            ("view_mismatch", "keys whose query answer disagrees with their record"),
        )
        if slots[what]
    ]
    if runtime.transfers is not None and runtime.transfers.in_flight:
        problems.append(f"{runtime.transfers.in_flight} transfers in flight")
    holders = collections.Counter(runtime.local.handles.values()) if runtime.local else {}
    for block in runtime.index.blocks():
        key = block.key
        if block.claims != holders.get(key, 0):
            problems.append(
                f"key {key!r}: {block.claims} claims, {holders.get(key, 0)} release handles"
            )
        if block.state is not BlockState.READY:
            problems.append(f"key {key!r}: still filling")
    if runtime.local is not None and set(runtime.local.handles) != runtime.shared.live_handles:
        problems.append("release handles: the runtime's and the facade's differ")
    if runtime.ops:
        problems.append(f"{len(runtime.ops)} operations still open")
    if runtime.peers is not None:
        if runtime.peers.pulls_in_flight():
            problems.append(f"{runtime.peers.pulls_in_flight()} pulls in flight")
        if runtime.peers.source.jobs:
            problems.append(f"{len(runtime.peers.source.jobs)} source jobs open")
        if runtime.peers.pins.outstanding:
            problems.append(f"{runtime.peers.pins.outstanding} engine pins outstanding")
    return problems
