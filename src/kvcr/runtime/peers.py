"""The peer plane of one runtime, assembled: the control plane (``plane.py``), the
destination's links (``links.py``) and pulls (``destination.py``), and the source
(``source.py``), wired to each other through the plane's message table (:meth:`Peers.sides`).
"""

from __future__ import annotations

from typing import Any

import attrs

from kvcr.runtime.bounce import BounceSlots
from kvcr.runtime.context import Context
from kvcr.runtime.destination import Destination
from kvcr.runtime.g3 import G3Tier
from kvcr.runtime.links import Links
from kvcr.runtime.local import LocalG2
from kvcr.runtime.ops import Outbox
from kvcr.runtime.pins import Pins
from kvcr.runtime.plane import Plane, Sides
from kvcr.runtime.source import Source
from kvcr.runtime.transfers import Transfers
from kvcr.store.index import BlockIndex
from kvcr.telemetry import Telemetry
from kvcr.transport import messages as m
from kvcr.transport.base import Transport


@attrs.frozen(eq=False)
class Peers:
    plane: Plane
    links: Links
    source: Source
    destination: Destination

    @classmethod
    def assemble(
        cls,
        context: Context,
        *,
        transport: Transport,
        transfers: Transfers[Transport],
        index: BlockIndex,
        local: LocalG2 | None,
        g3: G3Tier | None,
        pins: Pins,
        outbox: Outbox,
        telemetry: Telemetry,
    ) -> Peers:
        """The parts, each given what its constructor names. Binds the control channel if
        the adapter did not."""
        initialize = getattr(context.control, "initialize", None)
        if callable(initialize):
            initialize()  # idempotent on ZmqPeerControlChannel
        config, memory, log = context.config, context.memory, context.log
        plane = Plane(context.control, transport, context.cluster_key, log, telemetry)
        links = Links(
            plane=plane,
            config=config,
            retry_interval_s=context.remote.metadata_retry_interval_ms / 1000,
            telemetry=telemetry,
            log=log,
        )
        bounce = memory.bounce_slots
        source = Source(
            plane=plane,
            transfers=transfers,
            index=index,
            local=local,
            g3=g3 if bounce else None,
            bounce=BounceSlots(memory.bounce_base, bounce) if g3 is not None and bounce else None,
            pins=pins,
            memory=memory,
            config=config,
            outbox=outbox,
            telemetry=telemetry,
            op_ids=context.op_ids,
            log=log,
        )
        destination = Destination(
            plane=plane,
            links=links,
            index=index,
            local=local,
            memory=memory,
            outbox=outbox,
            telemetry=telemetry,
            log=log,
        )
        return cls(plane, links, source, destination)

    def sides(self) -> Sides:
        """What the plane's loops feed: each message type to the side it is for."""
        links, source, destination = self.links, self.source, self.destination
        return Sides(
            handlers={
                m.Hello: source.on_hello,
                m.HelloAck: links.on_hello_ack,
                m.Pull: source.on_pull,
                m.Over: destination.on_over,
                m.Probe: source.on_probe,
                m.ProbeAck: destination.on_probe_ack,
                m.Confirm: source.on_confirm,
            },
            on_written=destination.on_written,
            busy=lambda: links.busy() or source.writing,
            connected=lambda: bool(links.links or source.agents_by_incarnation),
            due=links.latest_due,
        )

    def gauges(self) -> dict[str, Any]:
        """Read from engine threads (get_stats): only atomic reads of runtime state."""
        source = self.source
        return {
            "peer_links": self.links.ready_count(),
            "pulls_in_flight": self.links.pulls_in_flight(),
            "source_jobs": len(source.jobs),
            "source_stalled": int(source.stalled),
            "source_written_blocks": source.written_blocks,
            "source_g3_blocks": source.g3_blocks,
            **self.plane.counts(),
        }
