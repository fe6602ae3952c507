"""Peer-to-peer reuse on the fake fabric under MockClock: the protocol and every deadline path.

Worker ``a`` is the source a router hint names; worker ``b`` is the destination. Both run in
the test's trio loop; their NIXL agents are fake transports on one fabric and their control
channels are in-memory channels on one hub, so drops, stalls and restarts are exact.
"""

from __future__ import annotations

import attrs
import pytest
import trio

from kvcr.logs import capture_events
from kvcr.transport import messages as m
from kvcr.types import CacheTier, QueryStatus
from peer_world import Worker, World, greet_and_lose, key, share, telemetry_pair

REMOTE = (QueryStatus.FETCHABLE, CacheTier.REMOTE_G2)
HIT = (QueryStatus.HIT, CacheTier.LOCAL_G2)
MISS = (QueryStatus.MISS, None)


def statuses(entries: dict) -> dict:
    return {k: v.status.value for k, v in entries.items()}


async def test_a_hinted_deliver_pulls_kvcr_owned_blocks_byte_exact(autojump_clock):
    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")
    async with a.running(), b.running():
        for i in range(3):
            a.engine.write(i, seed=i)
        assert await a.deposit([(0, 0), (1, 1), (2, 2)]) == dict.fromkeys(
            [key(0), key(1), key(2)], "SUCCESS"
        )
        b.kv.submit_hint(b.hint(a, [0, 1, 2]), request_id="r")
        assert b.kv.query([key(0), key(1), key(5)], request_id="r") == [REMOTE, REMOTE, MISS]

        entries = await b.deliver([(0, 10), (1, 11), (2, 12)])

        assert set(statuses(entries).values()) == {"SUCCESS"}
        for i in range(3):
            assert b.engine.checksum(10 + i) == a.engine.checksum(i)
        # The source's claims were dropped once the write was over.
        assert all(a.runtime.index.get(key(i)).claims == 0 for i in range(3))


async def test_a_hinted_fetch_pulls_engine_memory_into_local_g2(autojump_clock):
    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")
    async with a.running(), b.running():
        a.engine.write(4, seed=9)
        a.pins.engine_has = {key(7): 4}
        b.kv.submit_hint(b.hint(a, [7]), request_id="r")

        handle = b.kv.fetch([key(7)], request_id="r")
        entries = await b.engine.await_op(b.kv, handle, 1)

        entry = entries[key(7)]
        assert entry.success and entry.release_handle is not None
        assert b.kv.query([key(7)]) == [HIT]
        slot = entry.descriptors[0].element_index
        fetched = b.engine.pools[0][slot * 4096 : (slot + 1) * 4096]
        assert (fetched == a.engine.view(0, 4)).all()
        assert b.recorder.inventory_keys(removed=False) == [key(7)]
        # The engine's pin was released after the write (at its next poll), not before.
        await trio.sleep(0.01)
        assert a.pins.released == ["pin-1"] and not a.pins.pinned


async def test_a_partial_answer_delivers_what_the_source_had(autojump_clock):
    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")
    async with a.running(), b.running():
        a.engine.write(0, seed=1)
        await a.deposit([(0, 0)])
        b.kv.submit_hint(b.hint(a, [0, 1]), request_id="r")

        with capture_events() as events:
            entries = await b.deliver([(0, 10), (1, 11)])

        assert statuses(entries) == {key(0): "SUCCESS", key(1): "FAILED"}
        assert b.engine.checksum(10) == a.engine.checksum(0)
        # The log says why one key failed (it used to say "closed").
        [failed] = [e for e in events if e["event"] == "op_failed"]
        assert failed["reason"] == "deliver: the source lacked 1 of the keys"


async def test_eager_setup_greets_the_source_at_submit_hint(autojump_clock):
    world = World()
    a, b = Worker(world, "a"), Worker(world, "b", eager=True)
    async with a.running(), b.running():
        b.kv.submit_hint(b.hint(a, [1]), request_id="r")
        await trio.sleep(0.01)
        assert len(world.sent("hello")) == 1
        assert len(world.sent("hello_ack")) == 1


async def test_lazy_setup_greets_the_source_on_first_use(autojump_clock):
    world = World()
    a, b = Worker(world, "a"), Worker(world, "b", eager=False)
    async with a.running(), b.running():
        b.kv.submit_hint(b.hint(a, [1]), request_id="r")
        await trio.sleep(0.01)
        assert world.sent("hello") == []

        await b.deliver([(1, 10)])
        assert len(world.sent("hello")) == 1


