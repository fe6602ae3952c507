"""Child program for ``test_busy_engine.py``: a kvcr worker whose engine thread is busy in pure
Python, with an adapter written the way vLLM's kvcr adapter is.

Run as ``python busy_engine_proc.py FD NAME PORT BLOCK``. The engine thread runs a scheduler
loop and never sleeps: each step computes in pure Python for ``BUSY_S`` (holding the GIL as
a model's Python-side work does; the interpreter's switch interval is 1 µs, so the runtime
thread and this one interleave as finely as they can), then does what vLLM's scheduler does
with its KV tier: ``get_finished_jobs`` (``poll_completed``), ``serve_external_requests``
(grant the pins kvcr asked for, from the engine's own region) and ``take_events`` (inventory
for the router). The adapter's bookkeeping is plain lists and dicts without locks, copied,
walked and then cleared, as an adapter may when every callback comes on its engine thread
(contract section 4): an entry a callback from another thread appended meanwhile would be
lost. (The previous design, which called back from kvcr's thread, lost 8-9 of the 300 loads
here.)

Commands from the parent (pickled tuples over the socketpair) are taken at the end of a
step and answered from the engine thread: ``endpoint``, ``engine_has N`` (the engine holds
keys 0..N-1, served only through pins; returns their checksums), ``churn N`` (deposit N fresh
keys one operation at a time into the 8-slot pool, in the background of the steps),
``report`` (pins, churn, inventory and the thread rule, once quiet) and ``stop``.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections import Counter
from multiprocessing.connection import Connection
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MEM_EVENTS", "no")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
sys.path.insert(0, os.path.dirname(__file__))

from engine_sim import CallbackThreads, EngineSim
from kvcr import KVCR, KVCRBindings
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.types import BlockKey, CacheTier, InventoryEvent, QueryStatus
from peer_world import IntKeys, key

BUSY_S = 0.002  # pure-Python work per scheduler step
LOOKUP_S = 0.0001  # pure-Python work per pin served and per event sent to the router
POOL_SLOTS = 8
REGION = 96  # engine elements: [0, 64) held keys, [64, 96) deposit staging
HELD, STAGE = 64, 64
CHURN_BASE = 100_000  # churn keys, never held by the engine
CHURN_IN_FLIGHT = 2


def busy(seconds: float) -> None:
    """Pure Python, holding the GIL except at switch requests."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        for i in range(200):
            x = (x * 31 + i) % 1_000_003


class Adapter:
    """The engine side of kvcr's bindings, as vLLM's adapter keeps it."""

    def __init__(self, engine: EngineSim) -> None:
        self.engine = engine
        self.threads = CallbackThreads()
        self.holds: dict[BlockKey, int] = {}  # key -> engine element
        self.next_request = 0
        self.pending: list[tuple[int, list[BlockKey]]] = []  # pin requests to serve
        self.results: list[tuple[int, Any]] = []  # served, for poll_pin_results
        self.pinned: dict[str, list[BlockKey]] = {}
        self.granted: list[str] = []
        self.released: Counter[str] = Counter()
        self.requests = 0
        self.events: list[InventoryEvent] = []
        self.inventory: set[BlockKey] = set()  # the router's view, replayed from events

    # -- kvcr's callbacks ----------------------------------------------------------------------

    def request_pin(self, keys: list[BlockKey]) -> int:
        self.threads.check("request_pin")
        self.next_request += 1
        self.requests += 1
        self.pending.append((self.next_request, list(keys)))
        return self.next_request

    def poll_pin_results(self) -> list[tuple[int, Any]]:
        self.threads.check("poll_pin_results")
        out = list(self.results)
        self.results.clear()
        return out

    def release_pin(self, handle: str) -> bool:
        self.threads.check("release_pin")
        self.pinned.pop(handle, None)
        self.released[handle] += 1
        return True

    def cancel_pin_request(self, request: int) -> None:
        self.threads.check("cancel_pin_request")
        self.pending = [(r, k) for r, k in self.pending if r != request]

    def inventory_sink(self, event: InventoryEvent) -> None:
        self.threads.check("inventory_sink")
        self.events.append(event)

    # -- the scheduler's side: walk a copy of a list, then clear it --------------------------

    def serve_external_requests(self) -> None:
        for request, keys in list(self.pending):
            busy(LOOKUP_S)  # the block table walk for the request's keys
            refs = {k: self.engine.refs(self.holds[k]) if k in self.holds else None for k in keys}
            if all(v is None for v in refs.values()):
                self.results.append((request, None))
                continue
            handle = f"pin-{request}"
            self.pinned[handle] = keys
            self.granted.append(handle)
            self.results.append((request, (handle, refs)))
        self.pending.clear()

    def take_events(self) -> None:
        for event in list(self.events):
            busy(LOOKUP_S)  # encoding the router's KV event
            if event.tier is CacheTier.LOCAL_G2:
                if event.removed:
                    self.inventory.difference_update(event.keys)
                else:
                    self.inventory.update(event.keys)
        self.events.clear()


