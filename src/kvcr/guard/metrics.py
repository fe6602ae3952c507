"""Prometheus metrics of the guard service (``kvcr-guard --metrics-port``).

The service counts what happens (``Tally``: plain ints, written by its trio tasks) and the
metrics endpoint turns the counts and the groups' status into the Prometheus text format at
each scrape, with ``prometheus_client``'s exposition code over a registry of its own. The
endpoint is a small HTTP/1.1 responder running as a trio task of the service, so a scrape
reads the service's state on the service's own thread (no locks, no torn reads), and it is
supervised apart: if it cannot bind, or fails later, the service logs why and keeps lending
pools (workers depend on the service; dashboards do not).

Labels are bounded: a group's index (at most ``MAX_GROUPS``), its state (seven values), a
refusal's code (the fixed set of ``Refusal`` codes), an ignored heartbeat's kind (four).
Never pids, paths or endpoints.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from kvcr.guard.protocol import GroupStatus
from kvcr.guard.rules import GroupState

MAX_REQUEST_BYTES = 8192  # a scrape's request line and headers
REQUEST_TIMEOUT_S = 5.0
MAX_SCRAPES = 16  # connections served at once; more wait in the backlog


@attrs.define
class GroupTally:
    """What happened to one group since the service started."""

    takeovers: int = 0
    handbacks: int = 0
    claims_granted: int = 0
    served_blocks: int = 0  # written to peers by the servers of this group that ended
    fenced: int = 0  # holders killed for missing their heartbeat deadline
    reattached: int = 0  # workers of a dead service that re-attached the group
    served_g3_blocks: int = 0  # ... of those, read from the group's G3 files


@attrs.define
class Tally:
    """The service's counters (the service's thread writes, scrapes read)."""

    groups: list[GroupTally]
    refusals: collections.Counter[str] = attrs.field(factory=collections.Counter)
    # Heartbeats turned away, by kind: heartbeat.Verdict's, "no_claim", "wrong_lease".
    heartbeats_refused: collections.Counter[str] = attrs.field(factory=collections.Counter)
    started: float = attrs.field(factory=time.time)

    @classmethod
    def of(cls, group_count: int) -> Tally:
        return cls([GroupTally() for _ in range(group_count)])


@attrs.frozen
class GroupReading:
    """One group at a scrape: its status, and blocks its current server wrote so far."""

    status: GroupStatus
    serving_blocks: int = 0
    serving_g3_blocks: int = 0


class ServiceCollector(Collector):
    """The guard's metric families, built at each scrape from ``read()``."""

    def __init__(self, tally: Tally, read: Callable[[], Sequence[GroupReading]]) -> None:
        self._tally = tally
        self._read = read

    def collect(self) -> Iterator[Metric]:
        tally, readings = self._tally, self._read()
        yield GaugeMetricFamily("kvcr_guard_up", "1 while the guard service runs.", value=1)
        yield GaugeMetricFamily(
            "kvcr_guard_start_time_seconds",
            "When the guard service started (Unix time).",
            value=tally.started,
        )
        group = ["group"]
        state = GaugeMetricFamily(
            "kvcr_guard_group_state", "1 for the state the group is in.", labels=["group", "state"]
        )
        holder = GaugeMetricFamily(
            "kvcr_guard_group_holder_present", "1 while a worker holds the group.", labels=group
        )
        blocks = GaugeMetricFamily(
            "kvcr_guard_group_journal_blocks",
            "Committed blocks the group's recovery journal holds (as last read).",
            labels=group,
        )
        fill = GaugeMetricFamily(
            "kvcr_guard_group_journal_fill_ratio",
            "How full the group's recovery journal region is, 0..1 (as last read).",
            labels=group,
        )
        disabled = GaugeMetricFamily(
            "kvcr_guard_group_recovery_disabled",
            "1 when the group's journal stopped recording (its holder cannot start warm).",
            labels=group,
        )
        takeovers = CounterMetricFamily(
            "kvcr_guard_takeovers",
            "Times the service began serving a dead holder's blocks.",
            labels=group,
        )
        handbacks = CounterMetricFamily(
            "kvcr_guard_handbacks", "Times a served group was handed to a new holder.", labels=group
        )
        granted = CounterMetricFamily(
            "kvcr_guard_claims_granted", "Claims granted (leases).", labels=group
        )
        served = CounterMetricFamily(
            "kvcr_guard_served_blocks",
            "Blocks the service wrote to peers while serving the group.",
            labels=group,
        )
        fenced = CounterMetricFamily(
            "kvcr_guard_fenced",
            "Holders SIGKILLed for missing their heartbeat deadline, then taken over.",
            labels=group,
        )
        reattached = CounterMetricFamily(
            "kvcr_guard_reattached",
            "Workers of a service that died that re-attached the group to this one.",
            labels=group,
        )
        served_g3 = CounterMetricFamily(
            "kvcr_guard_served_g3_blocks",
            "Of the blocks served, those read from the group's G3 files.",
            labels=group,
        )
        for reading in readings:
            status = reading.status
            index = str(status.index)
            counts = tally.groups[status.index]
            for name in GroupState:  # the wire's order and strings: labels as before
                state.add_metric([index, name.value], 1.0 if status.state == name else 0.0)
            holder.add_metric([index], 1.0 if status.holder_pid is not None else 0.0)
            if status.journal_blocks is not None:
                blocks.add_metric([index], status.journal_blocks)
            if status.journal_fill_percent is not None:
                fill.add_metric([index], status.journal_fill_percent / 100)
            disabled.add_metric([index], 1.0 if status.recovery_disabled else 0.0)
            takeovers.add_metric([index], counts.takeovers)
            handbacks.add_metric([index], counts.handbacks)
            granted.add_metric([index], counts.claims_granted)
            served.add_metric([index], counts.served_blocks + reading.serving_blocks)
            fenced.add_metric([index], counts.fenced)
            reattached.add_metric([index], counts.reattached)
            served_g3.add_metric([index], counts.served_g3_blocks + reading.serving_g3_blocks)
        refused = CounterMetricFamily(
            "kvcr_guard_claims_refused", "Claims refused, by the refusal's code.", labels=["reason"]
        )
        for reason, count in sorted(tally.refusals.items()):
            refused.add_metric([reason], count)
        yield from (state, holder, blocks, fill, disabled, takeovers, handbacks, granted, served)
        yield from (served_g3, fenced, reattached, refused)
        beats = CounterMetricFamily(
            "kvcr_guard_heartbeats_refused",
            "Heartbeats ignored or refused, by kind (duplicate, early, no_claim, wrong_lease).",
            labels=["reason"],
        )
        for reason, count in sorted(tally.heartbeats_refused.items()):
            beats.add_metric([reason], count)
        yield beats