async def test_metadata_is_resent_until_acknowledged(autojump_clock):
    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")
    dropped = []

    def drop_first_two_hellos(endpoint: str, message: bytes) -> bool:
        if isinstance(m.decode(message), m.Hello) and len(dropped) < 2:
            dropped.append(trio.current_time())
            return True
        return False

    world.hub.drop = drop_first_two_hellos
    async with a.running(), b.running():
        a.engine.write(0, seed=3)
        await a.deposit([(0, 0)])
        b.kv.submit_hint(b.hint(a, [0]), request_id="r")
        entries = await b.deliver([(0, 10)])

        assert statuses(entries) == {key(0): "SUCCESS"}
        hellos = world.sent("hello")
        assert len(hellos) == 3
        assert dropped[1] - dropped[0] == pytest.approx(0.1, abs=0.005)  # retry interval


async def test_past_the_deadline_the_destination_fails_probes_and_holds_memory(autojump_clock):
    world = World()
    # The source keeps its stuck write longer than the destination waits.
    a = Worker(world, "a", operation_timeout_ms=1000, abandon_timeout_ms=10000)
    b = Worker(world, "b")
    async with a.running(), b.running():
        await share(a, b, [0])
        from kvcr.transport.fake import NEVER

        a.transport.script.append(NEVER)
        start = trio.current_time()
        handle = b.kv.deliver({key(0): b.refs(10)}, request_id="r")
        entries = await b.engine.await_op(b.kv, handle, 1)

        assert statuses(entries) == {key(0): "FAILED"}
        assert trio.current_time() - start == pytest.approx(1.0, abs=0.01)
        # The engine heard first that its destination memory is uncertain.
        (error,) = b.recorder.resilience
        assert error.state == "uncertain" and error.destination_regions == tuple(b.refs(10))
        probes = world.sent("probe")
        assert len(probes) == 1 and probes[0].cancel
        assert [ack.state for ack in world.sent("probe_ack")] == ["writing"]

        await trio.sleep(2.5)  # the abandon deadline: probed again, still held
        assert len(world.sent("probe")) == 2
        assert b.events() == [(handle, "uncertain")]

        a.transport.finish(a.transport.in_flight()[0])
        await trio.sleep(0.01)
        b.kv.poll_completed()
        assert b.events() == [(handle, "uncertain"), (handle, "quiesced")]
        assert a.runtime.index.get(key(0)).claims == 0


async def test_a_source_cancels_a_write_hung_past_its_abandon_deadline(autojump_clock):
    from kvcr.transport.fake import NEVER

    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")
    async with a.running(), b.running():
        await share(a, b, [0])
        a.transport.script.append(NEVER)  # the destination never lets the write finish
        posted = trio.current_time()
        handle = b.kv.deliver({key(0): b.refs(10)}, request_id="r")
        await b.engine.await_op(b.kv, handle, 1)

        await trio.sleep(3.5)
        b.kv.poll_completed()

        write = a.transport.posted[-1]  # after the local deposit
        assert write.released and write.state.value == "ERR"  # cancelled at 3 s
        assert a.runtime.index.get(key(0)).claims == 0
        assert world.sent("over")[-1].reason == (
            "the write failed: cancelled: still running at abandon_timeout_ms"
        )
        assert b.events() == [(handle, "uncertain"), (handle, "quiesced")]
        assert trio.current_time() - posted > 3.0


async def test_a_late_success_after_the_deadline_stays_a_failure(autojump_clock):
    from kvcr.transport.fake import Behavior

    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")
    async with a.running(), b.running():
        await share(a, b, [0])
        a.transport.script.append(Behavior(delay=1.5))

        handle = b.kv.deliver({key(0): b.refs(10)}, request_id="r")
        entries = await b.engine.await_op(b.kv, handle, 1)
        assert statuses(entries) == {key(0): "FAILED"}

        await trio.sleep(1.0)  # the write lands now
        assert handle not in b.engine.completed  # the failure stands: no second answer
        assert b.events() == [(handle, "uncertain"), (handle, "quiesced")]


