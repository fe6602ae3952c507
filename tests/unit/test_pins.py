"""Behaviour of engine pins (``kvcr.runtime.pins``, bindings 1-4 of contract section 4).

The runtime side (``Pins``) decides; the engine's side (``EngineSide.serve``) makes the calls,
and only when the engine polls. Here the engine is a task that serves every ``STEP_S``, like
a scheduler loop. Read top to bottom: nothing reaches the engine until it polls; which pin
results are usable and what happens to the handle of one that is not; answers the engine
should not give (twice, for a request never made); how releases are retried until the
engine says True (and never after); what cancelling a waiting caller does; and what polling
costs. Time is trio's MockClock (``autojump_clock``), so every interval is exact.
"""

from __future__ import annotations

import itertools
import types

import pytest
import trio

from kvcr.runtime import pins as pins_module
from kvcr.runtime.engine_calls import EngineCalls, EngineSide
from kvcr.runtime.inbox import Inbox
from kvcr.runtime.pins import Pin, Pins
from kvcr.types import BlockKey, MemoryRef

K1, K2, K3 = BlockKey(b"key-1"), BlockKey(b"key-2"), BlockKey(b"key-3")
REF = MemoryRef(end_point_name="engine-agent", label="kv", element_index=3)
PENDING = object()  # the engine has not answered (yet)
STEP_S = 0.001  # the engine's scheduler cadence
# For tests that wait out minutes of mock time: a step costs real time, not mock time.
SLOW_STEP_S = 0.01


class FakeEngine:
    """The four pin bindings of an engine, scripted by the test, in plain lists.

    ``answer(request, keys)`` gives the result queued when a request arrives (``PENDING``
    for none: the test calls ``respond`` later). ``release_answers`` are returned (or raised)
    by successive ``release_pin`` calls; once used up every release is accepted.
    """

    def __init__(self, answer=lambda request, keys: PENDING, release_answers=()):
        self.answer = answer
        self.release_answers = list(release_answers)
        self.requests: list[list[BlockKey]] = []
        self.ready: list[tuple[object, object]] = []
        self.polls = 0
        self.poll_failures = 0  # how many of the next polls raise
        self.request_error: Exception | None = None
        self.request_ids = itertools.count(1)
        self.release_calls: list[tuple[float, str]] = []  # (time, handle)
        self.released: list[str] = []  # handles whose release was accepted
        self.cancelled: list[int] = []
        self.serving = False  # set by the engine loop around each serve
        self.step_s = STEP_S  # the scheduler's cadence

    def _called(self):
        assert self.serving, "an engine binding was called outside the engine's poll"

    def request_pin(self, keys):
        self._called()
        if self.request_error is not None:
            raise self.request_error
        self.requests.append(keys)
        request = next(self.request_ids)
        result = self.answer(request, keys)
        if result is not PENDING:
            self.respond(request, result)
        return request

    def respond(self, request, result):
        self.ready.append((request, result))

    def poll_pin_results(self):
        self._called()
        self.polls += 1
        if self.poll_failures:
            self.poll_failures -= 1
            raise RuntimeError("engine busy")
        ready, self.ready = self.ready, []
        return ready

    def release_pin(self, handle):
        self._called()
        self.release_calls.append((trio.current_time(), handle))
        answer = self.release_answers.pop(0) if self.release_answers else True
        if isinstance(answer, BaseException):
            raise answer
        if answer is True:
            self.released.append(handle)
        return answer

    def cancel_pin_request(self, request):
        self._called()
        self.cancelled.append(request)

    def call_offsets(self, since):
        """When ``release_pin`` was called, in seconds after ``since``."""
        return [round(t - since, 9) for t, _ in self.release_calls]


class FakeLog:
    """Records ``(level, event, fields)`` for every log call."""

    def __init__(self):
        self.events: list[tuple[str, str, dict]] = []

    def __getattr__(self, level):
        def record(event, **fields):
            self.events.append((level, event, fields))

        return record

    def named(self, event):
        return [(level, fields) for level, name, fields in self.events if name == event]


def pin_everything(handle="h"):
    """An engine answer that pins every requested key."""
    return lambda request, keys: (handle, {key: [REF] for key in keys})


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def log():
    return FakeLog()


