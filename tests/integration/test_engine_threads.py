"""Engine threads and KVCR's calls back into the engine, on a real instance (real NIXL):
one engine thread at a time makes the calls, results never overtake the events that explain
them, and ``close()`` works even from inside a callback (contract section 4).
"""

from __future__ import annotations

import threading
import time

import pytest

from engine_sim import EngineSim, Recorder, key
from kvcr import KVCR

pytestmark = pytest.mark.integration


def instance(engine: EngineSim, recorder: Recorder, **bindings: object) -> KVCR:
    return KVCR(engine.config, recorder.bindings(**bindings), engine.backend_configs)


def test_a_second_engine_thread_gets_no_result_before_its_event_was_delivered() -> None:
    engine, recorder = EngineSim("two-threads"), Recorder()
    inside, leave = threading.Event(), threading.Event()
    seen: list[object] = []

    def slow_sink(event: object) -> None:  # the router link is slow today
        seen.append(event)
        inside.set()
        leave.wait(10)

    kv = instance(engine, recorder, inventory_sink=slow_sink)
    got_a: list[object] = []

    def engine_thread_a() -> None:
        recorder.threads.add_engine_thread()
        deadline = time.monotonic() + 10
        while not got_a and time.monotonic() < deadline:
            got_a.extend(kv.poll_completed())
            time.sleep(0.0005)

    try:
        engine.write(0, seed=1)
        handle = kv.deposit({key(0): engine.refs(0)})
        a = threading.Thread(target=engine_thread_a)
        a.start()
        assert inside.wait(10)  # thread A is delivering the deposit's inventory event
        for _ in range(20):
            assert kv.poll_completed() == []  # thread B: not its turn, and no result early
        leave.set()
        a.join(10)
        assert [h for h, _ in got_a] == [handle] and len(seen) == 1
    finally:
        leave.set()
        kv.close()


def test_close_from_inside_a_callback_finishes_and_hands_everything_back() -> None:
    engine, recorder = EngineSim("close-inside"), Recorder()
    kv: KVCR | None = None
    closed: list[float] = []

    def closing_sink(event: object) -> None:  # the engine shuts down on its first event
        assert kv is not None
        start = time.monotonic()
        kv.close()
        closed.append(time.monotonic() - start)

    kv = instance(engine, recorder, inventory_sink=closing_sink)
    engine.write(0, seed=1)
    kv.deposit({key(0): engine.refs(0)})
    deadline = time.monotonic() + 10
    while not closed and time.monotonic() < deadline:
        kv.poll_completed()
        time.sleep(0.0005)

    assert closed and closed[0] < 2.0  # no wait for a drain deadline
    with pytest.raises(ValueError, match="closed"):
        kv.deposit({key(1): engine.refs(1)})
    kv.close()  # idempotent
