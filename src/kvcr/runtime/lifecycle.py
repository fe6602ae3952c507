"""The lifecycles of a peer transfer, both sides, as tables (pure: no I/O, no clocks).

Theory of operation. A destination that wants blocks sends one ``Pull``; the source writes
what it has in one NIXL WRITE and its notification (``Written``) names what was written, or
it answers ``Over`` when it writes nothing. Memory the source may write is held, at both
ends, until the source can no longer touch it. So each side has one record per pull whose
state says exactly that:

Destination, a :class:`~kvcr.runtime.peers.RemotePull` (:data:`PULL`)::

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

Source, a :class:`~kvcr.runtime.source.SourceJob` (:data:`JOB`)::

    pending ──post──▶ writing ──late──▶ stalled ──abandon_deadline──▶ uncertain
       │                 │                 │                              │
       └─end─▶ over ◀────┴──── end ────────┴──────────── end ─────────────┘

``pending`` claims the keys in local G2 and waits for engine pins (``end``: cancelled by a
probe, nothing to write, or the pins' deadline, ``operation_timeout_ms`` from the pull's
arrival). A write is timed from its posting: ``late`` is ``operation_timeout_ms`` with the
write still running, and the source stops taking new pulls until it ends. At
``abandon_timeout_ms`` the write is cancelled if the transport can (a NIXL peer write never
is: over TCP it would resume later); if not, engine memory it reads is
reported ``uncertain`` and ``quiesced`` follows at ``end``. Claims and pins are released at
``end`` and nowhere else. On the wire (``ProbeAck.state``) a job is ``pending``, ``writing``
(any state of a running write) or ``over``.

Every move goes through :meth:`Table.move`; anything the table does not allow is a bug and
raises :class:`IllegalMove`. Every deadline comes from one place,
:class:`~kvcr.runtime.ops.Deadlines`, measured from the operation's start (destination;
restarted once a first contact's link is ready), the pull's arrival (a source's pins) or
the write's posting (a source's write).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs


class IllegalMove(RuntimeError):
    """A transfer was asked to make a move its table does not allow."""


@attrs.frozen
class Table:
    name: str
    moves: Mapping[str, Mapping[str, str]]  # state -> {event: next state}

    def move(self, state: str, event: str, what: str) -> str:
        """The state after ``event``; ``what`` names the transfer in the error."""
        try:
            return self.moves[state][event]
        except KeyError:
            raise IllegalMove(
                f"{self.name} {what}: can't handle event {event!r} in state {state!r}"
            ) from None

    def terminal(self, state: str) -> bool:
        return not self.moves[state]

    @property
    def events(self) -> frozenset[str]:
        return frozenset(e for moves in self.moves.values() for e in moves)


_ANSWERS = {
    "written": "done",
    "over": "done",
    "probe_over": "done",
}
PULL = Table(
    "pull",
    {
        "sent": {
            **_ANSWERS,
            "refused_unread": "turned_away",
            "restarted": "turned_away",
            "give_up": "abandoned",
        },
        "abandoned": {
            **_ANSWERS,
            "refused_unread": "done",
            "restarted": "done",
            "abandon_deadline": "quarantined",
        },
        "quarantined": {**_ANSWERS, "refused_unread": "done", "restarted": "done"},
        "done": {},
        "turned_away": {},
    },
)
# The source can no longer write: the pull's memory is free again.
PULL_OVER = frozenset({"done", "turned_away"})

JOB = Table(
    "source job",
    {
        "pending": {"post": "writing", "end": "over"},
        "writing": {"late": "stalled", "end": "over"},
        "stalled": {"abandon_deadline": "uncertain", "end": "over"},
        "uncertain": {"end": "over"},
        "over": {},
    },
)
WRITING = frozenset({"writing", "stalled", "uncertain"})  # a write is in flight


def wire_state(job_state: str) -> str:
    """What a ``ProbeAck`` says of a job in ``job_state``."""
    return "writing" if job_state in WRITING else job_state