class Scheduler:
    """The engine's loop: serve KVCR's calls every ``STEP_S`` while ``running``."""

    def __init__(self, engine, side):
        self.engine = engine
        self.side = side
        self.running = True

    async def run(self):
        while True:
            if self.running:
                self.engine.serving = True
                try:
                    with self.side.turn() as mine:
                        assert mine
                        self.side.serve()
                finally:
                    self.engine.serving = False
            await trio.sleep(self.engine.step_s)


def start_pins(nursery, engine, log, *, with_cancel=True):
    """Pins over the fake engine, its ``run`` task and the engine's loop started in
    ``nursery``; the returned pins carry the loop as ``scheduler``."""
    bindings = types.SimpleNamespace(
        request_pin=engine.request_pin,
        poll_pin_results=engine.poll_pin_results,
        release_pin=engine.release_pin,
        cancel_pin_request=engine.cancel_pin_request if with_cancel else None,
    )
    present = frozenset({"cancel_pin_request"} if with_cancel else ())
    calls, answers = EngineCalls(present, log), Inbox()
    pins = Pins(calls, answers, log)
    pins.scheduler = Scheduler(engine, EngineSide(bindings, calls, answers, log))
    nursery.start_soon(pins.run)
    nursery.start_soon(pins.scheduler.run)
    return pins


@pytest.fixture
def pins(nursery, engine, log):
    return start_pins(nursery, engine, log)


async def in_background(nursery, pins, keys):
    """Start ``pins.pin(keys)`` in the background and return once its request is out; the
    returned list receives the pin (or None)."""
    outcome = []

    async def wait_for_pin():
        outcome.append(await pins.pin(keys))

    waiting = pins.outstanding
    nursery.start_soon(wait_for_pin)
    while pins.outstanding == waiting:
        await trio.sleep(0)
    await trio.sleep(2 * STEP_S)  # the engine's next poll made the request
    return outcome


# --- only the engine's poll calls the engine -------------------------------------------------


async def test_nothing_reaches_the_engine_until_it_polls(autojump_clock, pins, engine, nursery):
    engine.answer = pin_everything("h1")
    pins.scheduler.running = False  # the engine is busy: no poll for a while
    outcome = await in_background(nursery, pins, [K1])
    await trio.sleep(1)
    assert engine.requests == [] and outcome == []

    pins.scheduler.running = True
    await trio.sleep(2 * STEP_S)

    assert engine.requests == [[K1]]
    assert outcome[0].handle == "h1"


async def test_an_engine_that_pins_within_its_poll_answers_in_that_poll(
    autojump_clock, pins, engine
):
    engine.answer = pin_everything("h1")
    start = trio.current_time()

    pin = await pins.pin([K1])

    assert pin.handle == "h1"
    assert engine.polls == 1  # right after the request, in the same poll
    assert trio.current_time() - start <= STEP_S


async def test_an_engine_that_pins_in_its_own_step_answers_at_its_next_poll(
    autojump_clock, pins, engine, nursery
):
    outcome = await in_background(nursery, pins, [K1])
    engine.respond(1, ("h1", {K1: [REF]}))  # the engine's step after the request

    await trio.sleep(2 * STEP_S)

    assert outcome[0].handle == "h1"


# --- which results are usable --------------------------------------------------------------


async def test_a_result_naming_exactly_the_keys_is_returned_as_the_pin(
    autojump_clock, pins, engine
):
    engine.answer = pin_everything("h1")

    pin = await pins.pin([K1, K2])

    assert engine.requests == [[K1, K2]]
    assert pin.handle == "h1"
    assert pin.refs == {K1: [REF], K2: [REF]}
    assert engine.release_calls == []  # the caller releases it when its transfer is over
    assert pins.outstanding == 0


async def test_one_non_none_entry_is_enough_for_a_usable_pin(autojump_clock, pins, engine):
    engine.answer = lambda request, keys: ("h1", {K1: None, K2: [REF], K3: None})

    pin = await pins.pin([K1, K2, K3])

    assert pin.refs == {K1: None, K2: [REF], K3: None}
    assert engine.release_calls == []


