"""Child program for two-process peer tests: one kvcr worker with a real NIXL agent and a
real ZMQ control channel, driven by its parent over a socketpair.

Run as ``python worker_proc.py FD NAME PORT BLOCK POOL_BLOCKS REGION_BLOCKS [SOCKET INDEX
DIGEST]``; with the last three, the worker runs over a guard service's pool group. With
``KVCR_TEST_G3`` set (JSON: ``{"paths": [...], "capacity_bytes_per_file": N}``) it has a
G3 tier on those files (POSIX backend), to which its full pool spills; with
``KVCR_TEST_SPANS`` set, OpenTelemetry spans go to memory (``spans``). The parent
sends pickled ``(command, *args)`` tuples and gets one reply each (an exception comes back
as ``("error", text)``). The worker's engine serves pins from its own region
(``engine_has``) and can hold pin answers back, like a busy engine; between commands it polls
KVCR every ``STEP_S`` like a scheduler, and ``callback_threads`` says whether every engine
callback came on this thread inside such a call.

The ``soak_*`` commands serve ``soak.py``: content is derived from the key (``write(element,
seed=key)``), so the parent checks every delivered block against a checksum it computes
itself; release handles stay here; ``audit`` reports the instance's accounting and the
process's resources.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
import traceback
import zlib
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MEM_EVENTS", "no")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
sys.path.insert(0, os.path.dirname(__file__))

from engine_sim import EngineSim, Recorder, router_hint
from kvcr import KVCR
from kvcr.config import G3Options, KVCRBackendConfigs, KVCRGuardConfig
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.telemetry import InMemoryStats
from kvcr.testing import open_kvcr
from kvcr.types import CacheTier
from peer_world import EnginePins, IntKeys, key

STEP_S = 0.002  # the engine's scheduler cadence while the parent sends no command


def configure_spans() -> Any:
    """With ``KVCR_TEST_SPANS`` set: the process's global OpenTelemetry tracer provider,
    configured before kvcr starts as an engine configures its own, exporting to memory;
    the exporter, or None."""
    if not os.environ.get("KVCR_TEST_SPANS"):
        return None
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


def finished_spans(exporter: Any) -> list[dict[str, Any]]:
    """The spans ended so far: name, attributes, parent's name, status, times (ns)."""
    spans = exporter.get_finished_spans() if exporter is not None else ()
    names = {s.context.span_id: s.name for s in spans}
    return [
        {
            "name": s.name,
            "attributes": dict(s.attributes or {}),
            "parent": names.get(s.parent.span_id) if s.parent is not None else None,
            "ok": s.status.is_ok,
            "start": s.start_time,
            "end": s.end_time,
        }
        for s in spans
    ]