class Churn:
    """Deposits of fresh keys, one key an operation, a few in flight, driven by the steps."""

    def __init__(self, kv: KVCR, engine: EngineSim) -> None:
        self.kv, self.engine = kv, engine
        self.remaining = 0
        self.submitted = 0
        self.in_flight: dict[int, int] = {}  # op handle -> staging element
        self.statuses: Counter[str] = Counter()
        self.keys: list[BlockKey] = []

    def start(self, count: int) -> None:
        self.remaining += count

    def step(self, results: list[Any]) -> None:
        for handle, entries in results:
            if handle in self.in_flight:
                del self.in_flight[handle]
                self.statuses.update(e.status.value for e in entries.values())
        while self.remaining and len(self.in_flight) < CHURN_IN_FLIGHT:
            element = STAGE + self.submitted % (REGION - STAGE)
            if element in self.in_flight.values():
                break
            k = key(CHURN_BASE + self.submitted)
            self.engine.write(element, seed=CHURN_BASE + self.submitted)
            self.in_flight[self.kv.deposit({k: self.engine.refs(element)})] = element
            self.keys.append(k)
            self.submitted += 1
            self.remaining -= 1


def main() -> None:
    sys.setswitchinterval(1e-6)
    fd, name, port, block = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    conn = Connection(fd)
    engine = EngineSim(
        name=name, layouts=[("", block)], pool_blocks=POOL_SLOTS, region_blocks=REGION
    )
    adapter = Adapter(engine)
    channel = ZmqPeerControlChannel("127.0.0.1", port, "127.0.0.1")
    bindings = KVCRBindings(
        request_pin=adapter.request_pin,
        poll_pin_results=adapter.poll_pin_results,
        release_pin=adapter.release_pin,
        cancel_pin_request=adapter.cancel_pin_request,
        framework_control=channel,
        key_adapter=IntKeys(),
        inventory_sink=adapter.inventory_sink,
    )
    kv = KVCR(engine.config, bindings, engine.backend_configs)
    churn = Churn(kv, engine)

    def engine_has(count: int) -> dict[int, list[int]]:
        for k in range(count):
            engine.write(k, seed=k)
            adapter.holds[key(k)] = k
        return {k: engine.checksum(k) for k in range(count)}

    def report(closed: bool = False) -> dict[str, Any]:
        answers = [] if closed else kv.query(churn.keys)
        resident = {k for k, (status, _) in zip(churn.keys, answers) if status is QueryStatus.HIT}
        return {
            "churn_left": churn.remaining + len(churn.in_flight),
            "churn_statuses": dict(churn.statuses),
            "resident": sorted(int.from_bytes(k, "big") for k in resident),
            "inventory": sorted(int.from_bytes(k, "big") for k in adapter.inventory),
            "requests": adapter.requests,
            "granted": len(adapter.granted),
            "released_once": all(adapter.released[h] == 1 for h in adapter.granted),
            "released_extra": sorted(h for h in adapter.released if h not in adapter.granted),
            "held": sorted(adapter.pinned),
            "callbacks": adapter.threads.calls,
            "off_thread": adapter.threads.wrong[:5],
        }

    commands = {
        "endpoint": lambda: channel.endpoint,
        "engine_has": engine_has,
        "churn": churn.start,
        "report": report,
    }
    try:
        while True:
            busy(BUSY_S)
            churn.step(kv.poll_completed())  # get_finished_jobs
            adapter.serve_external_requests()
            adapter.take_events()
            if not conn.poll(0):
                continue
            command, *args = conn.recv()
            if command == "stop":
                kv.close()
                channel.close()
                adapter.take_events()
                conn.send(("ok", report(closed=True)))
                return
            try:
                conn.send(("ok", commands[command](*args)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


if __name__ == "__main__":
    main()
