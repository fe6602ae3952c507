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

A :class:`FaultPlan` shared by the fabric and the hub drops, delays, duplicates or reorders
the next messages of a given type (control messages and notifications alike) and counts
what it did. ``watch`` on a transport sees every byte range a landing transfer reads from
or writes into that agent's memory, so a test can check it was the transfer's to touch.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import attrs
import trio

from kvcr.transport import messages
from kvcr.transport.auth import unsealed
from kvcr.transport.base import Segment, TransportError, XferState


@attrs.frozen
class Behavior:
    delay: float | None = 0.0  # seconds after posting; None = never finishes by itself
    fail: bool = False  # finishes with ERR (after delay) and copies nothing
    refuse: bool = False  # post raises TransportError
    # With ``fail``: the bytes land (and a peer write's notification leaves) before the
    # transfer reports ERR, as when the completion is followed by an error.
    lands: bool = False


NEVER = Behavior(delay=None)

FaultKind = Literal["drop", "delay", "duplicate", "reorder"]


@attrs.frozen
class Fault:
    """What happens to one message on its way: ``drop`` it; ``delay`` it by ``seconds``;
    ``duplicate`` it (delivered now, and again ``seconds`` later); ``reorder`` it (held
    until the next message to the same place has been delivered, at most ``seconds``)."""

    kind: FaultKind
    seconds: float = 0.0


# Watches see (access, address, bytes) for memory a landing transfer touches.
Watch = Callable[[Literal["read", "write"], int, int], None]


class FaultPlan:
    """Faults for the next messages of a type (``messages.TYPES`` names: control messages
    and the ``written`` notification), applied in the order they were added; ``applied``
    lists every fault that hit a message. Delays need :meth:`run` in a nursery."""

    def __init__(self) -> None:
        self._rules: list[tuple[str, Fault]] = []
        self.applied: list[tuple[str, Fault]] = []
        self._held: dict[str, list[Callable[[], None]]] = {}  # place -> reordered deliveries
        self._nursery: trio.Nursery | None = None
        self.pending = 0  # deliveries scheduled for later and not done yet

    def add(self, kind: str, fault: Fault, count: int = 1) -> None:
        if kind not in messages.TYPES:
            raise ValueError(f"fault plan: unknown message type {kind!r}")
        self._rules.extend([(kind, fault)] * count)

    @property
    def armed(self) -> int:
        """Faults added but not applied yet (their message never came)."""
        return len(self._rules)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def route(self, raw: bytes, place: str, deliver: Callable[[], None]) -> None:
        """Deliver ``raw`` to ``place`` through ``deliver``, unless a fault says otherwise."""
        fault = self._take(raw)
        if fault is None:
            self._deliver(place, deliver)
        elif fault.kind == "delay":
            self._later(fault.seconds, lambda: self._deliver(place, deliver))
        elif fault.kind == "duplicate":
            self._deliver(place, deliver)
            self._later(fault.seconds, lambda: self._deliver(place, deliver))
        elif fault.kind == "reorder":
            once = _Once(deliver)
            self._held.setdefault(place, []).append(once)
            self._later(fault.seconds, once)  # nothing overtook it in time
        # "drop": nothing

    def _take(self, raw: bytes) -> Fault | None:
        if not self._rules:
            return None
        try:
            kind = messages.decode(unsealed(raw)).TYPE
        except messages.MessageError:
            return None
        for i, (wanted, fault) in enumerate(self._rules):
            if wanted == kind:
                del self._rules[i]
                self.applied.append((kind, fault))
                return fault
        return None

    def _deliver(self, place: str, deliver: Callable[[], None]) -> None:
        deliver()
        for held in self._held.pop(place, []):
            held()

    def _later(self, seconds: float, deliver: Callable[[], None]) -> None:
        if self._nursery is None:
            raise RuntimeError("fault plan: delayed delivery needs FaultPlan.run in a nursery")
        self.pending += 1

        async def at() -> None:
            try:
                await trio.sleep(seconds)
                deliver()
            finally:
                self.pending -= 1

        self._nursery.start_soon(at)


