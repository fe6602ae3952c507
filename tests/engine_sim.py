"""A simulated inference engine for tests: its own KV buffers, KVCR-owned pools, and the
bookkeeping an adapter does (refs, completions, checksums).

The engine owns one framework region per pool (labelled with the pool's name) and a pool
buffer per pool that it hands to KVCR through ``LocalDramOptions``, like vLLM's adapter.
Block ``i`` of the engine holds bytes derived from a seed so tests can check content.
"""

from __future__ import annotations

import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import trio

from kvcr.api import KVCR
from kvcr.config import KVCRBackendConfigs, KVCRConfig, LocalDramOptions
from kvcr.hints import fetch_hint
from kvcr.telemetry import InMemoryStats
from kvcr.testing import kvcr_in_loop, open_kvcr
from kvcr.types import BlockKey, MemoryRef, OpEntryResult, RegionDescriptor


def key(i: int) -> BlockKey:
    return BlockKey(b"k%06d" % i)


def router_hint(endpoint: str, block_hashes: list[int]) -> dict:
    """The envelope Dynamo's KV router sends: fetch these blocks from ``endpoint``."""
    return fetch_hint(endpoint, block_hashes)


class EngineSim:
    def __init__(
        self,
        name: str = "engine",
        layouts: Sequence[tuple[str, int]] = (("", 4096),),
        pool_blocks: int = 8,
        region_blocks: int = 32,
        stride: int = 0,
        **config: Any,
    ) -> None:
        self.name = name
        self.layouts = list(layouts)
        self.stride = stride
        self.region_blocks = region_blocks
        self.regions: list[np.ndarray] = []
        self.pools: list[np.ndarray] = []
        descriptors = []
        for pool, size in self.layouts:
            pitch = stride or size
            region = np.zeros(pitch * region_blocks, dtype=np.uint8)
            self.regions.append(region)
            descriptors.append(
                RegionDescriptor(
                    addr=region.ctypes.data,
                    size=size,
                    stride=stride,
                    count=region_blocks,
                    label=pool,
                )
            )
            self.pools.append(np.zeros(size * pool_blocks, dtype=np.uint8))
        self.config = KVCRConfig(name, self.layouts, **config)
        self.backend_configs = KVCRBackendConfigs(
            framework_regions=descriptors,
            local_dram=LocalDramOptions(
                [
                    (pool, buf.ctypes.data, buf.nbytes)
                    for (pool, _), buf in zip(self.layouts, self.pools)
                ]
            ),
        )
        self.completed: dict[int, dict[BlockKey, OpEntryResult]] = {}

    # -- engine memory ---------------------------------------------------------------------

    def view(self, pool: int, element: int) -> np.ndarray:
        size = self.layouts[pool][1]
        start = element * (self.stride or size)
        return self.regions[pool][start : start + size]

    def write(self, element: int, seed: int) -> None:
        """Fill element ``element`` of every region with bytes derived from ``seed``."""
        for pool in range(len(self.layouts)):
            rng = np.random.default_rng(seed * 1000 + pool)
            view = self.view(pool, element)
            view[:] = rng.integers(0, 256, view.size, dtype=np.uint8)

    def checksum(self, element: int) -> list[int]:
        return [zlib.crc32(self.view(p, element).tobytes()) for p in range(len(self.layouts))]

    def clear(self, element: int) -> None:
        for pool in range(len(self.layouts)):
            self.view(pool, element)[:] = 0

    def refs(self, element: int) -> list[MemoryRef]:
        return [
            MemoryRef(end_point_name=self.name, label=pool, element_index=element)
            for pool, _ in self.layouts
        ]

    def blocks(self, pairs: Iterable[tuple[BlockKey, int]]) -> dict[BlockKey, list[MemoryRef]]:
        return {k: self.refs(element) for k, element in pairs}

    # -- completions -----------------------------------------------------------------------

    def absorb(self, kv: Any) -> None:
        for handle, entries in kv.poll_completed():
            self.completed.setdefault(handle, {}).update(entries)

    def wait(
        self, kv: Any, handle: int, count: int, timeout: float = 10.0
    ) -> dict[BlockKey, OpEntryResult]:
        """Poll like an engine until ``count`` entries of ``handle`` arrived (threaded KVCR)."""
        deadline = time.monotonic() + timeout
        while len(self.completed.get(handle, {})) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"op {handle}: {self.completed.get(handle)} after {timeout} s")
            self.absorb(kv)
            time.sleep(0.0005)
        return self.completed.pop(handle)

    async def await_op(
        self, kv: Any, handle: int, count: int, timeout: float | None = 60.0
    ) -> dict[BlockKey, OpEntryResult]:
        """The same inside a trio loop (an in-loop KVCR, possibly under MockClock)."""
        with trio.fail_after(timeout):
            while len(self.completed.get(handle, {})) < count:
                self.absorb(kv)
                await trio.sleep(0.001)
        return self.completed.pop(handle)

    def statuses(self, entries: dict[BlockKey, OpEntryResult]) -> dict[BlockKey, str]:
        return {k: v.status.value for k, v in entries.items()}