async def test_a_probe_cancels_a_pull_still_waiting_for_engine_pins(autojump_clock):
    world = World()
    # The source waits for pins longer than the destination waits for the source.
    a = Worker(world, "a", operation_timeout_ms=2000, abandon_timeout_ms=4000)
    b = Worker(world, "b")
    async with a.running(), b.running():
        a.pins.engine_has = {key(3): 3}
        a.pins.hold_back = True  # the engine does not answer the pin request
        b.kv.submit_hint(b.hint(a, [3]), request_id="r")

        handle = b.kv.deliver({key(3): b.refs(10)}, request_id="r")
        entries = await b.engine.await_op(b.kv, handle, 1)
        await trio.sleep(0.01)
        b.kv.poll_completed()

        assert statuses(entries) == {key(3): "FAILED"}
        assert [ack.state for ack in world.sent("probe_ack")] == ["over"]
        assert a.pins.cancelled == [1]
        # Nothing was ever written: the memory is quiesced as soon as the source says so.
        assert b.events() == [(handle, "uncertain"), (handle, "quiesced")]


async def test_a_stalled_source_refuses_new_writes(autojump_clock):
    from kvcr.transport.fake import NEVER

    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")
    async with a.running(), b.running():
        for i in range(2):
            a.engine.write(i, seed=i)
        await a.deposit([(0, 0), (1, 1)])
        b.kv.submit_hint(b.hint(a, [0, 1]), request_id="r")
        await trio.sleep(0.01)
        a.transport.script.append(NEVER)
        stuck = b.kv.deliver({key(0): b.refs(10)}, request_id="r")
        await b.engine.await_op(b.kv, stuck, 1)
        await trio.sleep(0.1)  # the source's write is now older than the operation timeout

        b.kv.submit_hint(b.hint(a, [1]), request_id="r2")
        start = trio.current_time()
        handle = b.kv.deliver({key(1): b.refs(11)}, request_id="r2")
        entries = await b.engine.await_op(b.kv, handle, 1)

        assert statuses(entries) == {key(1): "FAILED"}
        assert trio.current_time() - start < 0.05
        assert any("stalled" in over.reason for over in world.sent("over"))


async def test_a_pull_turned_away_by_a_restarted_source_is_asked_again_once(autojump_clock):
    world = World()
    b = Worker(world, "b")
    async with b.running():
        await greet_and_lose(world, b)
        old_incarnation = world.sent("hello_ack")[0].incarnation

        second = Worker(world, "a")  # the same endpoint and agent name, a new process
        async with second.running():
            second.engine.write(0, seed=5)
            await second.deposit([(0, 0)])
            entries = await b.deliver([(0, 10)])

            # The pull aimed at the old incarnation was turned away by the new one (which
            # wrote nothing, and the old one is gone), so it went again, to the new one.
            pulls = world.sent("pull")
            assert [p.target for p in pulls] == [old_incarnation, pulls[1].target]
            assert pulls[1].target != old_incarnation
            assert statuses(entries) == {key(0): "SUCCESS"}
            assert b.engine.checksum(10) == second.engine.checksum(0)


async def test_a_late_message_of_a_replaced_incarnation_is_stale(autojump_clock):
    world = World()
    b = Worker(world, "b")
    async with b.running():
        await greet_and_lose(world, b)
        old = world.sent("hello_ack")[0]

        second = Worker(world, "a")  # the successor at the same endpoint
        async with second.running():
            second.engine.write(0, seed=5)
            await second.deposit([(0, 0)])
            assert statuses(await b.deliver([(0, 10)])) == {key(0): "SUCCESS"}

            # A message the dead process sent before it died, read only now: it must not
            # make the link switch back to that process (and end the successor's pulls).
            late = m.Over(old.sender, old.incarnation, 999, "late")
            world.hub.channels[b.endpoint].send(b.endpoint, m.encode(late))
            await trio.sleep(0.01)
            b.kv.submit_hint(b.hint(second, [0]), request_id="r2")
            assert statuses(await b.deliver([(0, 11)], request_id="r2")) == {key(0): "SUCCESS"}
            assert len(world.sent("hello")) == 2  # no third greeting: no switch happened


async def test_a_pull_waiting_for_a_greeting_goes_ahead_when_yet_another_process_answers(
    autojump_clock,
):
    # Found by the soak (tests/soak.py): a worker is killed mid-pull, the guard answers the
    # destination's probe (so the link knows the guard's incarnation but is not set up), a
    # replacement claims the group, and the destination's next pull greets the endpoint:
    # the replacement's answer is a third incarnation. The pull waiting for the greeting
    # must go ahead, not sit until its deadline.
    world = World()
    b = Worker(world, "b")
    async with b.running():
        await greet_and_lose(world, b)
        # Nobody answers at the endpoint: the pull fails at its deadline and is probed.
        assert statuses(await b.deliver([(0, 10)])) == {key(0): "FAILED"}
        second = Worker(world, "a")
        async with second.running():
            await trio.sleep(5)  # b probes again at its abandon deadline: second answers
            assert world.sent("probe_ack")
        third = Worker(world, "a")
        async with third.running():
            third.engine.write(0, seed=5)
            await third.deposit([(0, 0)])
            b.kv.submit_hint(b.hint(third, [0]), request_id="r2")
            entries = await b.deliver([(0, 11)], request_id="r2")
            assert statuses(entries) == {key(0): "SUCCESS"}
            assert b.engine.checksum(11) == third.engine.checksum(0)


