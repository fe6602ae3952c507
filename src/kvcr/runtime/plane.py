"""The peer control plane's plumbing, shared by both sides of a pull (``peers.py``, the
destination, and ``source.py``): who this instance is to its peers (endpoint, incarnation,
agent), sending and authenticating control messages, counting bad input, and waking the
progress loop."""

from __future__ import annotations

import os
from collections import Counter
from typing import TYPE_CHECKING, Any

import trio

from kvcr.transport import messages as m
from kvcr.transport.auth import UNAUTHENTICATED, PeerAuth, Rejected
from kvcr.transport.base import Transport

if TYPE_CHECKING:
    from kvcr.runtime.build import Context


class Plane:
    def __init__(self, context: Context, transport: Transport) -> None:
        self.channel: Any = context.control
        self.endpoint: str | None = getattr(self.channel, "endpoint", None)
        self.transport = transport
        self.log = context.log
        self.incarnation = int.from_bytes(os.urandom(8), "big") or 1
        self.auth = PeerAuth(context.cluster_key, self.incarnation)
        self.dropped: Counter[str] = Counter()  # by kind: bad input seen from peers
        self.nursery: trio.Nursery | None = None  # where handlers start tasks (Peers.run)
        self.busy = trio.Event()  # set to make the progress loop poll NIXL now

    def wake(self) -> None:
        self.busy.set()

    def spawn(self, fn: Any, *args: Any) -> None:
        assert self.nursery is not None, "the control plane runs (Peers.run)"
        self.nursery.start_soon(fn, *args)

    def counts(self) -> dict[str, float]:
        """Gauges of the contract's kvcr_state, not metrics of their own: an engine's
        metrics object may know only the contract's four names."""
        return {
            "peer_messages_dropped": sum(self.dropped.values()),
            "peer_messages_unauthenticated": sum(self.dropped[k] for k in UNAUTHENTICATED),
        }

    def my_endpoint(self) -> str:
        return self.endpoint or "unknown"

    def send(self, endpoint: str, message: m.Message) -> None:
        try:
            queued = self.channel.send(endpoint, self.auth.seal(m.encode(message)))
        except Exception as exc:
            queued = False
            self.log.warning("control_send_failed", to=endpoint, error=repr(exc))
        if not queued:
            self.log.info("control_not_queued", to=endpoint, type=message.TYPE)

    def drop(self, kind: str, detail: str) -> None:
        """Bad input from a peer: counted, one log event per kind, never a crash."""
        self.dropped[kind] += 1
        if self.dropped[kind] == 1:
            self.log.warning("peer_message_dropped", kind=kind, detail=detail[:400])

    def open(self, raw: bytes, malformed: str) -> m.Message | None:
        """Authenticate (with a cluster key) and parse one message, or drop it."""
        try:
            sealed_by, body = self.auth.open(raw)
        except Rejected as exc:
            self.drop(exc.reason, str(exc))
            return None
        try:
            message = m.decode(body)
        except m.MessageError as exc:
            self.drop(malformed, str(exc))
            return None
        if sealed_by is not None and message.incarnation != sealed_by:
            self.drop("unauthenticated", f"{message.TYPE}: sealed by another incarnation")
            return None
        return message