# The calls an engine makes into KVCR, inside which KVCR may call the engine back (contract
# section 4), and the in-loop harness's stand-in for close().
_ENGINE_CALLS = frozenset(
    {
        KVCR.__init__.__code__,
        open_kvcr.__code__,  # construction, with the runtime at hand
        KVCR.poll_completed.__code__,
        KVCR.get_stats.__code__,
        KVCR.close.__code__,
        kvcr_in_loop.__wrapped__.__code__,  # type: ignore[attr-defined]
    }
)
ENGINE_CALLBACKS = (
    "request_pin",
    "poll_pin_results",
    "release_pin",
    "cancel_pin_request",
    "inventory_sink",
    "capacity_needed_callback",
    "stats_factory",
    "on_resilience_event",
)


CALLBACK_CHECKS: list[CallbackThreads] = []  # every one made during the current test


def _inside_engine_call() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in _ENGINE_CALLS:
            return True
        frame = frame.f_back
    return False


class CallbackThreads:
    """The contract's rule for engine callbacks (section 4), checked on every call: on the
    engine's thread (the one that made this object), inside a call the engine is making
    into KVCR. Breaches are recorded, not raised: KVCR logs and survives a raising callback,
    which would hide them."""

    def __init__(self) -> None:
        self.engines = {threading.get_ident()}
        self.calls = 0
        self.wrong: list[str] = []
        CALLBACK_CHECKS.append(self)

    def add_engine_thread(self) -> None:
        """The calling thread is one of the engine's too (an engine that polls from two)."""
        self.engines.add(threading.get_ident())

    def check(self, name: str) -> None:
        self.calls += 1
        if threading.get_ident() not in self.engines:
            self.wrong.append(f"{name} called on thread {threading.current_thread().name!r}")
        elif not _inside_engine_call():
            self.wrong.append(f"{name} called outside any call the engine made into KVCR")

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def checked(*args: Any) -> Any:
            self.check(name)
            return fn(*args)

        return checked


class CheckedStats(InMemoryStats):
    """An engine's stats object whose methods check the thread rule too."""

    def __init__(self, threads: CallbackThreads) -> None:
        super().__init__()
        self.threads = threads

    def increase_counter(self, *args: Any) -> None:
        self.threads.check("stats.increase_counter")
        super().increase_counter(*args)

    def set_gauge(self, *args: Any) -> None:
        self.threads.check("stats.set_gauge")
        super().set_gauge(*args)

    def observe_histogram(self, *args: Any) -> None:
        self.threads.check("stats.observe_histogram")
        super().observe_histogram(*args)


class Recorder:
    """The engine's callbacks, recording what KVCR tells it, in plain lists (no locks, as
    adapters keep them), each call checked against the thread rule (``threads``)."""

    def __init__(self) -> None:
        self.inventory: list[Any] = []
        self.capacity: list[list[tuple[str, int]]] = []
        self.resilience: list[Exception] = []
        self.threads = CallbackThreads()

    def bindings(self, **overrides: Any) -> Any:
        from kvcr import KVCRBindings

        fields: dict[str, Any] = {
            "request_pin": lambda keys: 0,
            "poll_pin_results": lambda: [],
            "release_pin": lambda handle: True,
            "inventory_sink": self.inventory.append,
            "capacity_needed_callback": self.capacity.append,
            "on_resilience_event": self.resilience.append,
        }
        fields.update(overrides)
        if fields.get("stats_factory") is InMemoryStats:
            fields["stats_factory"] = lambda: CheckedStats(self.threads)
        for name in ENGINE_CALLBACKS:
            if callable(fields.get(name)):
                fields[name] = self.threads.wrap(name, fields[name])
        return KVCRBindings(**fields)

    def inventory_keys(self, removed: bool) -> list[BlockKey]:
        return [k for event in self.inventory if event.removed == removed for k in event.keys]