async def test_a_fetch_does_not_evict_its_own_local_keys_to_make_room_for_its_remote_ones(
    autojump_clock,
):
    # Found by the soak: with the pool full, a fetch of [a resident key, a key from the
    # hinted peer] made room for the peer's key by evicting the least recently used block,
    # which could be the resident key that the same fetch was about to claim (whichever
    # part trio happened to run first).
    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")  # b's pool has 8 slots
    async with a.running(), b.running():
        b.kv.submit_hint(b.hint(a, list(range(1000, 1010))), request_id="r")
        for trial in range(10):
            fresh = [100 * trial + i for i in range(8)]
            for i, k in enumerate(fresh):
                b.engine.write(i, seed=k)
            assert set((await b.deposit(list(zip(fresh, range(8))))).values()) == {"SUCCESS"}
            a.engine.write(0, seed=1000 + trial)
            await a.deposit([(1000 + trial, 0)])
            # fresh[0] is the least recently used block of the full pool.
            handle = b.kv.fetch([key(fresh[0]), key(1000 + trial)], request_id="r")
            entries = await b.engine.await_op(b.kv, handle, 2)
            assert statuses(entries) == {key(fresh[0]): "SUCCESS", key(1000 + trial): "SUCCESS"}
            b.kv.release([e.release_handle for e in entries.values()])


async def test_a_failed_remote_operation_marks_the_hint_failed(autojump_clock):
    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")
    async with a.running(), b.running():
        b.kv.submit_hint(b.hint(a, [0, 1]), request_id="r")
        assert b.kv.query([key(0)], request_id="r") == [REMOTE]

        entries = await b.deliver([(0, 10)])
        assert statuses(entries) == {key(0): "FAILED"}

        assert b.kv.query([key(0), key(1)], request_id="r") == [MISS, MISS]
        pulls = len(world.sent("pull"))
        entries = await b.deliver([(1, 11)])
        assert statuses(entries) == {key(1): "FAILED"}
        assert len(world.sent("pull")) == pulls  # failed at once, nothing asked


async def test_memory_behind_a_dead_source_is_held_until_its_successor_answers(autojump_clock):
    from kvcr.transport.fake import NEVER

    world = World()
    b = Worker(world, "b")
    async with b.running():
        a = Worker(world, "a", abandon_timeout_ms=60000)  # dead: it will not act either
        async with a.running():
            a.engine.write(0, seed=1)
            await a.deposit([(0, 0)])
            b.kv.submit_hint(b.hint(a, [0]), request_id="r")
            await trio.sleep(0.01)
            a.transport.script.append(NEVER)
            handle = b.kv.deliver({key(0): b.refs(10)}, request_id="r")
            await trio.sleep(0.01)
            world.fabric.kill("a")  # SIGKILL: no answer will ever come from it
            world.hub.channels["tcp://a:5555"].close()
            entries = await b.engine.await_op(b.kv, handle, 1)
            assert statuses(entries) == {key(0): "FAILED"}
            await trio.sleep(5)
            b.kv.poll_completed()
            assert b.events() == [(handle, "uncertain")]  # held: nobody confirmed anything
            a.transport.finish(a.transport.in_flight()[0], ok=False)

        successor = Worker(world, "a")
        async with successor.running():
            # The next pull, aimed at the dead incarnation, is refused by the successor:
            # now the destination knows the old process is gone.
            b.kv.submit_hint(b.hint(successor, [9]), request_id="r3")
            entries = await b.deliver([(9, 12)], request_id="r3")
            assert statuses(entries) == {key(9): "FAILED"}
            b.kv.poll_completed()
            assert b.events() == [(handle, "uncertain"), (handle, "quiesced")]