async def test_the_order_of_the_keys_in_the_result_does_not_matter(autojump_clock, pins, engine):
    engine.answer = lambda request, keys: ("h1", {K2: [REF], K1: [REF]})

    pin = await pins.pin([K1, K2])

    assert pin.handle == "h1"


UNUSABLE_WITH_A_HANDLE = [
    pytest.param(("h1", {K1: [REF], K3: [REF]}), id="other-keys"),
    pytest.param(("h1", {K1: [REF]}), id="a-key-missing"),
    pytest.param(("h1", {K1: [REF], K2: [REF], K3: [REF]}), id="an-extra-key"),
    pytest.param(("h1", {}), id="no-keys"),
    pytest.param(("h1", {K1: None, K2: None}), id="all-none"),
    pytest.param(("h1", [(K1, [REF]), (K2, [REF])]), id="refs-not-a-mapping"),
    pytest.param(("h1", None), id="refs-none"),
]


@pytest.mark.parametrize("result", UNUSABLE_WITH_A_HANDLE)
async def test_an_unusable_result_is_a_miss_and_its_handle_is_released(
    autojump_clock, pins, engine, log, result
):
    engine.answer = lambda request, keys: result

    assert await pins.pin([K1, K2]) is None

    await trio.sleep(1)
    assert engine.released == ["h1"]
    assert [fields for _, fields in log.named("pin_result_unused")] == [
        {"op": "", "request": 1, "late": False}
    ]
    assert pins.outstanding == 0


async def test_an_unusable_result_whose_release_is_refused_is_released_later(
    autojump_clock, pins, engine
):
    engine.answer = lambda request, keys: ("h1", {K1: None})
    engine.release_answers = [False, False]

    assert await pins.pin([K1]) is None

    await trio.sleep(1)
    assert [handle for _, handle in engine.release_calls] == ["h1"] * 3
    assert engine.released == ["h1"]


async def test_none_is_a_miss_with_nothing_to_release(autojump_clock, pins, engine):
    engine.answer = lambda request, keys: None

    assert await pins.pin([K1, K2]) is None

    await trio.sleep(1)
    assert engine.release_calls == []


@pytest.mark.parametrize(
    "result",
    [
        pytest.param((), id="empty-tuple"),
        pytest.param(("h1",), id="handle-only"),
        pytest.param(("h1", {K1: [REF]}, "extra"), id="three-items"),
        pytest.param(["h1", {K1: [REF]}], id="a-list-not-a-tuple"),
        pytest.param("h1", id="a-bare-handle"),
        pytest.param({K1: [REF]}, id="refs-without-handle"),
        pytest.param((["unhashable"], {K1: [REF]}), id="an-unhashable-handle"),
    ],
)
async def test_a_malformed_result_is_a_miss(autojump_clock, pins, engine, result):
    engine.answer = lambda request, keys: result

    assert await pins.pin([K1]) is None
    assert pins.outstanding == 0


async def test_a_result_whose_handle_is_none_is_a_miss(autojump_clock, pins, engine):
    engine.answer = lambda request, keys: (None, {K1: [REF]})

    assert await pins.pin([K1]) is None


async def test_results_for_several_waiters_in_one_poll_go_to_each(
    autojump_clock, pins, engine, nursery
):
    first = await in_background(nursery, pins, [K1])
    second = await in_background(nursery, pins, [K2, K3])
    engine.respond(2, ("h2", {K2: [REF], K3: None}))
    engine.respond(1, ("h1", {K1: [REF]}))

    await trio.sleep(1)

    assert (first[0].handle, second[0].handle) == ("h1", "h2")
    assert engine.release_calls == []


async def test_a_poll_item_that_is_not_a_pair_is_skipped_and_logged(
    autojump_clock, pins, engine, log, nursery
):
    waiting = await in_background(nursery, pins, [K1])
    engine.ready = [("garbage",), ([1], "unhashable request"), (1, ("h1", {K1: [REF]}))]

    await trio.sleep(1)

    assert waiting[0].handle == "h1"
    assert len(log.named("pin_result_malformed")) == 2


# --- answers the engine should not give ------------------------------------------------------