class _Once:
    """A delivery that happens at most once (a reordered message: overtaken or timed out)."""

    def __init__(self, deliver: Callable[[], None]) -> None:
        self._deliver: Callable[[], None] | None = deliver

    def __call__(self) -> None:
        deliver, self._deliver = self._deliver, None
        if deliver is not None:
            deliver()


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
        self.plan: FaultPlan | None = None  # faults for notifications

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
        self.watch: Watch | None = None
        if fabric is not None:
            fabric.agents[agent_name] = self

    def open_local(self, segments: Sequence[Segment]) -> None:
        for seg in segments:
            self._descs.extend((addr, seg.element_size) for addr in seg.element_addrs())
            self._segments.append((seg.addr, seg.span))

    def post_local_read(self, dst: Sequence[int], src: Sequence[int], what: str) -> FakeXfer:
        pairs = []
        for d, s in zip(dst, src):
            (daddr, dlen), (saddr, slen) = self._descs[d], self._descs[s]
            if dlen != slen:
                raise TransportError(f"{what}: descriptor sizes differ ({dlen} != {slen})")
            pairs.append((daddr, saddr, dlen))
        return self._post(pairs, what)

    def _post(
        self,
        pairs: list[tuple[int, int, int]],
        what: str,
        *,
        peer: FakeTransport | None = None,
        notif: bytes = b"",
        sender: str = "",
    ) -> FakeXfer:
        behavior = self.script.popleft() if self.script else Behavior()
        if behavior.refuse:
            raise TransportError(f"{what}: fake transport refused the transfer")
        if self.dead:
            behavior = NEVER
        xfer = FakeXfer(
            next(self._ids),
            pairs,
            what,
            behavior,
            self._clock(),
            peer=peer,
            notif=notif,
            sender=sender,
        )
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

    def inject_notification(self, sender: str, raw: bytes) -> None:
        """A notification as if agent ``sender`` had sent it (replays, forgeries)."""
        self._notifs.append((sender, raw))

    @property
    def known_agents(self) -> frozenset[str]:
        """Agents whose metadata this transport loaded (add_peer, not yet removed)."""
        return frozenset(self._peers)

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
        # Like NIXL: a write to a peer that is gone (or never was) fails.
        gone = bool(xfer.sender) and (target is None or target.dead or target.closed)
        ok = ok and not gone
        lands = ok or (xfer.behavior.lands and not gone)
        if lands:
            written = target if target is not None else self
            for daddr, saddr, n in xfer.pairs:
                if self.watch is not None:
                    self.watch("read", saddr, n)
                if written.watch is not None:
                    written.watch("write", daddr, n)
                ctypes.memmove(daddr, saddr, n)
            if target is not None and xfer.notif:
                target._notify(xfer.sender, xfer.notif)
        xfer.state = XferState.DONE if ok else XferState.ERR

    def _notify(self, sender: str, notif: bytes) -> None:
        plan = self.fabric.plan if self.fabric is not None else None
        if plan is None:
            self._notifs.append((sender, notif))
        else:
            plan.route(notif, self.agent_name, lambda: self._notifs.append((sender, notif)))

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
        self.plan: FaultPlan | None = None
        self._held: dict[str, list[Callable[[], None]]] = {}

    def channel(self, endpoint: str) -> FakeControlChannel:
        channel = FakeControlChannel(self, endpoint)
        self.channels[endpoint] = channel
        return channel

    @contextlib.contextmanager
    def holding(self, endpoint: str) -> Iterator[None]:
        """Messages to ``endpoint`` wait while inside, then arrive together, in order: the
        receiver reads them in one batch (to script what one receive sees)."""
        self._held.setdefault(endpoint, [])
        try:
            yield
        finally:
            for put in self._held.pop(endpoint):
                put()

    def arrive(self, endpoint: str, put: Callable[[], None]) -> None:
        held = self._held.get(endpoint)
        if held is None:
            put()
        else:
            held.append(put)


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

        def put() -> None:
            self.hub.arrive(endpoint, lambda: target._put(message))

        if self.hub.plan is None:
            put()
        else:
            self.hub.plan.route(message, endpoint, put)
        return True

    def _put(self, message: bytes) -> None:
        if self.closed:
            return  # a late delivery to a channel closed meanwhile is lost
        self._inbox.append(message)
        os.write(self._write, b"\0")

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
