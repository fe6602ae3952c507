"""Peer loads served through the pins of a source whose engine thread is busy in pure Python
(issue #14): two real processes, real NIXL and ZMQ on 127.0.0.1.

The source (``busy_engine_proc.py``) runs a scheduler loop that never sleeps, with a 1 µs
switch interval, and an adapter whose pin table and event list are plain, unlocked Python
structures, like vLLM's: kvcr must make every callback on that thread, inside its calls.
This process is the destination: it loads 300 single blocks that only the source's engine
holds, each through a router hint, a few at a time, while the source churns 400 deposits
through its 8-slot pool.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from engine_sim import EngineSim, Recorder, router_hint
from kvcr import KVCR
from kvcr.config import KVCRBackendConfigs
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.types import OpEntryStatus
from peer_world import IntKeys, key
from procs import ask, free_port, spawn

pytestmark = pytest.mark.integration

BLOCK = 16 * 1024
HELD = 64  # keys the source's engine holds
LOADS = 300
IN_FLIGHT = 6
CHURN = 400
CHILD = Path(__file__).resolve().parent.parent / "busy_engine_proc.py"


class BusySource:
    def __init__(self) -> None:
        self.proc, self.conn = spawn(CHILD, ["busy-src", str(free_port()), str(BLOCK)])

    def __call__(self, *command: object, timeout: float = 60) -> Any:
        return ask(self.conn, command, timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(20)
        self.conn.close()


@pytest.fixture
def source():
    s = BusySource()
    yield s
    s.close()


def load_all(kv: KVCR, engine: EngineSim, endpoint: str) -> dict[int, tuple[str, int]]:
    """``LOADS`` single-block loads of keys 0..HELD-1 in turn, ``IN_FLIGHT`` at a time, each
    under its own request's hint; the engine polls every 0.5 ms. Returns, per load, its
    status and the index of the key it loaded."""
    free = list(range(IN_FLIGHT))  # destination elements
    running: dict[int, tuple[int, int, int]] = {}  # op -> (load, key, element)
    done: dict[int, tuple[str, int]] = {}
    checks: dict[int, list[int]] = {}
    started = 0
    deadline = time.monotonic() + 120
    while len(done) < LOADS:
        assert time.monotonic() < deadline, f"{len(done)} of {LOADS} loads answered"
        while free and started < LOADS:
            element, k = free.pop(), started % HELD
            engine.clear(element)
            request = f"load-{started}"
            kv.submit_hint(router_hint(endpoint, [k]), request)
            running[kv.deliver({key(k): engine.refs(element)}, request)] = (started, k, element)
            started += 1
        for handle, entries in kv.poll_completed():
            number, k, element = running.pop(handle)
            [entry] = entries.values()
            done[number] = (entry.status.value, k)
            if entry.status is OpEntryStatus.SUCCESS:
                checks[number] = engine.checksum(element)
            kv.discard_hint(f"load-{number}")
            free.append(element)
        time.sleep(0.0005)
    engine.checked = checks  # type: ignore[attr-defined]
    return done


def test_loads_through_a_busy_engines_pins_all_succeed_and_every_pin_is_released_once(
    source: BusySource,
) -> None:
    endpoint = source("endpoint")
    sums = source("engine_has", HELD)
    source("churn", CHURN)
    engine = EngineSim(
        name="busy-dst",
        layouts=[("", BLOCK)],
        region_blocks=IN_FLIGHT,
        operation_timeout_ms=3000,
        abandon_timeout_ms=6000,
    )
    recorder = Recorder()
    channel = ZmqPeerControlChannel("127.0.0.1", free_port(), "127.0.0.1")
    kv = KVCR(
        engine.config,
        recorder.bindings(framework_control=channel, key_adapter=IntKeys()),
        KVCRBackendConfigs(framework_regions=engine.backend_configs.framework_regions),
    )
    try:
        done = load_all(kv, engine, endpoint)
    finally:
        kv.close()
        channel.close()

    failed = {n: status for n, (status, _) in done.items() if status != "SUCCESS"}
    assert failed == {}
    assert all(engine.checked[n] == sums[k] for n, (_, k) in done.items())  # byte-exact

    deadline = time.monotonic() + 60
    while (report := source("report"))["churn_left"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert report["churn_left"] == 0
    assert report["churn_statuses"] == {"SUCCESS": CHURN}
    # The router's view, replayed from every inventory event, is what lookup() answers.
    assert len(report["resident"]) == 8
    assert report["inventory"] == report["resident"]

    final = source("stop")
    assert final["requests"] == final["granted"] >= LOADS  # every pull asked, every ask granted
    assert final["released_once"] and final["released_extra"] == []
    assert final["held"] == []  # no primary-tier slot stays pinned
    assert final["off_thread"] == [] and final["callbacks"] > 2 * LOADS