async def test_a_result_for_a_request_never_made_is_released_and_logged(
    autojump_clock, pins, engine, log, nursery
):
    waiting = await in_background(nursery, pins, [K1])  # keeps polling going
    engine.respond(99, ("stray", {K2: [REF]}))

    await trio.sleep(1)

    assert engine.released == ["stray"]
    [(level, fields)] = log.named("pin_result_unknown")
    assert level == "warning" and fields == {"request": 99, "released": True}
    engine.respond(1, ("h1", {K1: [REF]}))
    await trio.sleep(1)
    assert waiting[0].handle == "h1"


async def test_a_second_answer_naming_a_held_pin_does_not_release_it(
    autojump_clock, pins, engine, log, nursery
):
    engine.answer = pin_everything("h1")
    pin = await pins.pin([K1])
    engine.answer = lambda request, keys: PENDING
    other = await in_background(nursery, pins, [K2])  # keeps polling going
    engine.respond(1, ("h1", {K1: [REF]}))  # request 1 again: a write may be reading h1

    await trio.sleep(1)
    assert engine.release_calls == []
    [(level, fields)] = log.named("pin_result_repeated")
    assert level == "warning" and fields["handle"] == "h1" and fields["released"] is False

    pins.release(pin)
    engine.respond(2, None)
    await trio.sleep(1)
    assert engine.released == ["h1"] and other == [None]  # once, by its holder


async def test_a_second_answer_with_another_handle_is_released(
    autojump_clock, pins, engine, log, nursery
):
    engine.answer = pin_everything("h1")
    await pins.pin([K1])
    engine.answer = lambda request, keys: PENDING
    await in_background(nursery, pins, [K2])  # keeps polling going
    engine.respond(1, ("h1-again", {K1: [REF]}))

    await trio.sleep(1)

    assert engine.released == ["h1-again"]
    [(_, fields)] = log.named("pin_result_repeated")
    assert fields["released"] is True


@pytest.mark.parametrize(
    ("request_id", "why"),
    [
        pytest.param(None, "None", id="none"),
        pytest.param(["not", "hashable"], "not a new request id", id="unhashable"),
    ],
)
async def test_request_pin_returning_no_usable_id_is_a_miss_and_is_logged(
    autojump_clock, engine, log, nursery, request_id, why
):
    engine.request_ids = itertools.repeat(request_id)
    pins = start_pins(nursery, engine, log)

    assert await pins.pin([K1]) is None

    [(level, fields)] = log.named("request_pin_failed")
    assert level == "warning" and why in fields["error"]
    assert engine.polls == 0 and pins.outstanding == 0


async def test_request_pin_repeating_an_unanswered_id_fails_the_second_request(
    autojump_clock, engine, log, nursery
):
    engine.request_ids = itertools.repeat(7)
    pins = start_pins(nursery, engine, log)
    first = await in_background(nursery, pins, [K1])

    assert await pins.pin([K2]) is None

    [(_, fields)] = log.named("request_pin_failed")
    assert "an unanswered request has it" in fields["error"]
    engine.respond(7, ("h7", {K1: [REF]}))
    await trio.sleep(1)
    assert first[0].handle == "h7"


# --- releases ------------------------------------------------------------------------------


async def test_a_pin_accepted_at_once_is_released_once(autojump_clock, pins, engine):
    engine.answer = pin_everything("h1")
    pin = await pins.pin([K1])

    pins.release(pin)
    await trio.sleep(10)

    assert [handle for _, handle in engine.release_calls] == ["h1"]
    assert pins.outstanding == 0


async def test_a_release_is_made_at_the_engines_next_poll(autojump_clock, pins, engine):
    engine.answer = pin_everything("h1")
    pin = await pins.pin([K1])
    start = trio.current_time()

    pins.release(pin)
    assert engine.release_calls == [] and pins.outstanding == 1
    await trio.sleep(1)

    assert 0 < engine.call_offsets(start)[0] <= STEP_S


