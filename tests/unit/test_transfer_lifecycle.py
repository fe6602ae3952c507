"""The lifecycles of a peer transfer and of an operation's engine memory as tables: every
legal move, every illegal one refused, and the records that carry them (a destination's pull,
a source's job, an operation's report) moving only through them. The behaviour behind each
move is tested on the fake fabric (test_peers_fake.py, test_peer_setup_fake.py,
test_faults_fake.py) and over real NIXL."""

from __future__ import annotations

import enum

import pytest

from kvcr.runtime.deadlines import Deadlines
from kvcr.runtime.lifecycle import (
    FRAMEWORK_MEMORY,
    JOB,
    LATE,
    PULL,
    PULL_OVER,
    WRITING,
    JobEvent,
    JobState,
    Link,
    MemoryEvent,
    MemoryState,
    PullEvent,
    PullState,
    RemotePull,
    SourceJob,
    wire_state,
)
from kvcr.statetable import IllegalMove, Table
from kvcr.transport import messages as m

TABLES = {
    "pull": (PULL, PullState, PullEvent),
    "job": (JOB, JobState, JobEvent),
    "memory": (FRAMEWORK_MEMORY, MemoryState, MemoryEvent),
}


def walk(table: Table, states: type[enum.Enum], events: type[enum.Enum]) -> None:
    # Every state of the enum has a row, and every event of the enum moves somewhere.
    assert set(table.moves) == set(states)
    assert table.events == set(events)
    for state, moves in table.moves.items():
        for event in events:
            if event in moves:
                assert table.allows(state, event)
                assert table.move(state, event, "t") == moves[event]
                assert moves[event] in table.moves  # every target is a state of the table
            else:
                assert not table.allows(state, event)
                with pytest.raises(IllegalMove, match=f"can't handle event '{event.value}'"):
                    table.move(state, event, "t")


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_move_is_in_the_table_and_anything_else_is_refused(name: str) -> None:
    walk(*TABLES[name])


def test_a_state_reads_as_its_value_in_logs_and_on_the_wire() -> None:
    assert f"{PullState.TURNED_AWAY}" == "turned_away" == str(PullState.TURNED_AWAY)
    assert (
        JobState.OVER == "over"
        and tuple(s.value for s in (JobState.PENDING, JobState.WRITING, JobState.OVER))
        == m.PROBE_STATES
    )


def test_a_pull_frees_its_memory_only_on_word_from_the_source() -> None:
    S, E = PullState, PullEvent
    answers = {E.WRITTEN: S.DONE, E.OVER: S.DONE, E.PROBE_OVER: S.DONE}
    gone = {E.REFUSED_UNREAD: S.DONE, E.RESTARTED: S.DONE}
    assert PULL.moves == {
        S.SENT: {
            **answers,
            E.REFUSED_UNREAD: S.TURNED_AWAY,
            E.RESTARTED: S.TURNED_AWAY,
            E.GIVE_UP: S.ABANDONED,
        },
        S.ABANDONED: {**answers, **gone, E.ABANDON_DEADLINE: S.QUARANTINED},
        S.QUARANTINED: {**answers, **gone},
        S.DONE: {},
        S.TURNED_AWAY: {},
    }
    assert {s for s in PULL.moves if PULL.terminal(s)} == PULL_OVER
    # Giving up and the abandon deadline never end a pull: only the source's answer does.
    for state in (S.SENT, S.ABANDONED):
        for event in (E.GIVE_UP, E.ABANDON_DEADLINE):
            if PULL.allows(state, event):
                assert PULL.moves[state][event] not in PULL_OVER
    # A pull that was given up on is never resent: only one turned away while sent can be.
    assert S.TURNED_AWAY not in PULL.reachable(S.ABANDONED)
    assert PULL.reachable(S.SENT) == set(S)