async def test_malformed_and_unknown_peer_messages_are_dropped_once_per_kind(autojump_clock):
    from kvcr.logs import capture_events
    from kvcr.transport import messages as m

    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")
    async with a.running(), b.running():
        a.engine.write(0, seed=1)
        await a.deposit([(0, 0)])
        sender = world.hub.channel("tcp://mallory:1")
        with capture_events() as events:
            for _ in range(3):
                sender.send(a.endpoint, b"\x00garbage")
                sender.send(a.endpoint, m.encode(m.Over("tcp://mallory:1", 5, 77, "x")))
                sender.send(b.endpoint, m.encode(m.Over("tcp://mallory:1", 5, 77, "x")))
            await trio.sleep(0.01)

        drops = [e["kind"] for e in events if e["event"] == "peer_message_dropped"]
        # a got the garbage and an Over; b an Over: one event per kind and instance.
        assert sorted(drops) == ["bad_message", "unknown_over", "unknown_over"]
        b.kv.submit_hint(b.hint(a, [0]), request_id="r")
        entries = await b.deliver([(0, 10)])
        assert statuses(entries) == {key(0): "SUCCESS"}


async def test_telemetry_counts_agree_on_both_sides_of_a_pull(autojump_clock):
    from kvcr import DURATION_METRIC, TRANSFER_BLOCKS_METRIC, TRANSFER_BYTES_METRIC
    from kvcr.logs import capture_events
    from kvcr.telemetry import FUNNEL

    _, a, b = telemetry_pair()
    async with a.running(), b.running():
        for i in range(3):
            a.engine.write(i, seed=i)
        await a.deposit([(0, 0), (1, 1)])
        a.pins.engine_has = {key(2): 2}
        b.kv.submit_hint(b.hint(a, [0, 1, 2, 3]), request_id="r")
        with capture_events() as events:
            entries = await b.deliver([(0, 10), (1, 11), (2, 12), (3, 13)])
        assert sorted(statuses(entries).values()) == ["FAILED", "SUCCESS", "SUCCESS", "SUCCESS"]
        await trio.sleep(0.01)

        dst, src = b.kv.get_stats(), a.kv.get_stats()

    # The block funnel, each side its own stages: 4 planned; the source found 2 in G2 and
    # its engine pinned 1 (resident 3), held and submitted those 3; 3 completed, 3 published.
    destination_side = ("peer_planned", "peer_completed", "peer_published")
    source_side = ("peer_resident", "peer_held", "peer_submitted")
    assert set(destination_side + source_side) == set(FUNNEL)
    funnel = {
        scope: side.counters.get((TRANSFER_BLOCKS_METRIC, (scope,)))
        for side, scopes in ((dst, destination_side), (src, source_side))
        for scope in scopes
    }
    assert funnel == {
        "peer_planned": 4,
        "peer_resident": 3,
        "peer_held": 3,
        "peer_submitted": 3,
        "peer_completed": 3,
        "peer_published": 3,
    }
    [partial] = [e for e in events if e["event"] == "pull_partial"]
    assert (partial["planned"], partial["completed"], partial["published"]) == (4, 3, 3)
    assert len(src.histograms[(DURATION_METRIC, ("transfer_post", "success"))]) == 1
    # The phases: the hint's age when the deliver used it (its remote part was partial),
    # and each control message's handling, by type, on the side that handled it.
    assert len(dst.histograms[(DURATION_METRIC, ("hint_age", "partial"))]) == 1
    assert len(src.histograms[(DURATION_METRIC, ("control_pull", "success"))]) == 1
    assert len(src.histograms[(DURATION_METRIC, ("control_hello", "success"))]) >= 1
    assert len(dst.histograms[(DURATION_METRIC, ("control_hello_ack", "success"))]) >= 1
    assert len(dst.histograms[(DURATION_METRIC, ("control_written", "success"))]) == 1
    assert len(dst.histograms[(DURATION_METRIC, ("notification", "success"))]) == 1
    phases = [v for h in (src.histograms, dst.histograms) for vs in h.values() for v in vs]
    assert all(v >= 0 for v in phases)

    assert dst.counters[(TRANSFER_BLOCKS_METRIC, ("remote_deliver",))] == 3
    assert dst.counters[(TRANSFER_BYTES_METRIC, ("remote_deliver",))] == 3 * 4096
    assert src.counters[(TRANSFER_BLOCKS_METRIC, ("source_write",))] == 3
    assert src.counters[(TRANSFER_BYTES_METRIC, ("source_write",))] == 3 * 4096
    assert len(dst.histograms[(DURATION_METRIC, ("remote_deliver", "partial"))]) == 1
    assert len(dst.histograms[(DURATION_METRIC, ("peer_setup", "success"))]) == 1
    assert len(src.histograms[(DURATION_METRIC, ("framework_pin_wait", "success"))]) == 1
    assert len(src.histograms[(DURATION_METRIC, ("transfer", "success"))]) == 1
    assert dst.gauges[("kvcr_state", ("peer_links",))] == 1
    assert src.gauges[("kvcr_state", ("source_stalled",))] == 0