async def test_a_refused_release_is_retried_after_10_ms_then_20_ms(autojump_clock, pins, engine):
    engine.answer = pin_everything("h1")
    engine.release_answers = [False, False]  # then True
    pin = await pins.pin([K1])
    await trio.sleep(5)  # the transfer reading the pin

    pins.release(pin)
    await trio.sleep(1)

    first = engine.release_calls[0][0]
    assert engine.call_offsets(first) == pytest.approx([0.0, 0.01, 0.03], abs=STEP_S)
    assert engine.released == ["h1"]
    assert pins.outstanding == 0


async def test_the_release_backoff_doubles_up_to_one_second(autojump_clock, pins, engine):
    engine.release_answers = [False] * 10  # then True

    pins.release(Pin("h1", {K1: [REF]}))
    await trio.sleep(10)

    offsets = engine.call_offsets(engine.release_calls[0][0])
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    wanted = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0, 1.0, 1.0]
    assert gaps == pytest.approx(wanted, abs=2 * STEP_S)  # each call waits for a poll
    assert pins_module.RELEASE_RETRY_MAX_S == 1.0
    assert engine.released == ["h1"]


async def test_a_release_that_raises_is_retried_and_logged(autojump_clock, pins, engine, log):
    engine.release_answers = [RuntimeError("engine busy"), RuntimeError("engine busy")]

    pins.release(Pin("h1", {K1: [REF]}, "source write req 5 to b"))
    await trio.sleep(1)

    first = engine.release_calls[0][0]
    assert engine.call_offsets(first) == pytest.approx([0.0, 0.01, 0.03], abs=STEP_S)
    assert engine.released == ["h1"]
    retries = log.named("release_pin_retry")
    assert [level for level, _ in retries] == ["info", "info"]
    assert retries[0][1]["handle"] == "h1" and "engine busy" in retries[0][1]["error"]
    assert retries[0][1]["op"] == "source write req 5 to b"


@pytest.mark.parametrize("answer", [1, "yes", None, [True]], ids=repr)
async def test_only_true_means_the_release_was_accepted(autojump_clock, pins, engine, answer):
    engine.release_answers = [answer]  # then True

    pins.release(Pin("h1", {K1: [REF]}))
    await trio.sleep(1)

    assert [handle for _, handle in engine.release_calls] == ["h1", "h1"]
    assert engine.released == ["h1"]


async def test_a_handle_is_never_released_again_after_success(autojump_clock, pins, engine):
    engine.release_answers = [False, RuntimeError("busy"), True, False]

    pins.release(Pin("h1", {K1: [REF]}))
    await trio.sleep(10)  # three asks a second apart, then silence

    assert [handle for _, handle in engine.release_calls] == ["h1"] * 3
    assert engine.released == ["h1"]
    assert pins.outstanding == 0


class RefusingEngine(FakeEngine):
    """Refuses the release of each handle a given number of times."""

    def __init__(self, refusals):
        super().__init__()
        self.refusals = dict(refusals)

    def release_pin(self, handle):
        self.release_answers = [self.refusals[handle] == 0]
        self.refusals[handle] = max(0, self.refusals[handle] - 1)
        return super().release_pin(handle)


async def test_several_refused_releases_are_retried_together_until_each_succeeds(
    autojump_clock, log, nursery
):
    engine = RefusingEngine({"h1": 1, "h2": 3})
    pins = start_pins(nursery, engine, log)

    pins.release(Pin("h1", {K1: [REF]}))
    pins.release(Pin("h2", {K2: [REF]}))
    await trio.sleep(10)

    assert sorted(engine.released) == ["h1", "h2"]
    assert [h for _, h in engine.release_calls].count("h1") == 2
    assert [h for _, h in engine.release_calls].count("h2") == 4
    assert pins.outstanding == 0


async def test_a_release_refused_for_good_is_reported_and_still_asked_every_second(
    autojump_clock, pins, engine, log
):
    engine.release_answers = [False] * 1000
    engine.step_s = SLOW_STEP_S

    pins.release(Pin("h1", {K1: [REF]}))
    await trio.sleep(60)

    [(level, fields)] = log.named("pin_release_refused")
    assert level == "warning" and fields["handle"] == "h1" and fields["refusals"] == 10
    assert "returned False" in fields["reason"]
    late = [t for t, _ in engine.release_calls if t > trio.current_time() - 10]
    assert 9 <= len(late) <= 11  # once a second, for as long as it takes
    assert pins.outstanding == 1


