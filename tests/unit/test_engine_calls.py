"""How the runtime's calls reach the engine (``kvcr.runtime.engine_calls``, contract section 4).

The runtime queues what it needs; ``EngineSide.serve`` makes the calls on the thread that
serves (inside the engine's ``poll_completed``, ``get_stats`` or ``close``), in order, one
thread at a time, and a callback that raises is logged without stopping the calls after it.
Pins themselves (tickets, results, retries) are ``test_pins.py``.
"""

from __future__ import annotations

import threading
import types

import pytest

from kvcr.runtime.engine_calls import (
    EngineCalls,
    EngineSide,
    PinAnswered,
    Released,
    ReleasePin,
    RequestPin,
)
from kvcr.runtime.inbox import Inbox
from kvcr.telemetry import DURATION_METRIC, InMemoryStats, Telemetry
from kvcr.types import BlockKey, CacheTier, InventoryEvent, TransferError

K1 = BlockKey(b"k1")
ALL = frozenset({"inventory_sink", "capacity_needed_callback", "on_resilience_event"})


class Log:
    def __init__(self):
        self.events: list[tuple[str, str, dict]] = []

    def __getattr__(self, level):
        return lambda event, **fields: self.events.append((level, event, fields))

    def named(self, event):
        return [(level, fields) for level, name, fields in self.events if name == event]


class Engine:
    """Bindings that record every call with the thread it came on, in one plain list."""

    def __init__(self):
        self.calls: list[tuple[str, object, int]] = []
        self.results: list[tuple[object, object]] = []
        self.sink_error: Exception | None = None

    def _record(self, name, value):
        self.calls.append((name, value, threading.get_ident()))

    def request_pin(self, keys):
        self._record("request_pin", keys)
        return len(self.calls)

    def poll_pin_results(self):
        self._record("poll_pin_results", None)
        results, self.results = self.results, []
        return results

    def release_pin(self, handle):
        self._record("release_pin", handle)
        return True

    cancel_pin_request = None

    def inventory_sink(self, event):
        self._record("inventory_sink", event)
        if self.sink_error is not None:
            raise self.sink_error

    def capacity_needed_callback(self, pools):
        self._record("capacity_needed_callback", pools)

    def on_resilience_event(self, error):
        self._record("on_resilience_event", error)

    def names(self):
        return [name for name, _, _ in self.calls]


def bridge(engine, present=ALL, also=lambda: None):
    log = Log()
    calls, answers = EngineCalls(present, log), Inbox()
    return calls, EngineSide(engine, calls, answers, log, also=also), answers, log


def poll(side: EngineSide) -> bool:
    """What an engine's poll does: make the calls if it is this thread's turn."""
    with side.turn() as mine:
        if mine:
            side.serve()
        return mine


def taken(answers: Inbox) -> list:
    """What the engine side handed back (the runtime's inbox, read without a loop)."""
    return [item for batch in answers.take_now() for item in batch]


EVENT = InventoryEvent((K1,), CacheTier.LOCAL_G2, False)
ERROR = TransferError("deliver op 1: failed", 1, state="uncertain")


def test_nothing_is_called_until_the_engine_serves_and_then_everything_in_order() -> None:
    engine = Engine()
    calls, side, answers, _ = bridge(engine)
    calls.inventory(EVENT)
    calls.put(RequestPin(1, (K1,)))
    calls.capacity_needed([("kv", 3)])
    calls.resilience(ERROR)
    calls.put(ReleasePin(2, "h"))
    assert engine.calls == []

    poll(side)

    assert engine.names() == [
        "inventory_sink",
        "request_pin",
        "capacity_needed_callback",
        "on_resilience_event",
        "release_pin",
        "poll_pin_results",  # a request made in this serve is polled right after the calls
    ]
    assert {ident for _, _, ident in engine.calls} == {threading.get_ident()}
    assert taken(answers) == [Released(2, True)]  # a request made answers only if it failed


def test_the_calls_run_on_whichever_thread_serves() -> None:
    engine = Engine()
    calls, side, _, _ = bridge(engine)
    calls.inventory(EVENT)

    worker = threading.Thread(target=poll, args=(side,), name="engine")
    worker.start()
    worker.join()

    assert [ident for _, _, ident in engine.calls] == [worker.ident]


def test_a_second_thread_does_not_serve_while_one_is_inside_a_callback() -> None:
    engine = Engine()
    calls, side, _, _ = bridge(engine)
    inside, leave = threading.Event(), threading.Event()

    def slow_sink(event):
        engine._record("inventory_sink", event)
        inside.set()
        leave.wait(10)

    engine.inventory_sink = slow_sink
    calls.inventory(EVENT)
    calls.inventory(InventoryEvent((K1,), CacheTier.LOCAL_G2, True))
    first = threading.Thread(target=poll, args=(side,))
    first.start()
    assert inside.wait(10)

    assert poll(side) is False  # another engine thread polls meanwhile: it returns at once
    assert engine.names() == ["inventory_sink"]

    leave.set()
    first.join()
    assert engine.names() == ["inventory_sink", "inventory_sink"]
    assert {ident for _, _, ident in engine.calls} == {first.ident}


def test_a_callback_calling_back_into_kvcr_does_not_serve_again() -> None:
    engine = Engine()
    calls, side, _, _ = bridge(engine)

    def reentrant_sink(event):
        engine._record("inventory_sink", event)
        assert poll(side) is False  # say, the sink polls KVCR: not this thread's turn again

    engine.inventory_sink = reentrant_sink
    calls.inventory(EVENT)
    calls.capacity_needed([("kv", 1)])

    poll(side)

    assert engine.names() == ["inventory_sink", "capacity_needed_callback"]