def test_a_source_job_ends_once_from_any_state_and_nothing_follows() -> None:
    S, E = JobState, JobEvent
    assert JOB.moves == {
        S.PENDING: {E.POST: S.WRITING, E.END: S.OVER},
        S.WRITING: {E.LATE: S.STALLED, E.END: S.OVER},
        S.STALLED: {E.ABANDON_DEADLINE: S.UNCERTAIN, E.END: S.OVER},
        S.UNCERTAIN: {E.END: S.OVER},
        S.OVER: {},
    }
    for state, moves in JOB.moves.items():
        if state is not S.OVER:
            assert moves[E.END] is S.OVER
    assert JOB.terminal(S.OVER) and JOB.reachable(S.PENDING) == set(S)
    # On the wire a running write is "writing", whatever its local state.
    assert {wire_state(s) for s in S} == {S.PENDING, S.WRITING, S.OVER}
    assert {s for s in S if wire_state(s) is S.WRITING} == WRITING
    assert LATE < WRITING  # a late write is still in flight


def test_an_operation_reports_uncertain_once_then_quiesced_once() -> None:
    S, E = MemoryState, MemoryEvent
    assert FRAMEWORK_MEMORY.moves == {
        S.CLEAR: {E.MAY_TOUCH: S.UNCERTAIN},
        S.UNCERTAIN: {E.TRANSFERS_OVER: S.QUIESCED},
        S.QUIESCED: {},
    }
    with pytest.raises(IllegalMove, match="operation deliver op 3: can't handle event 'may_touch'"):
        FRAMEWORK_MEMORY.move(S.UNCERTAIN, E.MAY_TOUCH, "deliver op 3")


def test_a_pull_record_moves_only_through_its_table() -> None:
    pull = RemotePull(7, Link("tcp://a:1"), 42, [b"k"])
    assert pull.state is PullState.SENT and not pull.turned_away
    assert pull.move(PullEvent.GIVE_UP) is PullState.ABANDONED
    with pytest.raises(IllegalMove, match="pull req 7 to tcp://a:1: can't handle event 'give_up'"):
        pull.move(PullEvent.GIVE_UP)
    assert pull.state is PullState.ABANDONED  # a refused move changes nothing
    assert pull.move(PullEvent.RESTARTED) is PullState.DONE and not pull.turned_away

    resend = RemotePull(8, Link("tcp://a:1"), 42, [b"k"])
    resend.move(PullEvent.REFUSED_UNREAD)
    assert resend.turned_away


def test_a_finished_pull_leaves_its_link_and_hands_its_memory_back_once() -> None:
    link = Link("tcp://a:1")
    pull = RemotePull(9, link, 42, [b"k", b"l"])
    link.pulls[pull.req] = pull
    freed: list[int] = []
    pull.on_over.append(lambda: freed.append(pull.req))
    pull.finish(PullEvent.WRITTEN, [1], "")
    assert pull.done.is_set() and pull.written == [1] and not link.pulls and freed == [9]
    with pytest.raises(IllegalMove):
        pull.finish(PullEvent.OVER, [], "late")
    assert freed == [9]


def test_a_job_record_moves_only_through_its_table() -> None:
    pull = m.Pull("tcp://d:1", 5, 6, 9, [b"k"], 1, m.Pull.pack([(4096, 8)]))
    job = SourceJob(pull, "agent-d", Deadlines(0.0, 1.0, 3.0))
    assert job.move(JobEvent.POST) is JobState.WRITING
    assert job.move(JobEvent.LATE) is JobState.STALLED
    assert job.move(JobEvent.END) is JobState.OVER
    with pytest.raises(
        IllegalMove,
        match=r"source job pull 0000000000000005\.9 to agent-d: can't handle event 'end'",
    ):
        job.move(JobEvent.END)


def test_both_deadlines_come_from_one_start() -> None:
    class Config:
        operation_timeout_ms = 1000
        abandon_timeout_ms = 3000

    clock = Deadlines.starting(10.0, Config())
    assert (clock.start, clock.deadline, clock.abandon_at) == (10.0, 11.0, 13.0)