async def test_a_duplicate_completion_is_dropped_and_changes_nothing(autojump_clock):
    from kvcr.logs import capture_events

    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")
    async with a.running(), b.running():
        await share(a, b, [0, 1])
        assert statuses(await b.deliver([(0, 10)])) == {key(0): "SUCCESS"}
        pull = world.sent("pull")[0]
        replay = m.encode(m.Written(world.sent("hello_ack")[0].incarnation, pull.req, [0]))

        with capture_events() as events:
            b.transport.inject_notification("a", replay)
            b.transport.inject_notification("a", replay)
            await trio.sleep(0.01)
            entries = await b.deliver([(1, 11)])

        assert statuses(entries) == {key(1): "SUCCESS"}
        drops = [e["kind"] for e in events if e["event"] == "peer_message_dropped"]
        assert drops == ["unknown_written"]
        assert b.engine.completed == {}  # no op was answered again


async def test_closing_a_source_drops_pulls_waiting_for_pins(autojump_clock):
    world = World()
    b = Worker(world, "b")
    a = Worker(world, "a")
    async with b.running():
        async with a.running():
            a.pins.engine_has = {key(3): 3}
            a.pins.hold_back = True  # the engine has not answered when the source closes
            b.kv.submit_hint(b.hint(a, [3]), request_id="r")
            handle = b.kv.deliver({key(3): b.refs(10)}, request_id="r")
            await trio.sleep(0.01)
            assert len(a.pins.requests) == 1
        # The pull was dropped at close, the pin request cancelled, the destination told.
        entries = await b.engine.await_op(b.kv, handle, 1)
        assert statuses(entries) == {key(3): "FAILED"}
        assert any(over.reason == "cancelled" for over in world.sent("over"))
        assert a.pins.cancelled == [1]


async def test_closing_a_source_hands_back_pins_the_engine_refused_to_take(autojump_clock):
    world = World()
    b = Worker(world, "b")
    a = Worker(world, "a")
    async with b.running():
        async with a.running():
            a.pins.engine_has = {key(3): 3}
            a.pins.release_refusals = 2  # "not now", twice
            b.kv.submit_hint(b.hint(a, [3]), request_id="r")
            assert statuses(await b.deliver([(3, 10)])) == {key(3): "SUCCESS"}
            assert a.pins.pinned == {"pin-1"}  # refused once already, retried later
        assert a.pins.released == ["pin-1"] and not a.pins.pinned


async def test_a_worker_without_local_dram_still_pulls_into_engine_memory(autojump_clock):
    world = World()
    a, b = Worker(world, "a"), Worker(world, "b", pools=False)
    async with a.running(), b.running():
        await share(a, b, [0, 1])

        entries = await b.deliver([(0, 10), (1, 11)])

        assert set(statuses(entries).values()) == {"SUCCESS"}
        assert b.engine.checksum(10) == a.engine.checksum(0)
        handle = b.kv.fetch([key(0)], request_id="r")  # nowhere to fetch into
        assert statuses(await b.engine.await_op(b.kv, handle, 1)) == {key(0): "FAILED"}


async def test_an_unreachable_hinted_peer_fails_the_hint_after_one_deadline(autojump_clock):
    world = World()
    b = Worker(world, "b")
    async with b.running():
        b.kv.submit_hint(b.hint(Worker(world, "ghost"), [0, 1]), request_id="r")
        assert b.kv.query([key(0)], request_id="r") == [REMOTE]

        start = trio.current_time()
        assert statuses(await b.deliver([(0, 10)])) == {key(0): "FAILED"}
        assert trio.current_time() - start == pytest.approx(1.0, abs=0.01)

        assert b.kv.query([key(0), key(1)], request_id="r") == [MISS, MISS]
        start = trio.current_time()
        assert statuses(await b.deliver([(1, 11)])) == {key(1): "FAILED"}
        assert trio.current_time() - start < 0.01  # at once, not another deadline


class OddKeys:
    """A key adapter that decodes key k to its router hash k as an int (k < 100), as 8
    big-endian bytes (100 <= k < 200), to an int out of the hash range (k == 300), or
    refuses it (k == 400)."""

    def encode(self, framework_key: int) -> bytes:
        return key(framework_key)

    def decode(self, k: bytes) -> int | bytes:
        n = int.from_bytes(k, "big")
        if n == 300:
            return 2**64
        if n == 400:
            raise ValueError("not a key of this engine")
        return n if n < 100 else n.to_bytes(8, "big")