def test_a_raising_callback_is_logged_and_the_calls_after_it_are_made() -> None:
    engine = Engine()
    engine.sink_error = RuntimeError("sink full")
    calls, side, _, log = bridge(engine)
    calls.inventory(EVENT)
    calls.capacity_needed([("kv", 1)])

    poll(side)

    assert engine.names() == ["inventory_sink", "capacity_needed_callback"]
    [(level, fields)] = log.named("engine_callback_failed")
    assert level == "error" and fields["callback"] == "inventory_sink"
    assert "sink full" in fields["error"]


def test_bindings_the_engine_did_not_give_get_nothing_queued() -> None:
    engine = Engine()
    calls, _, _, log = bridge(engine, present=frozenset())

    calls.inventory(EVENT)
    calls.capacity_needed([("kv", 1)])
    calls.resilience(ERROR)

    assert not calls.queue
    # Without on_resilience_event the contract's default applies: the event is logged.
    [(level, fields)] = log.named("resilience_event")
    assert level == "warning" and fields["kind"] == "TransferError"


def test_pin_results_are_polled_only_while_a_request_made_here_waits() -> None:
    engine = Engine()
    calls, side, answers, _ = bridge(engine)
    poll(side)
    assert engine.calls == []

    calls.put(RequestPin(7, (K1,)))
    poll(side)
    poll(side)
    assert engine.names() == ["request_pin", "poll_pin_results", "poll_pin_results"]

    engine.results = [(1, ("h", {K1: None}))]
    poll(side)
    poll(side)
    assert engine.names().count("poll_pin_results") == 3
    assert taken(answers)[-1] == PinAnswered(7, 1, ("h", {K1: None}))
    assert not side.polling


def test_an_answer_to_a_request_answered_before_says_it_is_repeated() -> None:
    engine = Engine()
    calls, side, answers, _ = bridge(engine)
    calls.put(RequestPin(7, (K1,)))
    calls.put(RequestPin(8, (K1,)))  # keeps the engine side polling
    engine.results = [(1, "first"), (1, "again"), (99, "stranger")]

    poll(side)

    assert taken(answers) == [
        PinAnswered(7, 1, "first"),
        PinAnswered(None, 1, "again", repeated=True, earlier="first"),
        PinAnswered(None, 99, "stranger", repeated=False),
    ]


@pytest.mark.parametrize(
    "results",
    [pytest.param(42, id="not-iterable"), pytest.param(None, id="none")],
)
def test_poll_pin_results_returning_no_list_is_logged(results) -> None:
    engine = Engine()
    engine.poll_pin_results = lambda: results
    calls, side, _, log = bridge(engine)
    calls.put(RequestPin(7, (K1,)))

    poll(side)

    [(level, _)] = log.named("poll_pin_results_failed")
    assert level == "warning"
    assert side.polling  # asked again at the next poll


def test_telemetry_samples_reach_the_engines_stats_only_when_it_serves() -> None:
    calls_seen: list[int] = []

    class Stats(InMemoryStats):
        def observe_histogram(self, *args):
            calls_seen.append(threading.get_ident())
            super().observe_histogram(*args)

    telemetry = Telemetry(Stats, dict)
    _, side, _, _ = bridge(Engine(), also=telemetry.flush)

    recorder = threading.Thread(target=telemetry.record, args=("transfer", 0.5, "success"))
    recorder.start()  # the runtime thread records
    recorder.join()
    assert calls_seen == []

    poll(side)
    stats = telemetry.snapshot()

    assert calls_seen == [threading.get_ident()]
    assert stats.histograms[(DURATION_METRIC, ("transfer", "success"))] == [0.5]


def test_a_stats_object_that_raises_is_logged_and_get_stats_still_answers() -> None:
    class Broken(InMemoryStats):
        def observe_histogram(self, *args):
            raise RuntimeError("registry closed")

    log = Log()
    telemetry = Telemetry(Broken, lambda: {"local_g2_blocks": 1}, log)
    telemetry.record("transfer", 0.5, "success")

    stats = telemetry.snapshot()

    assert isinstance(stats, Broken)
    [(level, fields)] = log.named("engine_callback_failed")
    assert level == "error" and fields["callback"] == "stats"


def test_a_release_the_engine_refuses_says_what_it_answered() -> None:
    engine = types.SimpleNamespace(
        release_pin=lambda handle: None, request_pin=None, poll_pin_results=None
    )
    calls, side, answers, _ = bridge(engine)
    calls.put(ReleasePin(3, "h"))

    poll(side)

    assert taken(answers) == [Released(3, False, "returned None")]


def test_results_a_poll_yielded_before_it_raised_still_count() -> None:
    engine = Engine()

    def flaky_poll():
        yield (1, ("h", {K1: None}))
        raise RuntimeError("engine busy")

    engine.poll_pin_results = flaky_poll
    calls, side, answers, log = bridge(engine)
    calls.put(RequestPin(7, (K1,)))

    poll(side)

    assert taken(answers) == [PinAnswered(7, 1, ("h", {K1: None}))]
    assert log.named("poll_pin_results_failed")


def test_a_call_interrupted_by_keyboardinterrupt_is_made_again_at_the_next_poll() -> None:
    engine = Engine()
    interrupted = []

    def release_pin(handle):
        engine._record("release_pin", handle)
        if not interrupted:
            interrupted.append(handle)
            raise KeyboardInterrupt
        return True

    engine.release_pin = release_pin
    calls, side, answers, _ = bridge(engine)
    calls.put(ReleasePin(3, "h"))
    calls.inventory(EVENT)

    with pytest.raises(KeyboardInterrupt):
        poll(side)
    poll(side)

    assert engine.names() == ["release_pin", "release_pin", "inventory_sink"]
    assert taken(answers) == [Released(3, True)]