def main() -> None:
    fd, name = int(sys.argv[1]), sys.argv[2]
    port, block, pool_blocks, region_blocks = map(int, sys.argv[3:7])
    conn = Connection(fd)
    engine = EngineSim(
        name=name,
        layouts=[("", block)],
        pool_blocks=pool_blocks,
        region_blocks=region_blocks,
        operation_timeout_ms=2000,
        abandon_timeout_ms=4000,
        enable_telemetry=True,
    )
    pins = EnginePins(engine)
    # Another host (two_hosts.py): bind every address, advertise the one peers reach.
    channel = ZmqPeerControlChannel(
        os.environ.get("KVCR_TEST_CONTROL_HOST", "127.0.0.1"),
        port,
        os.environ.get("KVCR_TEST_ADVERTISE_HOST", "127.0.0.1"),
    )
    recorder = Recorder()
    bindings = recorder.bindings(
        request_pin=pins.request_pin,
        poll_pin_results=pins.poll_pin_results,
        release_pin=pins.release_pin,
        cancel_pin_request=pins.cancel_pin_request,
        framework_control=channel,
        key_adapter=IntKeys(),
        stats_factory=InMemoryStats,
    )
    guard = None
    if len(sys.argv) > 7:
        guard = KVCRGuardConfig(sys.argv[7], int(sys.argv[8]), sys.argv[9])
    g3 = json.loads(os.environ["KVCR_TEST_G3"]) if os.environ.get("KVCR_TEST_G3") else None
    backends = KVCRBackendConfigs(
        framework_regions=engine.backend_configs.framework_regions,
        local_dram=None if guard else engine.backend_configs.local_dram,
        g3=None
        if g3 is None
        else G3Options(
            paths=tuple(Path(p) for p in g3["paths"]),
            capacity_bytes_per_file=g3["capacity_bytes_per_file"],
        ),
    )
    spans = configure_spans()
    opened = open_kvcr(engine.config, bindings, backends, guard)
    kv, runtime = opened.kv, opened.runtime

    def deposit(items: list[tuple[int, int, int]]) -> dict[int, tuple[str, list[int]]]:
        for _k, element, seed in items:
            engine.write(element, seed)
        handle = kv.deposit({key(k): engine.refs(element) for k, element, _ in items})
        entries = engine.wait(kv, handle, len(items))
        return {
            k: (entries[key(k)].status.value, engine.checksum(element)) for k, element, _ in items
        }

    def deposit_nowait(items: list[tuple[int, int, int]]) -> dict[int, list[int]]:
        """Start a deposit and return at once with the checksums of what it copies."""
        for _k, element, seed in items:
            engine.write(element, seed)
        kv.deposit({key(k): engine.refs(element) for k, element, _ in items})
        return {k: engine.checksum(element) for k, element, _ in items}

    def engine_has(items: list[tuple[int, int, int]]) -> dict[int, list[int]]:
        for k, element, seed in items:
            engine.write(element, seed)
            pins.engine_has[key(k)] = element
        return {k: engine.checksum(element) for k, element, _ in items}

    def pin_state() -> dict[str, object]:
        return {
            "requests": len(pins.requests),
            "pinned": sorted(pins.pinned),
            "released": list(pins.released),
            "cancelled": list(pins.cancelled),
        }

    soak = Soak(kv, runtime, engine, pins, recorder)
    commands = {
        "soak_deposit": soak.deposit,
        "soak_deliver": soak.deliver,
        "soak_deliver_start": soak.deliver_start,
        "soak_deliver_finish": soak.deliver_finish,
        "soak_fetch": soak.fetch,
        "soak_release": soak.release,
        "soak_engine_hold": soak.engine_hold,
        "soak_resident": soak.resident,
        "soak_quiet": soak.quiet,
        "soak_audit": soak.audit,
        "endpoint": lambda: channel.endpoint,
        "deposit": deposit,
        "deposit_nowait": deposit_nowait,
        "engine_has": engine_has,
        "hold_pins": lambda hold: setattr(pins, "hold_back", hold),
        "pin_state": pin_state,
        "claims": lambda k: runtime.index.get(key(k)).claims,
        "query": lambda ks: [status.name for status, _ in kv.query([key(k) for k in ks])],
        "counters": soak.counters,
        "durations": soak.durations,
        "spans": lambda: finished_spans(spans),
        "gauges": lambda: dict(runtime.gauges()),
        "dropped": lambda: dict(runtime.plane.dropped),
        "callback_threads": lambda: (recorder.threads.calls, list(recorder.threads.wrong)),
        "events": lambda: [(e.op_handle, e.state) for e in recorder.resilience],
    }
    try:
        while True:
            # Idle, the engine's scheduler still polls KVCR every step (pins, events).
            if not conn.poll(STEP_S):
                soak.absorb()
                continue
            command, *args = conn.recv()
            if command == "stop":
                kv.close()
                channel.close()
                # close() hands pins back too: the thread rule's verdict covers it.
                conn.send(("ok", list(recorder.threads.wrong)))
                return
            try:
                conn.send(("ok", commands[command](*args)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        time.sleep(0)


# Engine region layout for the soak: deposits are staged in elements [0, 16), blocks the
# engine itself holds (served to peers through pins) live in [16, 32), deliveries land in
# [32, 64).
STAGE, HELD, LAND = 0, 16, 32


def rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Soak:
    """The soak's commands (see soak.py). Content is ``write(element, seed=key)`` everywhere,
    so every copy of key k has the same checksum, which the parent computes on its own."""

    def __init__(
        self, kv: KVCR, runtime: Any, engine: EngineSim, pins: EnginePins, recorder: Recorder
    ) -> None:
        self.kv = kv
        self.runtime = runtime
        self.engine = engine
        self.pins = pins
        self.recorder = recorder
        self.held: dict[int, int] = {}  # release handle -> key (fetch and no_evict deposits)
        self.later: set[int] = set()  # ops whose results the idle loop must keep
        self.inventory: set[int] = set()  # LOCAL_G2 keys, replayed from inventory events
        self.requests = 0
        self.totals: dict[str, float] = {}  # counter "name{labels}" -> sum over intervals
        self.samples: dict[str, list[float]] = {}  # duration "scope,result" -> samples

    def absorb(self) -> None:
        """Drain completions while idle, keeping only those somebody will ask for."""
        for handle, entries in self.kv.poll_completed():
            if handle in self.later:
                self.engine.completed.setdefault(handle, {}).update(entries)

    def _take_stats(self) -> None:
        """Fold the current stats interval into the totals (get_stats starts a new one)."""
        stats = self.kv.get_stats()
        if stats is None:
            return
        assert isinstance(stats, InMemoryStats)
        for (name, labels), value in stats.counters.items():
            label = f"{name}{{{','.join(labels)}}}"
            self.totals[label] = self.totals.get(label, 0) + value
        for (_name, labels), values in stats.histograms.items():
            self.samples.setdefault(",".join(labels), []).extend(values)

    def counters(self) -> dict[str, float]:
        """The instance's counters so far, summed over its stats intervals."""
        self._take_stats()
        return dict(self.totals)

    def durations(self) -> dict[str, list[float]]:
        """Every kvcr_duration_seconds sample so far, by "scope,result"."""
        self._take_stats()
        return {label: list(values) for label, values in self.samples.items()}

    def deposit(self, keys: list[int], no_evict: bool) -> dict[int, str]:
        for i, k in enumerate(keys):
            self.engine.write(STAGE + i, seed=k)
        handle = self.kv.deposit(
            {key(k): self.engine.refs(STAGE + i) for i, k in enumerate(keys)}, no_evict=no_evict
        )
        entries = self.engine.wait(self.kv, handle, len(keys))
        for k in keys:
            if entries[key(k)].release_handle is not None:
                self.held[entries[key(k)].release_handle] = k
        return {k: entries[key(k)].status.value for k in keys}

    def _hint(self, keys: list[int], endpoint: str | None) -> str | None:
        if endpoint is None:
            return None
        self.requests += 1
        request = f"soak-{self.requests}"
        self.kv.submit_hint(router_hint(endpoint, keys), request)
        return request

    def deliver_start(self, keys: list[int], endpoint: str | None) -> tuple[int, str | None]:
        for i in range(len(keys)):
            self.engine.clear(LAND + i)  # a block that is not written cannot pass as delivered
        request = self._hint(keys, endpoint)
        handle = self.kv.deliver(
            {key(k): self.engine.refs(LAND + i) for i, k in enumerate(keys)}, request
        )
        self.later.add(handle)
        return handle, request

    def deliver_finish(
        self, handle: int, request: str | None, keys: list[int], timeout: float = 20
    ) -> dict[str, Any]:
        started = time.monotonic()
        try:
            entries = self.engine.wait(self.kv, handle, len(keys), timeout)
        finally:
            self.later.discard(handle)
        elapsed = time.monotonic() - started
        # After a failed remote operation the request's hint says MISS for what it covered.
        after = [s.name for s, _ in self.kv.query([key(k) for k in keys], request)]
        if request is not None:
            self.kv.discard_hint(request)
        return {
            "entries": {
                k: (
                    entries[key(k)].status.value,
                    self.engine.checksum(LAND + i)[0] if entries[key(k)].success else None,
                )
                for i, k in enumerate(keys)
            },
            "seconds": elapsed,
            "query_after": after,
        }

    def deliver(self, keys: list[int], endpoint: str | None) -> dict[str, Any]:
        started = time.monotonic()
        handle, request = self.deliver_start(keys, endpoint)
        result = self.deliver_finish(handle, request, keys)
        result["seconds"] = time.monotonic() - started
        return result

    def fetch(self, keys: list[int], endpoint: str) -> dict[int, tuple[str, int | None]]:
        """Fetch into local G2; a success is checked where its descriptor points (the pool
        slot) and its release handle is kept here."""
        request = self._hint(keys, endpoint)
        handle = self.kv.fetch([key(k) for k in keys], request)
        entries = self.engine.wait(self.kv, handle, len(keys))
        self.kv.discard_hint(request)
        memory, (_, block) = self.runtime.memory, self.kv.config.pool_layouts[0]
        base = memory.descriptors.addr(memory.pool_base[0])  # the pool's first slot
        out: dict[int, tuple[str, int | None]] = {}
        for k in keys:
            entry = entries[key(k)]
            checksum = None
            if entry.success:
                assert entry.descriptors is not None and entry.release_handle is not None
                slot = entry.descriptors[0].element_index
                checksum = zlib.crc32(ctypes.string_at(base + slot * block, block))
                self.held[entry.release_handle] = k
            out[k] = (entry.status.value, checksum)
        return out

    def release(self, count: int) -> dict[str, Any]:
        """Release ``count`` held handles (oldest first) and one handle nobody holds."""
        handles = list(self.held)[:count]
        unknown = max(self.held, default=0) + 10**9
        results = self.kv.release([*handles, unknown])
        for handle in handles:
            del self.held[handle]
        return {"released": [ok for _, ok in results[:-1]], "unknown": results[-1][1]}

    def engine_hold(self, keys: list[int]) -> None:
        """The engine now holds exactly ``keys`` (in its own memory, pinned on request)."""
        self.pins.engine_has.clear()
        for i, k in enumerate(keys):
            self.engine.write(HELD + i, seed=k)
            self.pins.engine_has[key(k)] = HELD + i

    def resident(self) -> list[int]:
        return sorted(int.from_bytes(k, "big") for k in self.runtime.index.resident_keys())

    def _busy(self) -> dict[str, int]:
        """What is still in flight in the instance (all zero once quiet)."""
        rt = self.runtime
        links, source, pins, transfers = rt.links, rt.source, rt.pins, rt.transfers
        assert links is not None and source is not None and pins is not None
        assert transfers is not None
        return {
            "ops": len(rt.ops),
            "open_ops": len(self.runtime.shared.open_ops),
            "transfers": transfers.in_flight,
            "pulls": links.pulls_in_flight(),
            "source_jobs": len(source.jobs),
            "pins_outstanding": pins.outstanding,
            "pins_abandoned": pins.abandoned,
            "engine_pins": len(self.pins.pinned),
            "outbox": len(rt.outbox.results) + len(rt.shared.calls.queue),
        }

    def quiet(self, timeout: float, stranded: int = 0) -> float:
        """Wait until nothing is in flight (polling like an engine); the seconds it took.
        ``stranded``: pulls that may stay in flight, held until their source's endpoint
        answers again (a source that died unconfirmed, with nobody at its endpoint).

        First a fence: an empty deliver, answered only after every command queued before
        it (a release, say) was dispatched, since the runtime takes commands in order."""
        started = time.monotonic()
        fence = self.kv.deliver({})
        self.later.add(fence)
        while fence not in self.engine.completed:
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"the runtime did not take a command within {timeout} s")
            self.absorb()
            time.sleep(0.001)
        self.later.discard(fence)
        del self.engine.completed[fence]
        while True:
            self.absorb()
            busy = self._busy()
            if busy["pulls"] <= stranded and not any(n for k, n in busy.items() if k != "pulls"):
                return time.monotonic() - started
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"not quiet after {timeout} s: {busy}")
            time.sleep(0.005)

    def audit(self) -> dict[str, Any]:
        """The instance's accounting and this process's resources; call once quiet."""
        rt = self.runtime
        local, links, plane = rt.local, rt.links, rt.plane
        assert local is not None and links is not None and plane is not None
        for event in self.recorder.inventory:
            if event.tier is CacheTier.LOCAL_G2:
                keys = {int.from_bytes(k, "big") for k in event.keys}
                self.inventory = self.inventory - keys if event.removed else self.inventory | keys
        self.recorder.inventory.clear()
        events: dict[int, list[str]] = {}
        for error in self.recorder.resilience:
            events.setdefault(error.op_handle, []).append(error.state)
        self.recorder.resilience.clear()
        # The harness's own pin bookkeeping would grow with every pull: keep what is live.
        for request in [r for r in self.pins.requests if r in self.pins.answered]:
            del self.pins.requests[request]
            self.pins.answered.discard(request)
        self.pins.released.clear()
        held_keys = sorted(self.held.values())
        return {
            "busy": self._busy(),
            "index": rt.index.audit(),
            "capacity": rt.index.pools[0].capacity,
            "resident": self.resident(),
            "inventory": sorted(self.inventory),
            "held": held_keys,
            "handles_runtime": sorted(int.from_bytes(k, "big") for k in local.handles.values()),
            "handles_live": len(self.runtime.shared.live_handles),
            "claims": {
                int.from_bytes(b.key, "big"): b.claims for b in list(rt.index.blocks()) if b.claims
            },
            "resilience": events,
            "callbacks_off_thread": list(self.recorder.threads.wrong),
            "links": len(links.links),
            "dropped": dict(plane.dropped),
            "fds": len(os.listdir("/proc/self/fd")),
            "threads": len(os.listdir("/proc/self/task")),
            "rss_kib": rss_kib(),
        }


if __name__ == "__main__":
    main()
