"""The first pull to a peer that just started (a restarted worker, the guard serving a dead
worker's group) on the fake fabric under MockClock (issue #15).

Each test scripts one interleaving the crash trials can meet after a takeover: answers that
arrive in one receive batch, a source that has no greeting from us, a first write that
fails, a pull crossing a probe answer, and a first contact slow enough to eat the operation's
deadline. Read top to bottom: which process a pull goes to, when it is asked again, what
the logs say, and what the deadline covers.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from kvcr.logs import capture_events
from kvcr.transport import messages as m
from kvcr.transport.fake import Behavior, Fault, FaultPlan
from peer_world import Worker, World, greet_and_lose, key, share


def statuses(entries: dict) -> dict:
    return {k: v.status.value for k, v in entries.items()}


def source_incarnation(worker: Worker) -> int:
    return worker.runtime.plane.incarnation


async def test_a_greeting_acknowledged_in_one_batch_with_another_incarnations_answer_holds(
    autojump_clock: Any,
) -> None:
    world = World()
    a, b = Worker(world, "a"), Worker(world, "b", eager=False)
    async with a.running(), b.running():
        a.engine.write(0, seed=1)
        await a.deposit([(0, 0)])
        b.kv.submit_hint(b.hint(a, [0]), request_id="r")
        with capture_events() as events:
            with world.hub.holding(b.endpoint):
                # Lazy setup: b greets a and its pull waits for the link. a's
                # acknowledgement and an answer from another incarnation at that endpoint
                # (a process that replaced it, say) reach b in one receive batch.
                handle = b.kv.deliver({key(0): b.refs(10)}, request_id="r")
                await trio.sleep(0.05)
                other = m.Over(a.endpoint, source_incarnation(a) ^ 1, 1, "from someone else")
                world.hub.channels[a.endpoint].send(b.endpoint, m.encode(other))
            entries = await b.engine.await_op(b.kv, handle, 1)

        # No pull was in flight when the batch came, so nothing in it can switch the link:
        # the pull goes to the process that took the greeting.
        assert statuses(entries) == {key(0): "SUCCESS"}
        assert [p.target for p in world.sent("pull")] == [source_incarnation(a)]
        assert [e["kind"] for e in events if e["event"] == "peer_message_dropped"] == [
            "unknown_over"
        ]


async def test_a_pull_refused_for_want_of_a_greeting_greets_again_and_goes_once_more(
    autojump_clock: Any,
) -> None:
    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")
    async with a.running(), b.running():
        await share(a, b, [0])
        # The source lost our metadata (say a guard that took over the endpoint while our
        # greeting was in flight): it refuses the pull, unread.
        a.runtime.source.agents_by_incarnation.clear()

        with capture_events() as events:
            entries = await b.deliver([(0, 10)])

        assert statuses(entries) == {key(0): "SUCCESS"}
        overs = world.sent("over")
        assert [o.reason for o in overs] == [m.NOT_GREETED]
        assert len(world.sent("hello")) == 2 and len(world.sent("pull")) == 2
        [resent] = [e for e in events if e["event"] == "pull_resent"]
        assert resent["reason"] == m.NOT_GREETED
        [refused] = [e for e in events if e["event"] == "pull_refused"]
        assert refused["reason"] == m.NOT_GREETED and refused["keys"] == 1


async def test_a_pull_refused_twice_is_not_asked_a_third_time(autojump_clock: Any) -> None:
    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")
    async with a.running(), b.running():
        await share(a, b, [0])
        source = a.runtime.source
        take_pull = source.on_pull

        def forgetful(msg: m.Pull) -> None:  # forgets every greeting before each pull
            source.agents_by_incarnation.clear()
            take_pull(msg)

        sides = a.runtime.plane.sides
        assert sides is not None
        sides.handlers[m.Pull] = forgetful

        entries = await b.deliver([(0, 10)])

        assert statuses(entries) == {key(0): "FAILED"}
        assert len(world.sent("pull")) == 2  # once more, then the truth


async def test_a_failed_first_write_is_logged_by_the_source_and_named_by_the_destination(
    autojump_clock: Any,
) -> None:
    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")
    async with a.running(), b.running():
        await share(a, b, [0, 1])
        a.transport.script.append(Behavior(delay=0.01, fail=True))

        with capture_events() as events:
            entries = await b.deliver([(0, 10), (1, 11)])

        assert statuses(entries) == {key(0): "FAILED", key(1): "FAILED"}
        [failed] = [e for e in events if e["event"] == "source_write_failed"]
        assert failed["to"] == "b" and failed["endpoint"] == b.endpoint
        pull = world.sent("pull")[0]
        assert failed["keys"] == 2 and failed["xfer"] == m.xfer_id(pull.incarnation, pull.req)
        assert failed["reason"].startswith("the write failed: ")
        [op_failed] = [e for e in events if e["event"] == "op_failed"]
        assert failed["reason"] in op_failed["reason"]
        # One transfer id, minted by the destination, in both sides' events.
        assert op_failed["xfer"] == failed["xfer"]


async def test_a_pull_crossing_the_new_processes_probe_answer_is_resent_to_it(
    autojump_clock: Any,
) -> None:
    world = World()
    b = Worker(world, "b")
    async with b.running():
        await greet_and_lose(world, b)
        # A pull to the dead process times out; its probe sits at the endpoint.
        assert statuses(await b.deliver([(0, 10)])) == {key(0): "FAILED"}
        a = Worker(world, "a")
        async with a.running():
            a.engine.write(0, seed=3)
            await a.deposit([(0, 0)])
            b.kv.submit_hint(b.hint(a, [0]), request_id="r2")
            with world.hub.holding(a.endpoint), world.hub.holding(b.endpoint):
                # b's next pull (still aimed at the dead process) and the new process's
                # answer to the earlier probe cross on the wire.
                handle = b.kv.deliver({key(0): b.refs(11)}, request_id="r2")
                await trio.sleep(0.01)
                ack = m.ProbeAck(a.endpoint, source_incarnation(a), 1, "over")
                world.hub.channels[a.endpoint].send(b.endpoint, m.encode(ack))
            entries = await b.engine.await_op(b.kv, handle, 1)

            assert statuses(entries) == {key(0): "SUCCESS"}
            assert world.sent("pull")[-1].target == source_incarnation(a)
            assert b.engine.checksum(11) == a.engine.checksum(0)


async def test_a_slow_first_contact_does_not_eat_the_operations_deadline(
    autojump_clock: Any,
) -> None:
    world = World()
    plan = FaultPlan()
    world.hub.plan = plan
    a, b = Worker(world, "a"), Worker(world, "b", eager=False)
    async with trio.open_nursery() as nursery:
        await nursery.start(plan.run)
        async with a.running(), b.running():
            a.engine.write(0, seed=1)
            await a.deposit([(0, 0)])
            b.kv.submit_hint(b.hint(a, [0]), request_id="r")
            # Setting the link up takes 0.8 s (a source that just booted), then the write
            # takes 0.5 s: 1.3 s in all, past the 1 s operation timeout, but the timeout
            # is for the transfer.
            plan.add("hello_ack", Fault("delay", 0.8), count=20)
            a.transport.script.append(Behavior(delay=0.5))
            start = trio.current_time()

            entries = await b.deliver([(0, 10)])

            assert statuses(entries) == {key(0): "SUCCESS"}
            assert trio.current_time() - start == pytest.approx(1.3, abs=0.05)
        nursery.cancel_scope.cancel()


async def test_a_first_contact_that_never_completes_fails_within_its_own_budget(
    autojump_clock: Any,
) -> None:
    world = World()
    b = Worker(world, "b", eager=False)
    async with b.running():
        b.kv.submit_hint(b.hint(Worker(world, "ghost"), [0]), request_id="r")
        start = trio.current_time()

        with capture_events() as events:
            entries = await b.deliver([(0, 10)])

        assert statuses(entries) == {key(0): "FAILED"}
        assert trio.current_time() - start == pytest.approx(1.0, abs=0.01)
        [failed] = [e for e in events if e["event"] == "op_failed"]
        assert "did not answer our greeting within 1000 ms" in failed["reason"]
