"""In-memory transport with fault injection, for deterministic tests under trio's MockClock.

It really copies bytes (``ctypes.memmove``), but only when a transfer completes, the way a
late write lands. Each posted transfer follows a :class:`Behavior`: finish after a delay
(in trio time), fail, be refused at post, or never finish until the test says so.
Behaviors are taken from a script in posting order; with an empty script transfers finish
at once.

Several fake transports in one process talk through a :class:`FakeFabric` (peer writes,
notifications, a peer that dies); :class:`FakeControlHub` is the matching in-memory
control channel. Both exist only so deadline and fault paths can run under MockClock;
the data path is tested on real NIXL and ZMQ.
"""

from __future__ import annotations

import ctypes
import itertools
import os
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
    peer: FakeTransport | None = None  # a remote write's destination
    notif: bytes = b""
    sender: str = ""


class FakeFabric:
    """The 'network' between fake transports: who is alive under which agent name."""

    def __init__(self) -> None:
        self.agents: dict[str, FakeTransport] = {}

    def kill(self, agent: str) -> None:
        """The process behind ``agent`` died: its own writes never finish, writes to it fail."""
        transport = self.agents.pop(agent)
        transport.dead = True


class FakeTransport:
    def __init__(
        self, agent_name: str, clock: Callable[[], float], fabric: FakeFabric | None = None
    ) -> None:
        self.agent_name = agent_name
        self._clock = clock
        self._descs: list[tuple[int, int]] = []
        self._segments: list[tuple[int, int]] = []  # registered (addr, span)
        self.script: deque[Behavior] = deque()
        self.posted: list[FakeXfer] = []
        self._ids = itertools.count(1)
        self.closed = False
        self.dead = False
        self.fabric = fabric
        self._token = f"fake:{agent_name}:{id(self):x}".encode()
        self._peers: dict[str, bytes] = {}
        self._notifs: deque[tuple[str, bytes]] = deque()
        if fabric is not None:
            fabric.agents[agent_name] = self

    def open_local(self, segments: Sequence[Segment]) -> None:
        for seg in segments:
            self._descs.extend((seg.element_addr(i), seg.element_size) for i in range(seg.count))
            self._segments.append((seg.addr, seg.span))

    def post_local_read(self, dst: Sequence[int], src: Sequence[int], what: str) -> FakeXfer:
        pairs = []
        for d, s in zip(dst, src):
            (daddr, dlen), (saddr, slen) = self._descs[d], self._descs[s]
            if dlen != slen:
                raise TransportError(f"{what}: descriptor sizes differ ({dlen} != {slen})")
            pairs.append((daddr, saddr, dlen))
        return self._post(pairs, what)

    def _post(self, pairs: list[tuple[int, int, int]], what: str, **remote: object) -> FakeXfer:
        behavior = self.script.popleft() if self.script else Behavior()
        if behavior.refuse:
            raise TransportError(f"{what}: fake transport refused the transfer")
        if self.dead:
            behavior = NEVER
        xfer = FakeXfer(next(self._ids), pairs, what, behavior, self._clock(), **remote)
        self.posted.append(xfer)
        return xfer

    # -- peers -----------------------------------------------------------------------------

    def metadata(self) -> bytes:
        return self._token

    def add_peer(self, metadata: bytes) -> str:
        name = metadata.decode().split(":")[1]
        self._peers[name] = metadata
        return name

    def remove_peer(self, agent: str) -> None:
        self._peers.pop(agent, None)

    def _live_peer(self, agent: str) -> FakeTransport | None:
        target = self.fabric.agents.get(agent) if self.fabric is not None else None
        if target is None or self._peers.get(agent) != target.metadata():
            return None
        return target

    def post_write(
        self,
        src: Sequence[int],
        dst: Sequence[tuple[int, int]],
        peer: str,
        notif: bytes,
        what: str,
    ) -> FakeXfer:
        if peer not in self._peers:
            raise TransportError(f"{what}: peer {peer!r} is not known (no metadata added)")
        target = self._live_peer(peer)
        pairs = []
        for index, (daddr, dlen) in zip(src, dst):
            saddr, slen = self._descs[index]
            if slen != dlen:
                raise TransportError(f"{what}: descriptor sizes differ ({slen} != {dlen})")
            if target is not None and not target.registered(daddr, dlen):
                raise TransportError(
                    f"{what}: destination range {daddr:#x}+{dlen} is not registered at {peer!r}"
                )
            pairs.append((daddr, saddr, slen))
        return self._post(pairs, what, peer=target, notif=notif, sender=self.agent_name)

    def registered(self, addr: int, nbytes: int) -> bool:
        return any(base <= addr and addr + nbytes <= base + span for base, span in self._segments)

    def notifications(self) -> list[tuple[str, bytes]]:
        out = list(self._notifs)
        self._notifs.clear()
        return out

    def progress(self) -> None:
        return None

    # -- transfers -------------------------------------------------------------------------

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
        target = xfer.peer
        remote = bool(xfer.sender)
        if remote and (target is None or target.dead or target.closed):
            ok = False  # like NIXL: a write to a peer that is gone (or never was) fails
        if ok:
            for daddr, saddr, n in xfer.pairs:
                ctypes.memmove(daddr, saddr, n)
            if target is not None and xfer.notif:
                target._notifs.append((xfer.sender, xfer.notif))
        xfer.state = XferState.DONE if ok else XferState.ERR

    def release(self, xfer: FakeXfer) -> None:
        """Like NIXL: releasing a transfer still in flight cancels it (nothing more lands)."""
        xfer.released = True
        if xfer.state is XferState.PROC:
            xfer.state = XferState.ERR

    def in_flight(self) -> list[FakeXfer]:
        return [x for x in self.posted if x.state is XferState.PROC]

    def close(self) -> None:
        if self.in_flight():
            raise TransportError("fake transport closed with transfers in flight")
        self.closed = True
        if self.fabric is not None and self.fabric.agents.get(self.agent_name) is self:
            del self.fabric.agents[self.agent_name]


class FakeControlHub:
    """In-memory control channels addressed by endpoint string; each channel has a real
    pipe fd that is readable while messages wait, so the runtime waits on it as on ZMQ's."""

    def __init__(self) -> None:
        self.channels: dict[str, FakeControlChannel] = {}
        self.sent: list[tuple[str, bytes]] = []  # (to endpoint, message), for assertions
        self.drop: Callable[[str, bytes], bool] = lambda endpoint, message: False

    def channel(self, endpoint: str) -> FakeControlChannel:
        channel = FakeControlChannel(self, endpoint)
        self.channels[endpoint] = channel
        return channel


class FakeControlChannel:
    def __init__(self, hub: FakeControlHub, endpoint: str) -> None:
        self.hub = hub
        self.endpoint = endpoint
        self._inbox: deque[bytes] = deque()
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.closed = False

    def send(self, endpoint: str, message: bytes) -> bool:
        if self.closed:
            return False
        self.hub.sent.append((endpoint, message))
        target = self.hub.channels.get(endpoint)
        if target is None or target.closed or self.hub.drop(endpoint, message):
            return True  # queued, as ZMQ would, and lost
        target._inbox.append(message)
        os.write(target._write, b"\0")
        return True

    def recv(self) -> list[bytes]:
        out = list(self._inbox)
        self._inbox.clear()
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass
        return out

    def fileno(self) -> int:
        return self._read

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self._read)
            os.close(self._write)