class OddKeysWorker(Worker):
    def bindings(self) -> object:
        return attrs.evolve(super().bindings(), key_adapter=OddKeys())


async def test_query_answers_fetchable_by_what_the_adapter_decodes_and_logs_what_it_cannot(
    autojump_clock,
):
    # query decodes every missed key at once when the adapter gives ints in range; a batch
    # with bytes, an out-of-range int or a refusal is answered key by key, as covers says.
    world = World()
    b = OddKeysWorker(world, "b")
    async with b.running():
        b.kv.submit_hint(b.hint(b, [1, 2, 150]), request_id="r")
        assert b.kv.query([key(1), key(2), key(3)], request_id="r") == [REMOTE, REMOTE, MISS]
        with capture_events() as events:
            batch = [key(1), key(150), key(151), key(300), key(400)]
            assert b.kv.query(batch, request_id="r") == [REMOTE, REMOTE, MISS, MISS, MISS]
        unusable = [e for e in events if e["event"] == "key_adapter_decode_unusable"]
        assert len(unusable) == 2  # the out-of-range hash and the refusal, each named


async def test_a_failed_write_shows_in_every_phase_timer_and_the_funnel(autojump_clock):
    """The failure path of the same signals: the write fails at the source (the fake
    transport's scripted fault), so both sides' timers say ``failed`` and the funnel stops
    between submitted and completed."""
    from kvcr import DURATION_METRIC, TRANSFER_BLOCKS_METRIC
    from kvcr.transport.fake import Behavior

    _, a, b = telemetry_pair()
    async with a.running(), b.running():
        await share(a, b, [0, 1])
        a.transport.script.append(Behavior(delay=0.01, fail=True))
        with capture_events() as events:
            entries = await b.deliver([(0, 10), (1, 11)], request_id="r")
        assert statuses(entries) == {key(0): "FAILED", key(1): "FAILED"}
        await trio.sleep(0.01)
        dst, src = b.kv.get_stats(), a.kv.get_stats()

    def blocks(side, scope):
        return side.counters.get((TRANSFER_BLOCKS_METRIC, (scope,)), 0)

    assert [blocks(dst, "peer_planned"), blocks(src, "peer_resident")] == [2, 2]
    assert [blocks(src, "peer_held"), blocks(src, "peer_submitted")] == [2, 2]
    assert [blocks(dst, "peer_completed"), blocks(dst, "peer_published")] == [0, 0]
    for side, scope in (
        (src, "transfer"),
        (src, "source_write"),
        (dst, "remote_deliver"),
        (dst, "hint_age"),
    ):
        assert len(side.histograms[(DURATION_METRIC, (scope, "failed"))]) == 1, scope
    [partial] = [e for e in events if e["event"] == "pull_partial"]
    [failed] = [e for e in events if e["event"] == "source_write_failed"]
    assert (partial["planned"], partial["completed"], partial["published"]) == (2, 0, 0)
    assert (failed["resident"], failed["held"], failed["keys"]) == (2, 2, 2)
    assert partial["xfer"] == failed["xfer"]  # one id on both sides


