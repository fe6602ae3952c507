"""Behaviour of engine pins (``kvcr.runtime.pins``, bindings of contract section 4).

Read top to bottom: which pin results are usable and what happens to the handle of one
that is not; how releases are retried until the engine says True (and never after); what
cancelling a waiting caller does; and what polling costs, when idle and when the engine's
poll fails. Time is trio's MockClock (``autojump_clock``), so every interval is exact.
"""

from __future__ import annotations

import itertools

import pytest
import trio

from kvcr.runtime import pins as pins_module
from kvcr.runtime.pins import Pin, Pins
from kvcr.types import BlockKey, MemoryRef

K1, K2, K3 = BlockKey(b"key-1"), BlockKey(b"key-2"), BlockKey(b"key-3")
REF = MemoryRef(end_point_name="engine-agent", label="kv", element_index=3)
PENDING = object()  # the engine has not answered (yet)


class FakeEngine:
    """The four pin bindings of an engine, scripted by the test.

    ``answer(request, keys)`` gives the result queued when a request arrives (``PENDING``
    for none: the test calls ``respond`` later). ``release_answers`` are returned (or raised)
    by successive ``release_pin`` calls; once used up every release is accepted.
    """

    def __init__(self, answer=lambda request, keys: PENDING, release_answers=()):
        self.answer = answer
        self.release_answers = list(release_answers)
        self.requests: list[list[BlockKey]] = []
        self.ready: list[tuple[int, object]] = []
        self.polls = 0
        self.poll_failures = 0  # how many of the next polls raise
        self.request_error: Exception | None = None
        self.release_calls: list[tuple[float, str]] = []  # (time, handle)
        self.released: list[str] = []  # handles whose release was accepted
        self.cancelled: list[int] = []

    def request_pin(self, keys):
        if self.request_error is not None:
            raise self.request_error
        self.requests.append(keys)
        request = len(self.requests)
        result = self.answer(request, keys)
        if result is not PENDING:
            self.respond(request, result)
        return request

    def respond(self, request, result):
        self.ready.append((request, result))

    def poll_pin_results(self):
        self.polls += 1
        if self.poll_failures:
            self.poll_failures -= 1
            raise RuntimeError("engine busy")
        ready, self.ready = self.ready, []
        return ready

    def release_pin(self, handle):
        self.release_calls.append((trio.current_time(), handle))
        answer = self.release_answers.pop(0) if self.release_answers else True
        if isinstance(answer, BaseException):
            raise answer
        if answer is True:
            self.released.append(handle)
        return answer

    def cancel_pin_request(self, request):
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


def start_pins(nursery, engine, log, *, with_cancel=True):
    """Pins over the fake engine, its ``run`` task started in ``nursery``."""
    pins = Pins(
        engine.request_pin,
        engine.poll_pin_results,
        engine.release_pin,
        engine.cancel_pin_request if with_cancel else None,
        log,
    )
    nursery.start_soon(pins.run)
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
    return outcome


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
    assert [fields for _, fields in log.named("pin_result_unused")] == [{"request": 1}]
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
    ],
)
async def test_a_malformed_result_is_a_miss(autojump_clock, pins, engine, result):
    engine.answer = lambda request, keys: result

    assert await pins.pin([K1]) is None
    assert pins.outstanding == 0


async def test_a_result_whose_handle_is_none_is_a_miss(autojump_clock, pins, engine):
    engine.answer = lambda request, keys: (None, {K1: [REF]})

    assert await pins.pin([K1]) is None


async def test_a_result_for_a_request_nobody_waits_for_is_released(
    autojump_clock, pins, engine, nursery
):
    waiting = await in_background(nursery, pins, [K1])  # keeps polling going
    engine.respond(99, ("stray", {K2: [REF]}))

    await trio.sleep(1)

    assert engine.released == ["stray"]
    engine.respond(1, ("h1", {K1: [REF]}))
    await trio.sleep(1)
    assert waiting[0].handle == "h1"


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


async def test_a_poll_item_that_is_not_a_pair_is_skipped_and_logged(autojump_clock, engine, log):
    async with trio.open_nursery() as nursery:
        pins = start_pins(nursery, engine, log)
        waiting = await in_background(nursery, pins, [K1])
        engine.ready = [("garbage",), (1, ("h1", {K1: [REF]}))]

        await trio.sleep(1)

        assert waiting[0].handle == "h1"
        nursery.cancel_scope.cancel()


# --- releases ------------------------------------------------------------------------------


async def test_a_pin_accepted_at_once_is_released_once(autojump_clock, pins, engine):
    engine.answer = pin_everything("h1")
    pin = await pins.pin([K1])

    pins.release(pin)
    await trio.sleep(100)

    assert [handle for _, handle in engine.release_calls] == ["h1"]
    assert pins.outstanding == 0


async def test_a_refused_release_is_retried_after_10_ms_then_20_ms(autojump_clock, pins, engine):
    engine.answer = pin_everything("h1")
    engine.release_answers = [False, False]  # then True
    pin = await pins.pin([K1])
    await trio.sleep(5)  # the transfer reading the pin
    start = trio.current_time()

    pins.release(pin)
    assert pins.outstanding == 1  # the first attempt is immediate and was refused

    await trio.sleep(1)
    assert engine.call_offsets(start) == pytest.approx([0.0, 0.01, 0.03])
    assert engine.released == ["h1"]
    assert pins.outstanding == 0


