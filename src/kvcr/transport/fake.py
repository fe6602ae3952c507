"""In-memory transport with fault injection, for deterministic tests under trio's MockClock.

It really copies bytes (``ctypes.memmove``), but only when a transfer completes, the way a
late write lands. Each posted transfer follows a :class:`Behavior`: finish after a delay
(in trio time), fail, be refused at post, or never finish until the test says so.
Behaviors are taken from a script in posting order; with an empty script transfers finish
at once.
"""

from __future__ import annotations

import ctypes
import itertools
from collections import deque
from collections.abc import Callable, Sequence

import attrs

from kvcr.transport.base import Segment, TransportError, XferState


@attrs.frozen
class Behavior:
    delay: float | None = 0.0  # seconds after posting; None = never finishes by itself
    fail: bool = False  # finishes with ERR (after delay) and copies nothing
    refuse: bool = False  # post raises TransportError


NEVER = Behavior(delay=None)


@attrs.define
class FakeXfer:
    ident: int
    pairs: list[tuple[int, int, int]]  # (dst addr, src addr, nbytes)
    what: str
    behavior: Behavior
    posted_at: float
    state: XferState = XferState.PROC
    released: bool = False


class FakeTransport:
    def __init__(self, agent_name: str, clock: Callable[[], float]) -> None:
        self.agent_name = agent_name
        self._clock = clock
        self._descs: list[tuple[int, int]] = []
        self.script: deque[Behavior] = deque()
        self.posted: list[FakeXfer] = []
        self._ids = itertools.count(1)
        self.closed = False

    def open_local(self, segments: Sequence[Segment]) -> None:
        for seg in segments:
            self._descs.extend((seg.element_addr(i), seg.element_size) for i in range(seg.count))

    def post_local_read(self, dst: Sequence[int], src: Sequence[int], what: str) -> FakeXfer:
        behavior = self.script.popleft() if self.script else Behavior()
        if behavior.refuse:
            raise TransportError(f"{what}: fake transport refused the transfer")
        pairs = []
        for d, s in zip(dst, src):
            (daddr, dlen), (saddr, slen) = self._descs[d], self._descs[s]
            if dlen != slen:
                raise TransportError(f"{what}: descriptor sizes differ ({dlen} != {slen})")
            pairs.append((daddr, saddr, dlen))
        xfer = FakeXfer(next(self._ids), pairs, what, behavior, self._clock())
        self.posted.append(xfer)
        return xfer

    def poll(self, xfer: FakeXfer) -> XferState:
        delay = xfer.behavior.delay
        due = delay is not None and self._clock() >= xfer.posted_at + delay
        if xfer.state is XferState.PROC and due:
            self._finish(xfer, ok=not xfer.behavior.fail)
        return xfer.state

    def finish(self, xfer: FakeXfer, ok: bool = True) -> None:
        """Complete a transfer that would otherwise never finish (test control)."""
        if xfer.state is XferState.PROC:
            self._finish(xfer, ok)

    def _finish(self, xfer: FakeXfer, ok: bool) -> None:
        if ok:
            for daddr, saddr, n in xfer.pairs:
                ctypes.memmove(daddr, saddr, n)
        xfer.state = XferState.DONE if ok else XferState.ERR

    def release(self, xfer: FakeXfer) -> None:
        xfer.released = True

    def in_flight(self) -> list[FakeXfer]:
        return [x for x in self.posted if x.state is XferState.PROC]

    def close(self) -> None:
        if self.in_flight():
            raise TransportError("fake transport closed with transfers in flight")
        self.closed = True