@pytest.mark.parametrize("word", ["lost", "late"])
async def test_a_notification_that_never_comes_is_timed_as_failed_and_bounded(autojump_clock, word):
    """The source's word is lost on its way, or comes only after the destination gave up
    (a write that takes 2 s): the destination's ``notification`` phase fails after the
    operation's whole wait (its deadline, on its own clock), never more, and a late word
    is no second sample; the funnel stops at submitted."""
    from kvcr import DURATION_METRIC, TRANSFER_BLOCKS_METRIC
    from kvcr.transport.fake import Behavior, Fault, FaultPlan

    world = World()
    world.fabric.plan = plan = FaultPlan()
    a = Worker(world, "a", enable_telemetry=True)
    b = Worker(world, "b", enable_telemetry=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(plan.run)
        async with a.running(), b.running():
            await share(a, b, [0])
            if word == "lost":
                plan.add("written", Fault("drop"))
            else:
                a.transport.script.append(Behavior(delay=2.0))
            start = trio.current_time()
            entries = await b.deliver([(0, 10)], request_id="r")
            assert statuses(entries) == {key(0): "FAILED"}
            assert trio.current_time() - start == pytest.approx(1.0, abs=0.01)
            await trio.sleep(4.0)  # past the late word and the abandon deadline
            b.kv.poll_completed()
            assert b.events()[-1][1] == "quiesced"
            dst, src = b.kv.get_stats(), a.kv.get_stats()
        nursery.cancel_scope.cancel()

    [waited] = dst.histograms[(DURATION_METRIC, ("notification", "failed"))]
    assert 0.9 <= waited <= 1.01  # from the pull's sending to the deadline
    assert (DURATION_METRIC, ("notification", "success")) not in dst.histograms
    assert src.counters[(TRANSFER_BLOCKS_METRIC, ("peer_submitted",))] == 1
    assert (TRANSFER_BLOCKS_METRIC, ("peer_completed",)) not in dst.counters


async def test_bad_input_and_many_requests_leave_the_labels_bounded(autojump_clock):
    """Unknown message types, garbage, answers about pulls nobody sent and twenty requests:
    every label is one of the documented, fixed ones (no type, key, request or endpoint
    becomes a label), every duration is finite and not negative, and the labels after
    twenty pulls are those after one."""
    import msgpack

    from kvcr import DURATION_METRIC, TRANSFER_BLOCKS_METRIC, TRANSFER_BYTES_METRIC
    from kvcr.telemetry import FUNNEL

    known = set(FUNNEL) | {f"control_{t}" for t in m.TYPES} | {"notification", "hint_age"}
    known |= {"local_fill", "remote_deliver", "source_write", "transfer", "transfer_post"}
    known |= {"peer_setup", "framework_pin_wait"}
    world, a, b = telemetry_pair()

    def labels(*sides) -> set[tuple[str, ...]]:
        return {k for side in sides for h in (side.histograms, side.counters) for k in h}

    async with a.running(), b.running():
        await share(a, b, [0])
        sender = world.hub.channel("tcp://mallory:1")
        for kind in ("nonsense", "pull2", "x" * 300):
            sender.send(b.endpoint, msgpack.packb({"v": 1, "t": kind, "sender": "tcp://m:1"}))
        sender.send(a.endpoint, b"\x00garbage")
        sender.send(b.endpoint, m.encode(m.Over("tcp://mallory:1", 5, 77, "x")))
        await b.deliver([(0, 10)], request_id="r")
        await trio.sleep(0.01)
        first = a.kv.get_stats(), b.kv.get_stats()
        assert b.runtime.plane.dropped["bad_message"] == 3  # the unknown types, each dropped
        seen = labels(*first)
        for i in range(20):
            b.kv.submit_hint(b.hint(a, [0]), request_id=f"req-{i}")
            await b.deliver([(0, 11 + i % 4)], request_id=f"req-{i}")
        await trio.sleep(0.01)
        later = a.kv.get_stats(), b.kv.get_stats()

    assert labels(*later) <= seen
    for side in first + later:
        for (name, (scope, *result)), values in side.histograms.items():
            assert name == DURATION_METRIC and scope in known, scope
            assert result[0] in ("success", "partial", "failed")
            assert all(0 <= v < 10 for v in values)
        for name, (scope,) in side.counters:
            assert name in (TRANSFER_BLOCKS_METRIC, TRANSFER_BYTES_METRIC) and scope in known


async def test_a_handler_that_fails_is_timed_as_failed_and_logged(autojump_clock, monkeypatch):
    """A bug in one message's handler (injected: the source's Confirm handler raises) is
    the failure path of ``control_<type>``: timed ``failed``, logged, and the instance goes
    on serving."""
    from kvcr import DURATION_METRIC
    from kvcr.runtime.source import Source

    def broken(self, msg):
        raise RuntimeError("a bug")

    monkeypatch.setattr(Source, "on_confirm", broken)
    world, a, b = telemetry_pair()
    async with a.running(), b.running():
        await share(a, b, [0])
        sender = world.hub.channel("tcp://mallory:1")
        with capture_events() as events:
            sender.send(a.endpoint, m.encode(m.Confirm("tcp://mallory:1", 5, 77, [0])))
            await trio.sleep(0.01)
            entries = await b.deliver([(0, 10)], request_id="r")
        assert statuses(entries) == {key(0): "SUCCESS"}
        src = a.kv.get_stats()

    [failed] = [e for e in events if e["event"] == "peer_handler_failed"]
    assert failed["type"] == "confirm" and "a bug" in failed["error"]
    assert len(src.histograms[(DURATION_METRIC, ("control_confirm", "failed"))]) == 1
    assert len(src.histograms[(DURATION_METRIC, ("control_pull", "success"))]) == 1
