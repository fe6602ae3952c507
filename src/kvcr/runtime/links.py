"""The destination's links to the sources it pulls from: greeting each endpoint a router
hint names (our NIXL metadata, retried every ``metadata_retry_interval_ms`` until
acknowledged), and knowing which process answers there.

A link is ready once the incarnation at its endpoint acknowledged our greeting. A different
incarnation answering later means the source restarted: the old process can no longer write,
so the pulls aimed at it end (``restarted``), and the link is greeted again. Incarnations a
newer one replaced are remembered as gone, so a late message of theirs changes nothing.
"""

from __future__ import annotations

from typing import Any

import trio

from kvcr.config import KVCRConfig
from kvcr.runtime.lifecycle import Link, PullEvent
from kvcr.runtime.ops import Operation
from kvcr.runtime.plane import Plane
from kvcr.telemetry import Telemetry
from kvcr.transport import messages as m
from kvcr.transport.base import TransportError


class Links:
    def __init__(
        self,
        *,
        plane: Plane,
        config: KVCRConfig,
        retry_interval_s: float,
        telemetry: Telemetry,
        log: Any,
    ) -> None:
        self.plane = plane
        self.config = config
        self.retry_interval_s = retry_interval_s
        self.telemetry = telemetry
        self.log = log
        self.links: dict[str, Link] = {}

    def get(self, endpoint: str) -> Link | None:
        return self.links.get(endpoint)

    def busy(self) -> bool:
        """A pull is in flight (the progress loop's question, on the runtime's thread)."""
        return any(link.pulls for link in self.links.values())

    def latest_due(self) -> float:
        """When the latest pull in flight should have landed (0.0: none)."""
        return max(
            (p.due for link in self.links.values() for p in link.pulls.values()), default=0.0
        )

    def pulls_in_flight(self) -> int:
        # list() copies in one step: get_stats calls this from an engine thread.
        return sum(len(link.pulls) for link in list(self.links.values()))

    def ready_count(self) -> int:
        return sum(1 for link in list(self.links.values()) if link.ready.is_set())

    def link(self, endpoint: str) -> Link:
        """The link to ``endpoint``, greeting it if it is not set up (eager or lazy)."""
        link = self.links.get(endpoint)
        if link is None:
            link = self.links[endpoint] = Link(endpoint)
        if not link.ready.is_set() and not link.greeting and self.plane.nursery is not None:
            link.greeting = True
            self.plane.spawn(self._greet, link)
            self.plane.wake()
        return link

    async def _greet(self, link: Link) -> None:
        """Send our metadata until the source acknowledges it, at most for
        ``abandon_timeout_ms`` (a dead endpoint is not greeted forever: the next use of
        the link greets it again)."""
        started = trio.current_time()
        transport = self.plane.transport
        hello = m.Hello(
            self.plane.my_endpoint(),
            self.plane.incarnation,
            transport.agent_name,
            transport.metadata(),
        )
        try:
            with trio.move_on_after(self.config.abandon_timeout_ms / 1000):
                while not link.ready.is_set():
                    self.plane.send(link.endpoint, hello)
                    with trio.move_on_after(self.retry_interval_s):
                        await link.ready.wait()
        finally:
            link.greeting = False
        result = "success" if link.ready.is_set() else "failed"
        self.telemetry.record("peer_setup", trio.current_time() - started, result)
        if not link.ready.is_set():
            self.log.warning("peer_unreachable", endpoint=link.endpoint)

    def on_hello_ack(self, msg: m.HelloAck) -> None:
        # Only an answer to our greeting says who is at the endpoint: an unsolicited one (the
        # link is not being greeted) must not switch the link to an incarnation nobody
        # vouched for, which would turn the real source away as "gone" for good.
        link = self.links.get(msg.sender)
        if (
            link is None
            or not link.greeting
            or msg.acked != self.plane.incarnation
            or msg.incarnation in link.gone
        ):
            self.plane.drop("stale_hello_ack", msg.sender)
            return
        self.note_incarnation(link, msg.incarnation)
        link.agent = msg.agent
        link.ready.set()

    def note_incarnation(self, link: Link, incarnation: int) -> bool:
        """True if ``incarnation`` is the link's; a different one means the peer restarted:
        pulls aimed at the old one end now (that process can no longer write)."""
        if link.incarnation == incarnation:
            return True
        if incarnation in link.gone:
            return False  # stale: never switch back to a process known to be gone
        if link.incarnation:
            link.gone = [*link.gone[-15:], link.incarnation]
            self.log.info("peer_restarted", endpoint=link.endpoint, pulls=len(link.pulls))
            for pull in list(link.pulls.values()):
                pull.finish(PullEvent.RESTARTED, [], "the source restarted")
            # Set up again. An event not set yet is kept: pulls may be waiting on it, and
            # the greeting under way will set it (a fresh one would strand them).
            if link.ready.is_set():
                link.ready = trio.Event()
            link.agent = None
        link.incarnation = incarnation
        return False

    async def ready(self, op: Operation, endpoint: str) -> Link:
        """The link to ``endpoint`` once the incarnation there acknowledged our greeting.

        Setting a link up (the greeting; at the source, loading our metadata and opening the
        NIXL connection) is one-time work with a budget of its own, ``operation_timeout_ms``:
        the operation's clock starts again when the link is ready, so that its deadline
        covers the transfer, not a first contact with a peer that just started."""
        link = self.link(endpoint)
        if link.ready.is_set():
            return link
        budget_s = self.config.operation_timeout_ms / 1000
        setup_started = trio.current_time()
        op.restart_clock(setup_started + budget_s, self.config)  # setup, then the transfer
        with trio.move_on_after(budget_s):
            # Answers read in one batch can switch the link to another incarnation after
            # our greeting was acknowledged: the pull must go to the one that knows us.
            while not link.ready.is_set():
                await link.ready.wait()
                link = self.link(endpoint)
        if not link.ready.is_set():
            raise TransportError(
                f"{op.kind} op {op.handle}: {endpoint} did not answer our greeting within "
                f"{self.config.operation_timeout_ms} ms"
            )
        op.restart_clock(trio.current_time(), self.config)
        self.log.debug("peer_ready", endpoint=endpoint, setup_s=trio.current_time() - setup_started)
        return link