async def test_at_close_refused_releases_are_asked_every_10_ms_until_the_deadline(
    autojump_clock, pins, engine, log
):
    engine.release_answers = [False] * 1000
    pins.release(Pin("h1", {K1: [REF]}))
    await trio.sleep(5)  # the backoff has reached 1 s
    calls = len(engine.release_calls)

    assert await pins.drain(0.5) is False

    assert 40 <= len(engine.release_calls) - calls <= 51
    [(level, fields)] = log.named("pins_not_released")
    assert level == "error" and fields["pins"] == 1 and fields["handles"] == ["h1"]


async def test_at_close_a_drain_ends_as_soon_as_the_engine_accepts(autojump_clock, pins, engine):
    engine.release_answers = [False, False]
    pins.release(Pin("h1", {K1: [REF]}))
    start = trio.current_time()

    assert await pins.drain(5.0) is True

    assert trio.current_time() - start < 0.1
    assert engine.released == ["h1"]


# --- cancellation --------------------------------------------------------------------------


async def test_cancelling_a_waiting_caller_cancels_its_request(autojump_clock, pins, engine):
    with trio.move_on_after(0.05) as scope:
        await pins.pin([K1, K2])
    await trio.sleep(2 * STEP_S)  # the engine's next poll

    assert scope.cancelled_caught
    assert engine.cancelled == [1]
    assert pins.outstanding == 0


async def test_cancelling_before_the_engine_polled_makes_and_cancels_the_request_in_order(
    autojump_clock, pins, engine
):
    pins.scheduler.running = False
    with trio.move_on_after(0.05):
        await pins.pin([K1])
    pins.scheduler.running = True
    await trio.sleep(2 * STEP_S)

    assert engine.requests == [[K1]] and engine.cancelled == [1]


async def test_cancelling_without_a_cancel_binding_just_stops_waiting(
    autojump_clock, engine, log, nursery
):
    pins = start_pins(nursery, engine, log, with_cancel=False)

    with trio.move_on_after(0.05) as scope:
        await pins.pin([K1])

    assert scope.cancelled_caught
    assert pins.outstanding == 0


class CancelFailingEngine(FakeEngine):
    def cancel_pin_request(self, request):
        raise RuntimeError("no such request")


async def test_a_failing_cancel_pin_request_is_logged_and_the_caller_is_still_cancelled(
    autojump_clock, log, nursery
):
    pins = start_pins(nursery, CancelFailingEngine(), log)

    with trio.move_on_after(0.05) as scope:
        await pins.pin([K1])
    await trio.sleep(2 * STEP_S)

    assert scope.cancelled_caught
    [(level, fields)] = log.named("cancel_pin_request_failed")
    assert level == "warning" and fields["request"] == 1
    assert "no such request" in fields["error"]


async def test_a_result_arriving_after_cancellation_is_released(
    autojump_clock, pins, engine, nursery, log
):
    other = await in_background(nursery, pins, [K2])  # request 1: still waiting
    with trio.move_on_after(0.05):
        await pins.pin([K1])  # request 2
    await trio.sleep(1)
    assert engine.cancelled == [2]

    engine.respond(2, ("late", {K1: [REF]}))  # the engine granted it anyway
    await trio.sleep(1)

    assert engine.released == ["late"]
    assert [fields for _, fields in log.named("pin_result_unused")] == [
        {"op": "", "request": 2, "late": True}
    ]
    assert other == []  # the other caller still waits for its own result


async def test_the_last_poll_after_a_cancellation_still_catches_a_result_already_granted(
    autojump_clock, pins, engine
):
    with trio.move_on_after(0.05):
        await pins.pin([K1])
    engine.respond(1, ("late", {K1: [REF]}))  # granted just as the caller gave up

    await trio.sleep(10)

    assert engine.released == ["late"]


async def test_a_result_granted_later_is_released_even_when_nothing_else_waits(
    autojump_clock, engine, log, nursery
):
    pins = start_pins(nursery, engine, log, with_cancel=False)  # the engine cannot be told
    with trio.move_on_after(0.05):
        await pins.pin([K1])
    await trio.sleep(1)
    engine.respond(1, ("late", {K1: [REF]}))

    await trio.sleep(10)

    assert engine.released == ["late"]


