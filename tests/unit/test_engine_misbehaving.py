"""A source whose engine misbehaves in its callbacks (issue #14, bad input), on the fake
fabric under MockClock.

Worker ``a`` is the source, ``b`` the destination; ``a``'s engine holds key 3 in its region
(served through a pin) and key 0 in kvcr's pool. Whatever ``a``'s engine does wrong (a
callback that raises, a wrong type, a pin answered twice, an answer to a request never made,
a release it refuses for good), the pull ends with a truthful status, the failure is logged
naming the operation or the request, every pin granted is released exactly once, and the
source goes on serving the next pull. No callback ever raises out of ``poll_completed``.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from kvcr.logs import capture_events
from kvcr.types import BlockKey
from peer_world import EnginePins, Worker, World, key, share


def statuses(entries: dict) -> dict:
    return {k: v.status.value for k, v in entries.items()}


class RaisingRequest(EnginePins):
    def request_pin(self, keys: list[BlockKey]) -> int:
        raise RuntimeError("scheduler is shutting down")


class ReturnsNone(EnginePins):
    def request_pin(self, keys: list[BlockKey]) -> Any:
        super().request_pin(keys)
        return None


class PollsANumber(EnginePins):
    def poll_pin_results(self) -> Any:
        return 42


class AnswersTwice(EnginePins):
    """Every result is given again at the next poll."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.again: list[tuple[int, Any]] = []

    def poll_pin_results(self) -> list[tuple[int, Any]]:
        fresh = super().poll_pin_results()
        out, self.again = [*self.again, *fresh], fresh
        return out


class AnswersStrangers(EnginePins):
    """Each poll with a result also answers a request nobody made, with a pin of its own."""

    strangers = 0

    def poll_pin_results(self) -> list[tuple[int, Any]]:
        out = super().poll_pin_results()
        if out:
            self.strangers += 1
            handle = f"stranger-{self.strangers}"
            self.pinned.add(handle)
            out.append((900 + self.strangers, (handle, {key(3): self.engine.refs(3)})))
        return out


class NeverReleases(EnginePins):
    def release_pin(self, handle: str) -> bool:
        return False


class RaisingList(list):
    def append(self, item: Any) -> None:
        raise RuntimeError("router link down")


async def pull_pinned_then_pooled(a: Worker, b: Worker, world: World) -> tuple[dict, dict]:
    """Pull key 3 (only a's engine holds it) twice, then key 0 (in a's kvcr pool)."""
    a.engine.write(3, seed=3)
    a.pins.engine_has = {key(3): 3}
    await share(a, b, [0])
    b.kv.submit_hint(b.hint(a, [3]), request_id="pinned")
    pinned = statuses(await b.deliver([(3, 13)], request_id="pinned"))
    await trio.sleep(0.1)  # the first pin goes back
    b.kv.submit_hint(b.hint(a, [3]), request_id="pinned again")
    again = statuses(await b.deliver([(3, 14)], request_id="pinned again"))
    assert again == pinned  # a misbehaving engine misbehaves every time
    pooled = statuses(await b.deliver([(0, 10)], request_id="r"))
    await trio.sleep(0.1)  # releases are made at the engine's next polls
    return pinned, pooled


CASES = [
    pytest.param(RaisingRequest, "FAILED", "request_pin_failed", id="request_pin-raises"),
    pytest.param(ReturnsNone, "FAILED", "request_pin_failed", id="request_pin-returns-none"),
    pytest.param(PollsANumber, "FAILED", "poll_pin_results_failed", id="poll-returns-a-number"),
    pytest.param(AnswersTwice, "SUCCESS", "pin_result_repeated", id="answers-twice"),
    pytest.param(AnswersStrangers, "SUCCESS", "pin_result_unknown", id="unknown-request-id"),
]


@pytest.mark.parametrize(("pins", "pinned_status", "logged"), CASES)
async def test_a_misbehaving_engine_gets_truthful_answers_and_the_source_keeps_serving(
    autojump_clock: Any, pins: type, pinned_status: str, logged: str
) -> None:
    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")
    a.pins = pins(a.engine)
    with capture_events() as events:
        async with a.running(), b.running():
            pinned, pooled = await pull_pinned_then_pooled(a, b, world)
            assert not a.runtime.audit()

    assert pinned == {key(3): pinned_status}
    assert pooled == {key(0): "SUCCESS"}
    assert any(e["event"] == logged for e in events)
    failed = [e for e in events if e["event"] == "request_pin_failed"]
    assert all(e["op"].startswith("source write ") for e in failed)
    # Every pin the engine granted went back exactly once; nothing stays pinned.
    assert sorted(a.pins.released) == sorted(set(a.pins.released))
    assert not a.pins.pinned


async def test_a_release_refused_for_good_is_reported_and_the_source_keeps_serving(
    autojump_clock: Any,
) -> None:
    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")
    a.pins = NeverReleases(a.engine)
    with capture_events() as events:
        async with b.running(), a.running():
            pinned, pooled = await pull_pinned_then_pooled(a, b, world)
            await trio.sleep(10)  # ten refusals by now
            assert a.runtime.pins.outstanding == 2
            # The source closes anyway (first), telling which pins are still out.

    assert (pinned, pooled) == ({key(3): "SUCCESS"}, {key(0): "SUCCESS"})
    refused = [e for e in events if e["event"] == "pin_release_refused"]
    assert sorted(e["handle"] for e in refused) == ["pin-1", "pin-2"]
    assert all(e["op"].startswith("source write ") for e in refused)
    [kept] = [e for e in events if e["event"] == "pins_not_released"]
    assert kept["handles"] == ["pin-1", "pin-2"]


async def test_an_inventory_sink_that_raises_is_logged_and_deposits_still_succeed(
    autojump_clock: Any,
) -> None:
    world = World()
    a = Worker(world, "a")

    a.recorder.inventory = RaisingList()
    with capture_events() as events:
        async with a.running():
            assert await a.deposit([(0, 0), (1, 1)]) == {key(0): "SUCCESS", key(1): "SUCCESS"}
            assert await a.deposit([(2, 2)]) == {key(2): "SUCCESS"}

    failures = [e for e in events if e["event"] == "engine_callback_failed"]
    assert [e["callback"] for e in failures] == ["inventory_sink", "inventory_sink"]
    assert "router link down" in failures[0]["error"]
