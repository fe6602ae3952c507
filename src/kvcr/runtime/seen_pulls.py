"""The pulls a source has acted on, so that it acts on each at most once.

A source remembers the requests it served, refused or declared over in a probe answer, per
destination incarnation: a duplicate, or a pull that arrives after the probe the destination
sent when it gave up on it, is dropped instead of writing into memory the destination may
already have handed back. Memory is bounded both ways; what is forgotten counts as seen.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import attrs

SEEN_PULLS = 4096  # requests remembered per destination incarnation
SEEN_INCARNATIONS = 64  # destination incarnations remembered (least recently pulling goes)


@attrs.define(eq=False)
class _Window:
    """One destination incarnation's requests seen. Its requests are numbered upward, so
    the oldest ones are forgotten into ``floor``: anything at or below it counts as seen
    (a pull that late is refused, which is the safe side)."""

    reqs: set[int] = attrs.field(factory=set)
    order: deque[int] = attrs.field(factory=deque)
    floor: int = 0

    def add(self, req: int) -> bool:
        if req <= self.floor or req in self.reqs:
            return False
        self.reqs.add(req)
        self.order.append(req)
        if len(self.order) > SEEN_PULLS:
            old = self.order.popleft()
            self.reqs.discard(old)
            self.floor = max(self.floor, old)
        return True


class SeenPulls:
    """Pull requests this source has acted on, per destination incarnation (bounded)."""

    def __init__(self) -> None:
        self._windows: OrderedDict[int, _Window] = OrderedDict()

    def add(self, incarnation: int, req: int) -> bool:
        """Record ``req``; False if it was seen (or forgotten as too old) before."""
        window = self._windows.pop(incarnation, None) or _Window()
        self._windows[incarnation] = window  # most recently used last
        if len(self._windows) > SEEN_INCARNATIONS:
            self._windows.popitem(last=False)
        return window.add(req)

    def forget(self, incarnation: int) -> None:
        """That destination process is gone (a new incarnation greeted from its agent)."""
        self._windows.pop(incarnation, None)
