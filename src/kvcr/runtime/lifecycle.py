"""The lifecycles of a peer transfer, both sides, and of an operation's engine memory, as
tables over enum states, with the destination's records they move (pure: no I/O, no clocks).

Theory of operation. A destination that wants blocks sends one ``Pull``; the source writes
what it has in one NIXL WRITE and its notification (``Written``) names what was written, or
it answers ``Over`` when it writes nothing. Memory the source may write is held, at both
ends, until the source can no longer touch it. So each side has one record per pull whose
state says exactly that:

Destination, a :class:`RemotePull` on a :class:`Link` (:data:`PULL`)::

    sent ──written / over / probe_over──▶ done
     │  ──refused_unread / restarted────▶ turned_away     (nothing written: may be resent)
     └──give_up──▶ abandoned ──abandon_deadline──▶ quarantined
                       │                               │
                       └──── written / over / probe_over / refused_unread / restarted ──▶ done

``give_up`` is the operation's deadline, an abort or close: the caller is answered at once,
the source is probed with ``cancel``, and the memory stays held. ``abandon_deadline`` is
``abandon_timeout_ms``: the memory is still held, now reported, and probed again. Only
``done`` and ``turned_away`` free the memory, and only an answer from the source (or its
restart, seen as a new incarnation at its endpoint) gets there.

Source, a :class:`SourceJob` (:data:`JOB`)::

    pending ──post──▶ writing ──late──▶ stalled ──abandon_deadline──▶ uncertain
       │                 │                 │                              │
       └─end─▶ over ◀────┴──── end ────────┴──────────── end ─────────────┘

``pending`` claims the keys in local G2, reads the keys only G3 holds into bounce slots
(``staging.py``) and waits for engine pins (``end``: cancelled by a probe, nothing to
write, or the deadline of the pins and the G3 read, ``operation_timeout_ms`` from the
pull's arrival). A write is timed from its posting: ``late`` is ``operation_timeout_ms`` with the
write still running, and the source stops taking new pulls until it ends. At
``abandon_timeout_ms`` the write is cancelled if the transport can (a NIXL peer write never
is: over TCP it would resume later); if not, engine memory it reads is
reported ``uncertain`` and ``quiesced`` follows at ``end``. Claims and pins are released at
``end`` and nowhere else. On the wire (``ProbeAck.state``) a job is ``pending``, ``writing``
(any state of a running write) or ``over``.

An operation whose entries fail while one of its transfers may still touch the engine's
memory reports it (:data:`FRAMEWORK_MEMORY`)::

    clear ──may_touch──▶ uncertain ──transfers_over──▶ quiesced

``uncertain`` goes out before the FAILED entries it explains, ``quiesced`` once every
transfer of the operation is terminal (``ops.Outbox``).

Every move goes through :meth:`~kvcr.statetable.Table.move` (``statetable.py``, the one
table mechanism); anything the table does not allow is a bug and raises
:class:`~kvcr.statetable.IllegalMove`. Every deadline comes from one place,
:class:`~kvcr.runtime.deadlines.Deadlines`, measured from the operation's start (destination;
restarted once a first contact's link is ready), the pull's arrival (a source's pins) or
the write's posting (a source's write).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import attrs
import trio

from kvcr.runtime.deadlines import Deadlines
from kvcr.runtime.pins import Pin
from kvcr.runtime.transfers import Xfer
from kvcr.statetable import StrEnum, Table
from kvcr.store.index import Block
from kvcr.tracing import Phase
from kvcr.transport import messages as m
from kvcr.types import BlockKey


class PullState(StrEnum):
    SENT = "sent"
    ABANDONED = "abandoned"
    QUARANTINED = "quarantined"
    DONE = "done"
    TURNED_AWAY = "turned_away"


class PullEvent(StrEnum):
    WRITTEN = "written"
    OVER = "over"
    PROBE_OVER = "probe_over"
    REFUSED_UNREAD = "refused_unread"
    RESTARTED = "restarted"
    GIVE_UP = "give_up"
    ABANDON_DEADLINE = "abandon_deadline"


_ANSWERS = {
    PullEvent.WRITTEN: PullState.DONE,
    PullEvent.OVER: PullState.DONE,
    PullEvent.PROBE_OVER: PullState.DONE,
}
_GONE = {PullEvent.REFUSED_UNREAD: PullState.DONE, PullEvent.RESTARTED: PullState.DONE}
PULL: Table[PullState, PullEvent] = Table(
    "pull",
    {
        PullState.SENT: {
            **_ANSWERS,
            PullEvent.REFUSED_UNREAD: PullState.TURNED_AWAY,
            PullEvent.RESTARTED: PullState.TURNED_AWAY,
            PullEvent.GIVE_UP: PullState.ABANDONED,
        },
        PullState.ABANDONED: {
            **_ANSWERS,
            **_GONE,
            PullEvent.ABANDON_DEADLINE: PullState.QUARANTINED,
        },
        PullState.QUARANTINED: {**_ANSWERS, **_GONE},
        PullState.DONE: {},
        PullState.TURNED_AWAY: {},
    },
)
# The source can no longer write: the pull's memory is free again.
PULL_OVER = frozenset({PullState.DONE, PullState.TURNED_AWAY})


class JobState(StrEnum):
    PENDING = "pending"
    WRITING = "writing"
    STALLED = "stalled"
    UNCERTAIN = "uncertain"
    OVER = "over"


class JobEvent(StrEnum):
    POST = "post"
    LATE = "late"
    ABANDON_DEADLINE = "abandon_deadline"
    END = "end"


JOB: Table[JobState, JobEvent] = Table(
    "source job",
    {
        JobState.PENDING: {JobEvent.POST: JobState.WRITING, JobEvent.END: JobState.OVER},
        JobState.WRITING: {JobEvent.LATE: JobState.STALLED, JobEvent.END: JobState.OVER},
        JobState.STALLED: {
            JobEvent.ABANDON_DEADLINE: JobState.UNCERTAIN,
            JobEvent.END: JobState.OVER,
        },
        JobState.UNCERTAIN: {JobEvent.END: JobState.OVER},
        JobState.OVER: {},
    },
)
# A write is in flight.
WRITING = frozenset({JobState.WRITING, JobState.STALLED, JobState.UNCERTAIN})
# A write ran past its operation timeout: the source refuses new pulls until it ends.
LATE = frozenset({JobState.STALLED, JobState.UNCERTAIN})


def wire_state(job_state: JobState) -> JobState:
    """What a ``ProbeAck`` says of a job in ``job_state``."""
    return JobState.WRITING if job_state in WRITING else job_state


class MemoryState(StrEnum):
    CLEAR = "clear"  # nothing reported
    UNCERTAIN = "uncertain"  # a transfer may still touch the engine's memory
    QUIESCED = "quiesced"  # ... and now none does


class MemoryEvent(StrEnum):
    MAY_TOUCH = "may_touch"
    TRANSFERS_OVER = "transfers_over"


FRAMEWORK_MEMORY: Table[MemoryState, MemoryEvent] = Table(
    "operation",
    {
        MemoryState.CLEAR: {MemoryEvent.MAY_TOUCH: MemoryState.UNCERTAIN},
        MemoryState.UNCERTAIN: {MemoryEvent.TRANSFERS_OVER: MemoryState.QUIESCED},
        MemoryState.QUIESCED: {},
    },
)


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
    """One pull this destination sent, from its sending until the source can no longer
    write its memory (:data:`PULL`)."""

    req: int
    link: Link
    target: int
    keys: list[BlockKey]
    state: PullState = PullState.SENT  # moved only by move()
    # Set when the source can no longer write (done, or turned away): the answer is in.
    done: trio.Event = attrs.field(factory=trio.Event)
    written: list[int] = attrs.field(factory=list)
    reason: str = ""
    on_over: list[Callable[[], None]] = attrs.field(factory=list)
    due: float = 0.0  # when its data should have landed (trio time)
    sent_at: float = 0.0  # when it was sent (trio time), for the notification timer; 0: untimed
    notified: tuple[float, float] | None = None  # the notification phase (timed only)

    def move(self, event: PullEvent) -> PullState:
        self.state = PULL.move(self.state, event, f"req {self.req} to {self.link.endpoint}")
        return self.state

    @property
    def turned_away(self) -> bool:
        """Refused unread (a new incarnation answered at the endpoint, or the source had no
        greeting from us): nothing was written, so asking again, after a new greeting, is
        safe."""
        return self.state is PullState.TURNED_AWAY

    def finish(self, event: PullEvent, written: list[int], reason: str) -> None:
        """The source can no longer write the pull's memory: end it, hand the memory back
        (``on_over``) and wake whoever waits for the answer."""
        self.move(event)
        self.written = written
        self.reason = reason
        self.link.pulls.pop(self.req, None)
        self.done.set()
        for callback in self.on_over:
            callback()


@attrs.define(eq=False)
class SourceJob:
    msg: m.Pull
    agent: str
    clock: Deadlines  # from the pull's arrival: bounds the wait for pins
    state: JobState = JobState.PENDING  # see lifecycle.JOB; moved only by move()
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    claims: list[Block] = attrs.field(factory=list)
    pins: list[Pin] = attrs.field(factory=list)
    xfer: Xfer | None = None
    # From the write's posting: a write is an operation of its own, and pins that came late
    # must not make a healthy write look stalled.
    write_clock: Deadlines | None = None
    pinned_keys: list[BlockKey] = attrs.field(factory=list)  # written from engine memory
    # Bounce slots lent to the job for its G3 keys (``staging.py``); ``reading`` while the
    # G3 read into them runs; ``staged``: key index -> bounce descriptor of what arrived.
    bounce: list[int] = attrs.field(factory=list)
    reading: bool = False
    staged: dict[int, int] = attrs.field(factory=dict)
    # The pull's block funnel at this source (``telemetry.FUNNEL``): keys found in G2 or G3
    # at its arrival, then held for the write (claimed, staged or pinned).
    found: int = 0
    held: int = 0
    written: int = 0  # keys the write delivered
    phases: list[Phase] | None = None  # child spans of its span (tracing on only)

    @property
    def keys(self) -> list[BlockKey]:
        """The pull's keys: raw bytes on the wire, the block keys they name from here on."""
        return cast("list[BlockKey]", self.msg.keys)

    @property
    def transfer_id(self) -> str:
        """The id both sides log the pull's events under (``xfer=``)."""
        return m.xfer_id(self.msg.incarnation, self.msg.req)

    def move(self, event: JobEvent) -> JobState:
        self.state = JOB.move(self.state, event, f"pull {self.transfer_id} to {self.agent}")
        return self.state