def registry_of(collector: Collector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


class MetricsEndpoint:
    """``GET /metrics`` (or ``/``) over HTTP/1.1, one response per connection."""

    def __init__(self, registry: CollectorRegistry, log: Any) -> None:
        self.registry = registry
        self.log = log
        self._limit = trio.Semaphore(MAX_SCRAPES)

    async def bind(self, host: str, port: int) -> trio.SocketListener:
        """Listen on ``host:port`` (port 0: any free one); OSError if that is not possible."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        return listeners[0]

    async def serve(self, listener: trio.SocketListener) -> None:
        async with listener, trio.open_nursery() as nursery:
            while True:
                stream = await listener.accept()
                await self._limit.acquire()
                nursery.start_soon(self._answer, stream)

    async def _answer(self, stream: trio.SocketStream) -> None:
        try:
            async with stream:
                with trio.move_on_after(REQUEST_TIMEOUT_S):
                    head = await _read_head(stream)
                    if head is not None:
                        await stream.send_all(self._response(head))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.log.debug("metrics_connection_lost", error=str(exc))
        finally:
            self._limit.release()

    def _response(self, head: bytes) -> bytes:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return _http(400, "text/plain", b"kvcr-guard metrics: a malformed request line\n")
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return _http(405, "text/plain", b"kvcr-guard metrics: only GET is served\n")
        if target not in (b"/metrics", b"/"):
            return _http(404, "text/plain", b"kvcr-guard metrics: try /metrics\n")
        body = generate_latest(self.registry)
        return _http(200, CONTENT_TYPE_LATEST, b"" if method == b"HEAD" else body, len(body))


async def _read_head(stream: trio.SocketStream) -> bytes | None:
    """The request up to its blank line (None: the client went away or sent too much)."""
    head = b""
    while b"\r\n\r\n" not in head and b"\n\n" not in head:
        if len(head) > MAX_REQUEST_BYTES:
            return None
        chunk = await stream.receive_some(4096)
        if not chunk:
            return head or None  # a client that shut its side after the request line
        head += chunk
    return head


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


def _http(status: int, content_type: str, body: bytes, length: int | None = None) -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body) if length is None else length}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body
