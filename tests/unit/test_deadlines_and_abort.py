"""Deadlines, abort and transfer faults, on the fake transport under trio's MockClock.

The runtime runs inside the test's trio loop (``kvcr_in_loop``) with a clock that jumps
whenever every task is blocked, so a 1 s operation deadline takes no real time and happens
the same way every run. The fake transport copies real bytes, but only when a transfer
finishes, and can delay, fail, refuse or never finish a transfer.
"""

from __future__ import annotations

import contextlib

import pytest
import trio

from engine_sim import EngineSim, Recorder, key
from kvcr.testing import kvcr_in_loop
from kvcr.transport.fake import NEVER, Behavior, FakeTransport
from kvcr.types import CacheTier, QueryStatus, TransferError

HIT = (QueryStatus.HIT, CacheTier.LOCAL_G2)
FETCHING = (QueryStatus.FETCHING, CacheTier.LOCAL_G2)
MISS = (QueryStatus.MISS, None)


class World:
    """An engine, its recorder, a fake transport and an in-loop KVCR."""

    def __init__(self, **engine_kw) -> None:
        self.engine = EngineSim(operation_timeout_ms=1000, abandon_timeout_ms=3000, **engine_kw)
        self.recorder = Recorder()
        self.fake = FakeTransport(self.engine.name, trio.current_time)

    @contextlib.asynccontextmanager
    async def open(self):
        async with kvcr_in_loop(
            self.engine.config,
            self.recorder.bindings(),
            self.engine.backend_configs,
            lambda: self.fake,
        ) as opened:
            self.runtime = opened.runtime
            yield opened.kv

    async def settle(self) -> None:
        """Let the runtime process everything that is runnable right now."""
        await trio.testing.wait_all_tasks_blocked()

    def free_slots(self, kv) -> int:
        return self.runtime.index.free_keys

    def events(self) -> list[tuple[int, str]]:
        return [(e.op_handle, e.state) for e in self.recorder.resilience]


async def test_deposit_past_the_operation_deadline_fails_and_holds_its_slot(autojump_clock):
    world = World(pool_blocks=1)
    async with world.open() as kv:
        world.fake.script.append(NEVER)
        start = trio.current_time()
        handle = kv.deposit(world.engine.blocks([(key(0), 0)]))
        await world.settle()
        assert kv.query([key(0)]) == [FETCHING]

        entries = await world.engine.await_op(kv, handle, 1)

        assert world.engine.statuses(entries) == {key(0): "FAILED"}
        assert trio.current_time() - start == pytest.approx(1.0, abs=0.01)
        assert kv.query([key(0)]) == [MISS]
        # The source may still be read: the engine is told before it sees FAILED.
        assert world.events() == [(handle, "uncertain")]
        error = world.recorder.resilience[0]
        assert isinstance(error, TransferError)
        assert error.source_blocks == (key(0),) and error.source_owners == ("framework",)
        # The slot stays quarantined: a new deposit finds no room.
        other = kv.deposit(world.engine.blocks([(key(1), 1)]))
        assert world.engine.statuses(await world.engine.await_op(kv, other, 1)) == {
            key(1): "FAILED"
        }
        assert world.recorder.capacity == [[("", 1)]]

        (stuck,) = world.fake.in_flight()
        world.fake.finish(stuck)
        await trio.sleep(0.01)
        kv.poll_completed()

        assert world.events() == [(handle, "uncertain"), (handle, "quiesced")]
        assert world.free_slots(kv) == 1
        again = kv.deposit(world.engine.blocks([(key(1), 1)]))
        assert world.engine.statuses(await world.engine.await_op(kv, again, 1)) == {
            key(1): "SUCCESS"
        }


async def test_a_late_success_never_turns_a_failure_into_a_success(autojump_clock):
    world = World()
    async with world.open() as kv:
        world.fake.script.append(Behavior(delay=2.0))
        handle = kv.deposit(world.engine.blocks([(key(0), 0)]))
        entries = await world.engine.await_op(kv, handle, 1)
        assert world.engine.statuses(entries) == {key(0): "FAILED"}

        await trio.sleep(1.5)  # the transfer completes at 2.0 s
        kv.poll_completed()

        assert world.fake.posted[0].state.value == "DONE"
        assert kv.query([key(0)]) == [MISS]
        assert world.free_slots(kv) == 8
        assert world.events() == [(handle, "uncertain"), (handle, "quiesced")]


async def test_deliver_past_the_deadline_reports_destination_memory_uncertain(autojump_clock):
    world = World()
    async with world.open() as kv:
        world.engine.write(0, seed=1)
        done = kv.deposit(world.engine.blocks([(key(0), 0)]))
        await world.engine.await_op(kv, done, 1)
        world.fake.script.append(NEVER)

        handle = kv.deliver(world.engine.blocks([(key(0), 5)]))
        entries = await world.engine.await_op(kv, handle, 1)

        assert world.engine.statuses(entries) == {key(0): "FAILED"}
        (error,) = world.recorder.resilience
        assert error.state == "uncertain"
        assert error.destination_owner == "framework"
        assert error.destination_regions == tuple(world.engine.refs(5))
        # The block stays claimed by the stuck transfer: it cannot be evicted meanwhile.
        assert world.runtime.index.get(key(0)).claims == 1

        world.fake.finish(world.fake.in_flight()[0])
        await trio.sleep(0.01)
        kv.poll_completed()
        assert world.events()[-1] == (handle, "quiesced")
        assert world.runtime.index.get(key(0)).claims == 0