async def test_the_release_backoff_doubles_up_to_one_second(autojump_clock, pins, engine):
    engine.release_answers = [False] * 10  # then True
    start = trio.current_time()

    pins.release(Pin("h1", {K1: [REF]}))
    await trio.sleep(10)

    offsets = engine.call_offsets(start)
    gaps = [round(b - a, 6) for a, b in itertools.pairwise(offsets)]
    assert gaps == [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0, 1.0, 1.0]
    assert pins_module.RELEASE_RETRY_MAX_S == 1.0
    assert engine.released == ["h1"]


async def test_a_release_that_raises_is_retried_and_logged(autojump_clock, pins, engine, log):
    engine.release_answers = [RuntimeError("engine busy"), RuntimeError("engine busy")]
    start = trio.current_time()

    pins.release(Pin("h1", {K1: [REF]}))
    await trio.sleep(1)

    assert engine.call_offsets(start) == pytest.approx([0.0, 0.01, 0.03])
    assert engine.released == ["h1"]
    retries = log.named("release_pin_retry")
    assert [level for level, _ in retries] == ["info", "info"]
    assert "engine busy" in retries[0][1]["error"]


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
    await trio.sleep(1000)

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


# --- cancellation --------------------------------------------------------------------------


async def test_cancelling_a_waiting_caller_cancels_its_request(autojump_clock, pins, engine):
    with trio.move_on_after(0.05) as scope:
        await pins.pin([K1, K2])

    assert scope.cancelled_caught
    assert engine.cancelled == [1]
    assert pins.outstanding == 0


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

    assert scope.cancelled_caught
    [(level, fields)] = log.named("cancel_pin_request_failed")
    assert level == "warning"
    assert "no such request" in fields["error"]


async def test_a_result_arriving_after_cancellation_is_released(
    autojump_clock, pins, engine, nursery
):
    other = await in_background(nursery, pins, [K2])  # request 1: still waiting
    with trio.move_on_after(0.05):
        await pins.pin([K1])  # request 2
    assert engine.cancelled == [2]
    await trio.sleep(1)

    engine.respond(2, ("late", {K1: [REF]}))  # the engine granted it anyway
    await trio.sleep(1)

    assert engine.released == ["late"]
    assert other == []  # the other caller still waits for its own result


async def test_the_last_poll_after_a_cancellation_still_catches_a_result_already_granted(
    autojump_clock, pins, engine
):
    with trio.move_on_after(0.05):
        await pins.pin([K1])
    engine.respond(1, ("late", {K1: [REF]}))  # granted just as the caller gave up

    await trio.sleep(100)

    assert engine.released == ["late"]


async def test_a_result_granted_later_is_released_even_when_nothing_else_waits(
    autojump_clock, engine, log, nursery
):
    pins = start_pins(nursery, engine, log, with_cancel=False)  # the engine cannot be told
    with trio.move_on_after(0.05):
        await pins.pin([K1])
    await trio.sleep(1)
    engine.respond(1, ("late", {K1: [REF]}))

    await trio.sleep(100)

    assert engine.released == ["late"]


async def test_a_failing_request_pin_is_a_miss_and_is_logged(autojump_clock, pins, engine, log):
    engine.request_error = RuntimeError("engine shutting down")

    assert await pins.pin([K1, K2]) is None

    [(level, fields)] = log.named("request_pin_failed")
    assert level == "warning"
    assert fields["keys"] == 2
    assert "engine shutting down" in fields["error"]
    await trio.sleep(1)
    assert engine.polls == 0
    assert pins.outstanding == 0


# --- polling -------------------------------------------------------------------------------


async def test_nothing_is_polled_while_nothing_is_outstanding(autojump_clock, pins, engine):
    await trio.sleep(1000)

    assert engine.polls == 0


async def test_polling_stops_once_the_last_request_is_answered(autojump_clock, pins, engine):
    engine.answer = pin_everything("h1")
    pin = await pins.pin([K1])
    polls_for_the_pin = engine.polls

    await trio.sleep(1000)
    pins.release(pin)
    await trio.sleep(1000)

    assert polls_for_the_pin == 1
    assert engine.polls == polls_for_the_pin


async def test_a_waiting_request_is_polled_every_poll_period(autojump_clock, pins, engine, nursery):
    await in_background(nursery, pins, [K1])

    await trio.sleep(0.1)

    expected = 0.1 / pins_module.POLL_S  # 0.2 ms: sub-millisecond with the real transport
    assert 0.95 * expected <= engine.polls <= expected + 2


async def test_a_failing_poll_is_logged_and_polling_continues(autojump_clock, pins, engine, log):
    engine.answer = pin_everything("h1")
    engine.poll_failures = 3

    pin = await pins.pin([K1])

    assert pin.handle == "h1"
    assert engine.polls == 4
    failures = log.named("poll_pin_results_failed")
    assert [level for level, _ in failures] == ["warning"] * 3
    assert "engine busy" in failures[0][1]["error"]
