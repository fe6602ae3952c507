"""The lifecycles of a peer transfer as tables: every legal move, every illegal one refused,
and the records that carry them (a destination's pull, a source's job) moving only through
them. The behaviour behind each move is tested on the fake fabric (test_peers_fake.py,
test_peer_setup_fake.py) and over real NIXL."""

from __future__ import annotations

import pytest

from kvcr.runtime.lifecycle import JOB, PULL, PULL_OVER, WRITING, IllegalMove, Table, wire_state
from kvcr.runtime.ops import Deadlines
from kvcr.runtime.peers import Link, RemotePull
from kvcr.runtime.source import SourceJob
from kvcr.transport import messages as m


def walk(table: Table) -> None:
    for state, moves in table.moves.items():
        for event in table.events:
            if event in moves:
                assert table.move(state, event, "t") == moves[event]
                assert moves[event] in table.moves  # every target is a state of the table
            else:
                with pytest.raises(IllegalMove, match=f"can't handle event '{event}'"):
                    table.move(state, event, "t")


def reachable(table: Table, start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for target in table.moves[todo.pop()].values():
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


@pytest.mark.parametrize("table", [PULL, JOB], ids=["pull", "job"])
def test_every_move_is_in_the_table_and_anything_else_is_refused(table: Table) -> None:
    walk(table)


def test_a_pull_frees_its_memory_only_on_word_from_the_source() -> None:
    assert PULL.moves == {
        "sent": {
            "written": "done",
            "over": "done",
            "probe_over": "done",
            "refused_unread": "turned_away",
            "restarted": "turned_away",
            "give_up": "abandoned",
        },
        "abandoned": {
            "written": "done",
            "over": "done",
            "probe_over": "done",
            "refused_unread": "done",
            "restarted": "done",
            "abandon_deadline": "quarantined",
        },
        "quarantined": {
            "written": "done",
            "over": "done",
            "probe_over": "done",
            "refused_unread": "done",
            "restarted": "done",
        },
        "done": {},
        "turned_away": {},
    }
    assert {s for s in PULL.moves if PULL.terminal(s)} == PULL_OVER
    # Giving up and the abandon deadline never end a pull: only the source's answer does.
    for state in ("sent", "abandoned"):
        for event in ("give_up", "abandon_deadline"):
            if event in PULL.moves[state]:
                assert PULL.moves[state][event] not in PULL_OVER
    # A pull that was given up on is never resent: only one turned away while sent can be.
    assert "turned_away" not in reachable(PULL, "abandoned")
    assert reachable(PULL, "sent") == set(PULL.moves)


def test_a_source_job_ends_once_from_any_state_and_nothing_follows() -> None:
    assert JOB.moves == {
        "pending": {"post": "writing", "end": "over"},
        "writing": {"late": "stalled", "end": "over"},
        "stalled": {"abandon_deadline": "uncertain", "end": "over"},
        "uncertain": {"end": "over"},
        "over": {},
    }
    for state, moves in JOB.moves.items():
        if state != "over":
            assert moves["end"] == "over"
    assert JOB.terminal("over") and reachable(JOB, "pending") == set(JOB.moves)
    # On the wire a running write is "writing", whatever its local state.
    assert {wire_state(s) for s in JOB.moves} == {"pending", "writing", "over"}
    assert {s for s in JOB.moves if wire_state(s) == "writing"} == WRITING


def test_a_pull_record_moves_only_through_its_table() -> None:
    pull = RemotePull(7, Link("tcp://a:1"), 42, [b"k"])
    assert pull.state == "sent" and not pull.turned_away
    assert pull.move("give_up") == "abandoned"
    with pytest.raises(IllegalMove, match="pull req 7 to tcp://a:1: can't handle event 'give_up'"):
        pull.move("give_up")
    assert pull.state == "abandoned"  # a refused move changes nothing
    assert pull.move("restarted") == "done" and not pull.turned_away

    resend = RemotePull(8, Link("tcp://a:1"), 42, [b"k"])
    resend.move("refused_unread")
    assert resend.turned_away


def test_a_job_record_moves_only_through_its_table() -> None:
    pull = m.Pull("tcp://d:1", 5, 6, 9, [b"k"], 1, m.Pull.pack([(4096, 8)]))
    job = SourceJob(pull, "agent-d", Deadlines(0.0, 1.0, 3.0))
    assert job.move("post") == "writing"
    assert job.move("late") == "stalled"
    assert job.move("end") == "over"
    with pytest.raises(IllegalMove, match="source job req 9 to agent-d: can't handle event 'end'"):
        job.move("end")


def test_both_deadlines_come_from_one_start() -> None:
    class Config:
        operation_timeout_ms = 1000
        abandon_timeout_ms = 3000

    clock = Deadlines.starting(10.0, Config())
    assert (clock.start, clock.deadline, clock.abandon_at) == (10.0, 11.0, 13.0)