async def test_a_failed_transfer_fails_its_entries_and_frees_memory(autojump_clock):
    world = World()
    async with world.open() as kv:
        world.fake.script.append(Behavior(delay=0.1, fail=True))
        handle = kv.deposit(world.engine.blocks([(key(0), 0), (key(1), 1)]))
        entries = await world.engine.await_op(kv, handle, 2)

        assert set(world.engine.statuses(entries).values()) == {"FAILED"}
        assert kv.query([key(0), key(1)]) == [MISS, MISS]
        assert world.free_slots(kv) == 8
        assert world.events() == []  # nothing was left in flight


async def test_a_refused_transfer_fails_its_entries(autojump_clock):
    world = World()
    async with world.open() as kv:
        world.fake.script.append(Behavior(refuse=True))
        handle = kv.deposit(world.engine.blocks([(key(0), 0)]))
        entries = await world.engine.await_op(kv, handle, 1)
        assert world.engine.statuses(entries) == {key(0): "FAILED"}
        assert world.free_slots(kv) == 8


async def test_abort_fails_pending_entries_at_once_and_holds_memory_until_terminal(autojump_clock):
    world = World(pool_blocks=2)
    async with world.open() as kv:
        world.fake.script.append(NEVER)
        handle = kv.deposit(world.engine.blocks([(key(0), 0), (key(1), 1)]))
        await world.settle()

        assert kv.abort(handle) is True
        entries = await world.engine.await_op(kv, handle, 2, timeout=0.01)

        assert set(world.engine.statuses(entries).values()) == {"FAILED"}
        assert kv.query([key(0), key(1)]) == [MISS, MISS]
        assert world.events() == [(handle, "uncertain")]
        assert world.free_slots(kv) == 0
        assert kv.abort(handle) is False  # nothing left to cancel

        world.fake.finish(world.fake.in_flight()[0])
        await trio.sleep(0.01)
        kv.poll_completed()
        assert world.free_slots(kv) == 2
        assert kv.query([key(0), key(1)]) == [MISS, MISS]  # aborted data is never committed
        assert world.events()[-1] == (handle, "quiesced")


async def test_abort_of_some_keys_leaves_the_rest_of_the_operation_alone(autojump_clock):
    world = World()
    async with world.open() as kv:
        world.fake.script.append(Behavior(delay=0.5))
        handle = kv.deposit(world.engine.blocks([(key(0), 0), (key(1), 1)]))
        await world.settle()

        assert kv.abort(handle, [key(1)]) is True
        assert kv.abort(handle, [key(7)]) is False  # not part of the operation
        entries = await world.engine.await_op(kv, handle, 2)

        assert world.engine.statuses(entries) == {key(0): "SUCCESS", key(1): "FAILED"}
        assert kv.query([key(0), key(1)]) == [HIT, MISS]


async def test_abort_never_breaks_shared_work(autojump_clock):
    """Deposit B of a key that deposit A is filling waits for A; when A is aborted, B fills
    the key from its own source instead of failing."""
    world = World()
    async with world.open() as kv:
        world.engine.write(0, seed=1)
        world.engine.write(1, seed=2)
        world.fake.script.append(NEVER)
        first = kv.deposit(world.engine.blocks([(key(0), 0)]))
        await world.settle()
        second = kv.deposit(world.engine.blocks([(key(0), 1)]))
        await world.settle()

        assert kv.abort(first)
        assert world.engine.statuses(await world.engine.await_op(kv, second, 1)) == {
            key(0): "SUCCESS"
        }
        assert world.engine.statuses(await world.engine.await_op(kv, first, 1)) == {
            key(0): "FAILED"
        }
        deliver = kv.deliver(world.engine.blocks([(key(0), 9)]))
        await world.engine.await_op(kv, deliver, 1)
        assert world.engine.checksum(9) == world.engine.checksum(1)


async def test_abort_of_unknown_or_finished_operations_is_false(autojump_clock):
    world = World()
    async with world.open() as kv:
        handle = kv.deposit(world.engine.blocks([(key(0), 0)]))
        await world.engine.await_op(kv, handle, 1)
        assert kv.abort(handle) is False
        assert kv.abort(12345) is False


async def test_close_fails_pending_operations_and_waits_for_transfers(autojump_clock):
    world = World()
    async with world.open() as kv:
        world.fake.script.append(Behavior(delay=0.5))
        handle = kv.deposit(world.engine.blocks([(key(0), 0)]))
        await world.settle()
    # Leaving the context closed the instance: the entry failed, and the transport was
    # closed only after its transfer finished.
    results = dict(kv.poll_completed())
    assert world.engine.statuses(results[handle]) == {key(0): "FAILED"}
    assert world.fake.closed
    assert not world.fake.in_flight()
