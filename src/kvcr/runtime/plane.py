"""The peer control plane, shared by both sides of a pull (``destination.py`` and
``source.py``): who this instance is to its peers (endpoint, incarnation), sending,
authenticating and routing control messages, counting bad input, and the two loops that
feed both sides: control messages in, and NIXL progress with its notifications.

The plane knows neither side: the runtime hands :meth:`Plane.run` the handler of each
message type and what the progress loop asks of the sides (:class:`Sides`).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
import trio

from kvcr.runtime.timer import poll_interval, sleeper
from kvcr.telemetry import Telemetry
from kvcr.transport import messages as m
from kvcr.transport.auth import UNAUTHENTICATED, PeerAuth, Rejected
from kvcr.transport.base import Transport

RECEIVE_POLL_S = 0.002  # only for control channels without a file descriptor
IDLE_PROGRESS_S = 0.1


@attrs.frozen
class Sides:
    """What the plane's loops need of the two sides of a pull."""

    handlers: dict[type[m.Message], Callable[[Any], None]]  # each takes its own type
    # A NIXL notification, by sender agent, with the earliest (trio) time it can have
    # reached this host unseen (0.0 when untimed): the ``notification`` timer's start.
    on_written: Callable[[str, m.Written, float], None]
    busy: Callable[[], bool]  # pulls in flight or a source write running: poll NIXL often
    connected: Callable[[], bool]  # peers known: NIXL needs progress now and then
    due: Callable[[], float]  # when the latest pull's data should have landed (trio time)


class Plane:
    def __init__(
        self,
        channel: Any,
        transport: Transport,
        cluster_key: bytes | None,
        log: Any,
        telemetry: Telemetry | None = None,
    ) -> None:
        """``telemetry``: times each control message's handling (``control_<type>``)."""
        self.channel = channel
        self.telemetry = telemetry
        self.endpoint: str | None = getattr(channel, "endpoint", None)
        self.transport = transport
        self.fine = bool(getattr(transport, "fine_timing", False))
        self.log = log
        self.incarnation = int.from_bytes(os.urandom(8), "big") or 1
        self.auth = PeerAuth(cluster_key, self.incarnation)
        self.dropped: Counter[str] = Counter()  # by kind: bad input seen from peers
        self.nursery: trio.Nursery | None = None  # where handlers start tasks (run)
        self.busy = trio.Event()  # set to make the progress loop poll NIXL now
        self.sides: Sides | None = None  # what the loops feed, once they run
        # When the progress loop last asked NIXL for notifications (trio time; timed only):
        # a word that came since waited at most from then (nothing else reads them).
        self._polled = 0.0

    def wake(self) -> None:
        self.busy.set()

    def spawn(self, fn: Any, *args: Any) -> None:
        assert self.nursery is not None, "the control plane runs (Plane.run)"
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

    # -- the loops -------------------------------------------------------------------------

    async def run(self, sides: Sides, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.sides = sides
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            nursery.start_soon(self._receive_loop, sides)
            nursery.start_soon(self._progress_loop, sides)
            task_status.started()

    async def _receive_loop(self, sides: Sides) -> None:
        fileno = getattr(self.channel, "fileno", None)
        fd = fileno() if callable(fileno) else None
        while True:
            try:
                batch = self.channel.recv()
            except Exception as exc:
                self.log.error("control_recv_failed", error=repr(exc))
                batch = []
            # A batch's messages waited in its queue together: each one's time runs from the
            # batch's arrival here to the end of its handling, queueing behind the others
            # included (per type: a bounded label).
            arrived = time.perf_counter() if self._timed() else 0.0
            for raw in batch:
                self._on_raw(raw, sides, arrived)
            if batch:
                continue  # ZMQ's fd is edge-triggered: drain before waiting again
            if fd is not None:
                await trio.lowlevel.wait_readable(fd)
            else:
                await trio.sleep(RECEIVE_POLL_S)

    def _timed(self) -> bool:
        return self.telemetry is not None and self.telemetry.enabled

    def _on_raw(self, raw: bytes, sides: Sides, arrived: float = 0.0) -> None:
        message = self.open(raw, "bad_message")
        if message is None:
            return
        handler = sides.handlers.get(type(message))
        if handler is None:
            self.drop("unexpected_message", message.TYPE)
            return
        result = "success"
        try:
            handler(message)
        except Exception as exc:  # a bug in one handler must not take the instance down
            result = "failed"
            self.log.exception("peer_handler_failed", type=message.TYPE, error=repr(exc))
        if arrived and self.telemetry is not None:
            seconds = time.perf_counter() - arrived
            self.telemetry.record(f"control_{message.TYPE}", seconds, result)

    async def _progress_loop(self, sides: Sides) -> None:
        """NIXL runs without its progress thread: call into it often while transfers or
        pulls are pending (every 0.2 ms for the first 10 ms, then every millisecond), and
        every 100 ms while peers are merely connected (connection setup needs both sides to
        make progress), and not at all with no peers."""
        timer = sleeper(self.fine)
        try:
            busy_since: float | None = None
            while True:
                if not sides.busy():
                    busy_since = None
                    busy_event = self.busy = trio.Event()
                    if sides.connected():
                        with trio.move_on_after(IDLE_PROGRESS_S):
                            await busy_event.wait()
                    else:
                        await busy_event.wait()
                else:
                    now = trio.current_time()
                    busy_since = now if busy_since is None else busy_since
                    await timer.sleep(poll_interval(now, busy_since, sides.due()))
                self._poll_notifications(sides)
        finally:
            timer.close()

    def _poll_notifications(self, sides: Sides) -> None:
        timed, since = self._timed(), 0.0
        if timed:
            since, self._polled = self._polled, trio.current_time()
        try:
            notes = self.transport.notifications()
        except Exception as exc:
            self.log.error("nixl_notifications_failed", error=repr(exc))
            return
        arrived = time.perf_counter() if notes and timed else 0.0
        for sender, raw in notes:
            message = self.open(raw, "bad_notification")
            if message is None:
                continue
            if isinstance(message, m.Written):
                sides.on_written(sender, message, since)
                if arrived and self.telemetry is not None:
                    seconds = time.perf_counter() - arrived
                    self.telemetry.record("control_written", seconds, "success")
            else:
                self.drop("unexpected_notification", message.TYPE)