async def test_a_request_never_answered_is_forgotten_after_30_s_and_polling_stops(
    autojump_clock, pins, engine, log
):
    engine.step_s = SLOW_STEP_S
    with trio.move_on_after(0.05):
        await pins.pin([K1])

    await trio.sleep(pins_module.ABANDONED_POLL_S + 1)
    polls = engine.polls
    await trio.sleep(10)

    assert log.named("pin_request_forgotten")
    assert engine.polls == polls  # nothing is polled for it any more


async def test_a_failing_request_pin_is_a_miss_and_is_logged(autojump_clock, pins, engine, log):
    engine.request_error = RuntimeError("engine shutting down")

    assert await pins.pin([K1, K2], "source write req 5 to b") is None

    [(level, fields)] = log.named("request_pin_failed")
    assert level == "warning"
    assert fields["op"] == "source write req 5 to b" and fields["keys"] == 2
    assert "engine shutting down" in fields["error"]
    await trio.sleep(1)
    assert engine.polls == 0
    assert pins.outstanding == 0


# --- polling -------------------------------------------------------------------------------


async def test_nothing_is_polled_while_nothing_is_outstanding(autojump_clock, pins, engine):
    await trio.sleep(10)

    assert engine.polls == 0


async def test_polling_stops_once_the_last_request_is_answered(autojump_clock, pins, engine):
    engine.answer = pin_everything("h1")
    pin = await pins.pin([K1])
    polls_for_the_pin = engine.polls

    await trio.sleep(10)
    pins.release(pin)
    await trio.sleep(10)

    assert polls_for_the_pin == 1
    assert engine.polls == polls_for_the_pin


async def test_a_waiting_request_is_polled_once_per_engine_poll(
    autojump_clock, pins, engine, nursery
):
    await in_background(nursery, pins, [K1])
    polls = engine.polls

    await trio.sleep(0.1)

    assert engine.polls - polls == pytest.approx(0.1 / STEP_S, abs=2)


async def test_a_failing_poll_is_logged_and_polling_continues(autojump_clock, pins, engine, log):
    engine.answer = pin_everything("h1")
    engine.poll_failures = 3

    pin = await pins.pin([K1])

    assert pin.handle == "h1"
    assert engine.polls == 4
    failures = log.named("poll_pin_results_failed")
    assert [level for level, _ in failures] == ["warning"] * 3
    assert "engine busy" in failures[0][1]["error"]


async def test_an_unusable_answer_naming_a_pin_still_held_does_not_release_it(
    autojump_clock, pins, engine, log, nursery
):
    engine.answer = pin_everything("h1")
    pin = await pins.pin([K1])  # a write reads h1 now
    engine.answer = lambda request, keys: ("h1", {K1: None})  # a miss, with the same handle

    assert await pins.pin([K2]) is None

    await trio.sleep(1)
    assert engine.release_calls == []
    pins.release(pin)
    await trio.sleep(1)
    assert engine.released == ["h1"]


async def test_at_close_a_late_grant_of_an_engine_that_cannot_be_told_is_still_released(
    autojump_clock, engine, log, nursery
):
    pins = start_pins(nursery, engine, log, with_cancel=False)
    with trio.move_on_after(0.05):
        await pins.pin([K1])

    async def grant_later():
        await trio.sleep(0.3)
        engine.respond(1, ("late", {K1: [REF]}))

    nursery.start_soon(grant_later)
    assert await pins.drain(1.0) is True

    assert engine.released == ["late"]
    assert not log.named("pin_requests_unanswered")


async def test_at_close_a_request_the_engine_never_answers_is_reported(
    autojump_clock, engine, log, nursery
):
    pins = start_pins(nursery, engine, log, with_cancel=False)
    with trio.move_on_after(0.05):
        await pins.pin([K1])

    await pins.drain(0.5)

    [(level, fields)] = log.named("pin_requests_unanswered")
    assert level == "warning" and fields["requests"] == 1
