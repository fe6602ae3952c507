"""Peer-to-peer reuse: both sides of a destination-initiated pull.

Destination (the worker that wants blocks): says Hello to the source endpoint named by the
request's router hint (NIXL metadata, retried every ``metadata_retry_interval_ms`` until
acknowledged), then sends one Pull naming the keys and where to write them, and waits for
the source's NIXL notification ``Written`` (or an ``Over`` control message when the source
writes nothing). Source: claims the keys it holds in local G2, asks the engine to pin the
others, and writes the whole batch in one NIXL WRITE whose notification names what was
written. Claims and pins are released only when that write is terminal.

Memory the source may write stays held until the source confirms that it is done with the
pull: ``Written``, ``Over``, or a ``ProbeAck`` saying ``over``, or the source is known gone
(a new incarnation answered at its endpoint). When an operation gives up earlier (its
deadline, abort, close), its entries fail at once, the engine is told the memory is
``uncertain`` (before the FAILED entries), the source is probed with ``cancel``, probed again
at ``abandon_timeout_ms``, and ``quiesced`` follows the confirmation.

The pull states, destination side (any other move is a bug)::

    sent ──Written──▶ done
      │ ──Over─────▶ done
      │ ──deadline─▶ abandoned ──Written / Over / ProbeAck(over) / peer gone──▶ done
      └──peer gone─▶ done
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import attrs
import trio

from kvcr.runtime.lifecycle import PULL
from kvcr.runtime.ops import Operation
from kvcr.runtime.part import Part
from kvcr.runtime.pins import Pins
from kvcr.runtime.plane import Plane
from kvcr.runtime.source import Source
from kvcr.runtime.timer import FAST_WINDOW_S, poll_interval, sleeper
from kvcr.transport import messages as m
from kvcr.transport.base import TransportError
from kvcr.types import BlockKey

if TYPE_CHECKING:
    from kvcr.runtime.build import Context, Shared

RECEIVE_POLL_S = 0.002  # only for control channels without a file descriptor
# A pull's data is due about when the source could have copied it at this rate; the
# destination polls fast until then (plus the window), slowly after.
EXPECTED_BYTES_PER_S = 5e9
IDLE_PROGRESS_S = 0.1


@attrs.define(eq=False)
class Link:
    """What this instance knows of one remote endpoint it pulls from."""

    endpoint: str
    incarnation: int = 0  # the remote's, once it acknowledged our metadata
    agent: str | None = None
    ready: trio.Event = attrs.field(factory=trio.Event)
    greeting: bool = False
    pulls: dict[int, RemotePull] = attrs.field(factory=dict)
    # Incarnations that a newer one replaced at this endpoint: those processes are gone, so
    # a late message of theirs (sent before they died, read after the successor's) is stale.
    gone: list[int] = attrs.field(factory=list)


@attrs.define(eq=False)
class RemotePull:
    req: int
    link: Link
    target: int
    keys: list[BlockKey]
    state: str = "sent"  # see lifecycle.PULL; moved only by move()
    # Set when the source can no longer write (done, or turned away): the answer is in.
    done: trio.Event = attrs.field(factory=trio.Event)
    written: list[int] = attrs.field(factory=list)
    reason: str = ""
    on_over: list[Callable[[], None]] = attrs.field(factory=list)
    due: float = 0.0  # when its data should have landed (trio time)

    def move(self, event: str) -> str:
        self.state = PULL.move(self.state, event, f"req {self.req} to {self.link.endpoint}")
        return self.state

    @property
    def turned_away(self) -> bool:
        """Refused unread (a new incarnation answered at the endpoint, or the source had no
        greeting from us): nothing was written, so asking again, after a new greeting, is
        safe."""
        return self.state == "turned_away"


class Peers(Part):
    """The destination side, and the loops that feed both sides: control messages in,
    NIXL progress and notifications."""

    def __init__(
        self,
        context: Context,
        shared: Shared,
        plane: Plane,
        source: Source,
        pins: Pins,
    ) -> None:
        super().__init__(context, shared)
        self.plane = plane
        transport = plane.transport
        self.retry_interval_s = context.remote.metadata_retry_interval_ms / 1000
        self.fine = bool(getattr(transport, "fine_timing", False))
        self.transport = transport
        self.pins = pins
        self.links: dict[str, Link] = {}
        self.source = source
        self._reqs = itertools.count(1)

    @property
    def incarnation(self) -> int:
        return self.plane.incarnation

    @property
    def dropped(self) -> Counter[str]:
        return self.plane.dropped

    # -- plumbing --------------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self.plane.nursery = nursery
            nursery.start_soon(self._receive_loop)
            nursery.start_soon(self._progress_loop)
            task_status.started()

    def pulls_in_flight(self) -> int:
        # list() copies in one step: get_stats calls this from an engine thread.
        return sum(len(link.pulls) for link in list(self.links.values()))

    def gauges(self) -> dict[str, float]:
        """Read from engine threads (get_stats): only atomic reads of runtime state."""
        source = self.source
        return {
            "peer_links": sum(1 for link in list(self.links.values()) if link.ready.is_set()),
            "pulls_in_flight": self.pulls_in_flight(),
            "source_jobs": len(source.jobs),
            "source_stalled": int(source.stalled),
            "source_written_blocks": source.written_blocks,
            **self.plane.counts(),
        }

    async def _receive_loop(self) -> None:
        channel = self.plane.channel
        fileno = getattr(channel, "fileno", None)
        fd = fileno() if callable(fileno) else None
        while True:
            try:
                batch = channel.recv()
            except Exception as exc:
                self.log.error("control_recv_failed", error=repr(exc))
                batch = []
            for raw in batch:
                self._on_raw(raw)
            if batch:
                continue  # ZMQ's fd is edge-triggered: drain before waiting again
            if fd is not None:
                await trio.lowlevel.wait_readable(fd)
            else:
                await trio.sleep(RECEIVE_POLL_S)

    async def _progress_loop(self) -> None:
        """NIXL runs without its progress thread: call into it often while transfers or
        pulls are pending (every 0.2 ms for the first 10 ms, then every millisecond), and
        every 100 ms while peers are merely connected (connection setup needs both sides to
        make progress), and not at all with no peers."""
        timer = sleeper(self.fine)
        try:
            busy_since: float | None = None
            while True:
                busy = any(link.pulls for link in self.links.values()) or self.source.writing
                if not busy:
                    busy_since = None
                    connected = self.links or self.source.agents_by_incarnation
                    busy_event = self.plane.busy = trio.Event()
                    if connected:
                        with trio.move_on_after(IDLE_PROGRESS_S):
                            await busy_event.wait()
                    else:
                        await busy_event.wait()
                else:
                    now = trio.current_time()
                    busy_since = now if busy_since is None else busy_since
                    due = max(
                        (p.due for link in self.links.values() for p in link.pulls.values()),
                        default=0.0,
                    )
                    await timer.sleep(poll_interval(now, busy_since, due))
                self._poll_notifications()
        finally:
            timer.close()

    def _poll_notifications(self) -> None:
        try:
            notes = self.transport.notifications()
        except Exception as exc:
            self.log.error("nixl_notifications_failed", error=repr(exc))
            return
        for sender, raw in notes:
            message = self.plane.open(raw, "bad_notification")
            if message is None:
                continue
            if isinstance(message, m.Written):
                self._on_written(sender, message)
            else:
                self.plane.drop("unexpected_notification", message.TYPE)

    def _on_raw(self, raw: bytes) -> None:
        message = self.plane.open(raw, "bad_message")
        if message is None:
            return
        # Each handler takes the message type it is keyed by.
        handlers: dict[type, Callable[[Any], None]] = {
            m.Hello: self.source.on_hello,
            m.HelloAck: self._on_hello_ack,
            m.Pull: self.source.on_pull,
            m.Over: self._on_over,
            m.Probe: self.source.on_probe,
            m.ProbeAck: self._on_probe_ack,
            m.Confirm: self.source.on_confirm,
        }
        handler = handlers.get(type(message))
        if handler is None:
            self.plane.drop("unexpected_message", message.TYPE)
            return
        try:
            handler(message)
        except Exception as exc:  # a bug in one handler must not take the instance down
            self.log.exception("peer_handler_failed", type=message.TYPE, error=repr(exc))

    # -- destination: links ------------------------------------------------------------------

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
        hello = m.Hello(
            self.plane.my_endpoint(),
            self.plane.incarnation,
            self.transport.agent_name,
            self.transport.metadata(),
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

    def _on_hello_ack(self, msg: m.HelloAck) -> None:
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
        self._note_incarnation(link, msg.incarnation)
        link.agent = msg.agent
        link.ready.set()

    def _note_incarnation(self, link: Link, incarnation: int) -> bool:
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
                self._finish_pull(pull, "restarted", [], "the source restarted")
            # Set up again. An event not set yet is kept: pulls may be waiting on it, and
            # the greeting under way will set it (a fresh one would strand them).
            if link.ready.is_set():
                link.ready = trio.Event()
            link.agent = None
        link.incarnation = incarnation
        return False

    # -- destination: pulls ------------------------------------------------------------------

    async def pull(
        self,
        op: Operation,
        endpoint: str,
        keys: list[BlockKey],
        dst: list[tuple[int, int]],
        move: bool = False,
    ) -> RemotePull:
        """Send one pull once the link is ready; the caller waits on ``answered``. The pull
        is registered in ``op.xfers`` until the source can no longer write."""
        if self.plane.endpoint is None:
            raise TransportError(
                f"{op.kind} op {op.handle}: the control channel has no endpoint to be answered at"
            )
        link = await self._ready(op, endpoint)
        pull = RemotePull(next(self._reqs), link, link.incarnation, keys)
        nbytes = sum(n for _, n in dst)
        pull.due = trio.current_time() + nbytes / EXPECTED_BYTES_PER_S + FAST_WINDOW_S
        link.pulls[pull.req] = pull
        op.xfers[pull] = frozenset(keys)
        pull.on_over.append(lambda: self.outbox.xfer_terminal(op, pull))
        self.plane.send(
            endpoint,
            m.Pull(
                self.plane.endpoint,
                self.plane.incarnation,
                link.incarnation,
                pull.req,
                cast("list[bytes]", keys),  # keys are bytes on the wire; Pull only reads them
                len(self.memory.block_sizes),
                m.Pull.pack(dst),
                move,
            ),
        )
        self.plane.wake()
        return pull

    def confirm(self, endpoint: str, req: int, indices: list[int]) -> None:
        """Tell the source of a ``move`` pull which of its keys this side has for good."""
        if self.plane.endpoint is None:
            return
        message = m.Confirm(self.plane.endpoint, self.plane.incarnation, req, indices)
        self.plane.send(endpoint, message)
        self.plane.wake()

    async def _ready(self, op: Operation, endpoint: str) -> Link:
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

    def abandon(self, pull: RemotePull) -> None:
        """The operation gave up on ``pull`` while the source may still write: probe it
        (cancelling the pull if it has not started writing). Its memory stays held."""
        if pull.state != "sent":
            return
        pull.move("give_up")
        self._probe(pull)

    def quarantine(self, op: Operation, pull: RemotePull) -> None:
        """``abandon_timeout_ms`` passed with no word from the source: say so, ask again."""
        pull.move("abandon_deadline")
        self.log.warning(
            "pull_abandoned",
            op=op.handle,
            endpoint=pull.link.endpoint,
            reason="no confirmation from the source by abandon_timeout_ms; memory stays held",
        )
        self._probe(pull)

    def _probe(self, pull: RemotePull) -> None:
        """Ask the source whether it is over with ``pull``, cancelling it if not started."""
        plane = self.plane
        assert plane.endpoint is not None  # pull() sent nothing without one
        plane.send(pull.link.endpoint, m.Probe(plane.endpoint, plane.incarnation, pull.req, True))

    def _find_pull(self, endpoint: str, incarnation: int, req: int) -> RemotePull | None:
        """The pull ``req`` at ``endpoint``. Only an answer about one of our pulls in flight
        may reveal a restarted source; anything else is not evidence of a restart."""
        link = self.links.get(endpoint)
        if link is None or req not in link.pulls:
            return None
        if not self._note_incarnation(link, incarnation):
            return link.pulls.get(req) if link.incarnation == incarnation else None
        return link.pulls.get(req)

    def _on_written(self, sender: str, msg: m.Written) -> None:
        pull = None
        for link in self.links.values():
            if link.agent == sender and link.incarnation == msg.incarnation:
                pull = link.pulls.get(msg.req)
                break
        if pull is None:
            self.plane.drop("unknown_written", f"{sender} req {msg.req}")
            return
        if any(i >= len(pull.keys) for i in msg.indices):
            self.plane.drop("bad_written", f"{sender} req {msg.req}: index out of range")
            pull.reason = "the source named keys it was not asked for"
            msg = m.Written(msg.incarnation, msg.req, [])
        self._finish_pull(pull, "written", sorted(set(msg.indices)), pull.reason or "")

    def _on_over(self, msg: m.Over) -> None:
        link = self.links.get(msg.sender)
        if (
            link is not None
            and link.incarnation
            and link.incarnation != msg.incarnation
            and msg.req in link.pulls  # a restarted source turning one of our pulls away
        ):
            self._note_incarnation(link, msg.incarnation)
            return
        pull = self._find_pull(msg.sender, msg.incarnation, msg.req)
        if pull is None:
            self.plane.drop("unknown_over", f"{msg.sender} req {msg.req}")
            return
        event = "over"
        if msg.reason in (m.NOT_GREETED, m.OTHER_INCARNATION):
            # The process at the endpoint never took our greeting (or not this pull): greet it
            # again before anything else is sent there.
            event = "refused_unread"
            if pull.link.ready.is_set():
                pull.link.ready = trio.Event()
        self._drain()
        self._finish_pull(pull, event, [], msg.reason)

    def _drain(self) -> None:
        """Apply what already reached this host of a write whose source has given up on it,
        before its memory is handed back: over TCP the data comes before the source's word
        (same path, in order) but may still wait in a socket for NIXL's next call."""
        try:
            self.transport.progress()
        except TransportError as exc:
            self.log.warning("transport_progress_failed", error=str(exc))

    def _on_probe_ack(self, msg: m.ProbeAck) -> None:
        pull = self._find_pull(msg.sender, msg.incarnation, msg.req)
        if pull is None:
            return  # the pull ended meanwhile: a late answer is normal
        if msg.state == "over":
            self._drain()
            self._finish_pull(pull, "probe_over", [], pull.reason or "the source dropped the pull")

    def _finish_pull(self, pull: RemotePull, event: str, written: list[int], reason: str) -> None:
        """The source can no longer write the pull's memory: end it (see lifecycle.PULL)."""
        pull.move(event)
        pull.written = written
        pull.reason = reason
        pull.link.pulls.pop(pull.req, None)
        pull.done.set()
        for callback in pull.on_over:
            callback()
