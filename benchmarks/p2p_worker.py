"""Source side ("A") of ``benchmarks/p2p.py``: a child process holding one kvcr instance (the
peer that is pulled from) and one bare NIXL agent (the raw baseline), driven by the parent
over a socketpair.

Run by ``p2p.py`` only: ``python p2p_worker.py FD``. The parent sends pickled
``(command, *args)`` tuples and gets one ``(status, value)`` reply each (an exception comes
back as ``("error", traceback)``). Between commands the main thread is the engine's
scheduler loop: it sleeps (in ``poll`` on the socketpair) and calls ``poll_completed``
every ``cadence`` seconds (``("cadence", s)`` sets it; 1 ms at start). kvcr serves pulls from
its pool on its runtime thread alone; engine pins are made inside those polls (contract
section 4), so the cadence is what a pin costs.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import traceback
import zlib
from multiprocessing.connection import Connection
from typing import Any

from common import (
    CpuSpan,
    Engine,
    bare_agent,
    bench_pages,
    crcs,
    open_instance,
    randomized,
    raw_transfer,
    runtime_thread,
)

from kvcr import KVCRBindings
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.types import BlockKey, MemoryRef

BUSY_PERIOD_S = 0.010  # a busy engine's step: busy share in Python, the rest asleep
POOL_KEY_BASE = 1_000_000  # keys deposited into the source's kvcr pool
ENGINE_KEY_BASE = 2_000_000  # keys only the source's engine holds (served by pinning)


def block_key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(8, "big"))


class IntKeys:
    """Key adapter: a kvcr key is the router's 64-bit block hash, big-endian."""

    def encode(self, framework_key: int) -> BlockKey:
        return block_key(framework_key)

    def decode(self, key: BlockKey) -> int:
        return int.from_bytes(key, "big")


class EnginePins:
    """The engine's pin bindings: every requested key it holds is granted at once (the
    engine holds key ``ENGINE_KEY_BASE + i`` in element ``i`` of its region)."""

    def __init__(self, agent: str, count: int) -> None:
        self.agent = agent
        self.count = count
        self._next = 0
        self._lock = threading.Lock()
        self._pending: list[tuple[int, list[BlockKey]]] = []
        self.granted = 0
        self.released = 0

    def element(self, key: BlockKey) -> int | None:
        i = int.from_bytes(key, "big") - ENGINE_KEY_BASE
        return i if 0 <= i < self.count else None

    def request_pin(self, keys: list[BlockKey]) -> int:
        with self._lock:
            self._next += 1
            self._pending.append((self._next, list(keys)))
            return self._next

    def poll_pin_results(self) -> list[tuple[int, Any]]:
        with self._lock:
            pending, self._pending = self._pending, []
        out = []
        for request, keys in pending:
            refs = {}
            for k in keys:
                e = self.element(k)
                refs[k] = (
                    None if e is None else [MemoryRef(end_point_name=self.agent, element_index=e)]
                )
            self.granted += 1
            out.append((request, (f"pin-{request}", refs)))
        return out

    def release_pin(self, handle: str) -> bool:
        self.released += 1
        return True


class Source:
    """One benchmark case's source: kvcr instance + raw NIXL registrations."""

    def __init__(self, raw: Any, label: str, block: int, count: int, port: int) -> None:
        self.block, self.count = block, count
        self.agent = f"p2p-src-{label}-{os.getpid()}"
        self.region = bench_pages(block * count)
        self.region[:] = randomized(block * count, seed=block + count)
        self.pool = bench_pages(block * count, 0xAA)
        self.region_crcs = crcs(self.region, block, count)
        self.pins = EnginePins(self.agent, count)
        self.channel = ZmqPeerControlChannel("127.0.0.1", port, "127.0.0.1")
        bindings = KVCRBindings(
            request_pin=self.pins.request_pin,
            poll_pin_results=self.pins.poll_pin_results,
            release_pin=self.pins.release_pin,
            framework_control=self.channel,
            key_adapter=IntKeys(),
        )
        opened = open_instance(self.agent, block, self.region, self.pool, bindings)
        self.kv, self.runtime = opened.kv, opened.runtime
        self.thread = runtime_thread(self.agent)
        # Raw baseline: the same buffers, registered with the process's bare agent.
        self.raw = raw
        self.regs = [
            raw.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
            for buf in (self.region, self.pool)
        ]
        self.dlists: dict[str, Any] = {}
        self.remote: Any = None
        self.peer: str | None = None
        self.writes = 0

    def deposit(self) -> list[int]:
        """Deposit region element i as key POOL_KEY_BASE + i; returns the pool slot of each
        key (the raw baseline writes from the same slots)."""
        blocks = {
            block_key(POOL_KEY_BASE + i): [MemoryRef(end_point_name=self.agent, element_index=i)]
            for i in range(self.count)
        }
        handle = self.kv.deposit(blocks, no_evict=True)
        Engine(self.kv, self.agent, 0.0005).done(handle, self.count, "deposit")
        index = self.runtime.index  # benchmark-only peek: where the blocks landed
        slots = []
        for i in range(self.count):
            block = index.get(block_key(POOL_KEY_BASE + i))
            if block is None:
                raise RuntimeError(f"deposit: key {i} is not resident after success")
            slots.append(block.slots[0])
        self.slots = slots
        pool_crcs = [zlib.crc32(self.pool[s * self.block : (s + 1) * self.block]) for s in slots]
        if pool_crcs != self.region_crcs:
            raise RuntimeError("deposit: pool bytes differ from the engine region's")
        gc.collect()
        gc.freeze()  # as vLLM does after start-up: full collections skip the start-up heap
        return slots

    def raw_connect(self, metadata: bytes, dst: list[tuple[int, int]]) -> str:
        """Load the destination's raw agent metadata; prepare the descriptor lists the raw
        baseline writes: pool slots (kvcr-owned case) or region elements (engine-owned)."""
        name = self.raw.add_remote_agent(metadata)
        self.peer = name.decode() if isinstance(name, bytes) else str(name)
        b = self.block
        pool = self.pool.ctypes.data
        region = self.region.ctypes.data
        self.dlists["pool"] = self.raw.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [(pool + s * b, b, 0) for s in self.slots], "DRAM"
        )
        self.dlists["engine"] = self.raw.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [(region + i * b, b, 0) for i in range(self.count)], "DRAM"
        )
        self.remote = self.raw.prep_xfer_dlist(self.peer, [(addr, n, 0) for addr, n in dst], "DRAM")
        return self.peer

    def raw_write(self, variant: str, notif: bytes, n: int) -> float:
        """One WRITE of the first ``n`` blocks with a notification; spins until DONE (the
        destination must call into NIXL meanwhile). Returns seconds from make to release."""
        idx = list(range(n))
        elapsed = raw_transfer(
            self.raw, "WRITE", self.dlists[variant], idx, self.remote, idx, notif
        )
        self.writes += 1
        return elapsed

    def close(self) -> None:
        self.kv.close()
        self.channel.close()
        for dlist in [*self.dlists.values(), *([self.remote] if self.remote else [])]:
            dlist.release()
        self.dlists.clear()
        self.remote = None
        if self.peer is not None:
            self.raw.remove_remote_agent(self.peer)
            self.peer = None
        while self.regs:
            self.raw.deregister_memory(self.regs.pop())


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    raw = bare_agent(f"p2p-raw-src-{os.getpid()}")
    source: Source | None = None
    idle: CpuSpan | None = None
    cadence = 0.001
    busy = 0.0  # share of every BUSY_PERIOD_S the engine spends in pure Python

    def set_cadence(seconds: float) -> None:
        nonlocal cadence
        cadence = seconds

    def set_busy(share: float) -> None:
        nonlocal busy
        busy = share

    def setup(label: str, block: int, count: int, port: int) -> dict[str, Any]:
        nonlocal source
        if source is not None:
            source.close()
            source = None
        source = Source(raw, label, block, count, port)
        return {"endpoint": source.channel.endpoint, "crcs": source.region_crcs}

    engine0 = 0.0

    def idle_begin() -> None:
        nonlocal idle, engine0
        assert source is not None
        idle = CpuSpan(source.thread)
        engine0 = time.thread_time()  # this thread: the engine's scheduler loop

    def idle_end() -> dict[str, float]:
        assert source is not None and idle is not None
        return {**idle.end(), "engine": time.thread_time() - engine0}

    def pins() -> dict[str, int]:
        assert source is not None
        return {"granted": source.pins.granted, "released": source.pins.released}

    def on_source(method: str) -> Any:
        def call(*args: Any) -> Any:
            if source is None:
                raise RuntimeError(f"{method}: no setup yet")
            return getattr(source, method)(*args)

        return call

    commands = {
        "setup": setup,
        "deposit": on_source("deposit"),
        "raw_connect": on_source("raw_connect"),
        "raw_write": on_source("raw_write"),
        "idle_begin": idle_begin,
        "idle_end": idle_end,
        "pins": pins,
        "ping": lambda: None,
        "cadence": set_cadence,
        "busy": set_busy,
    }
    try:
        while True:
            wait = cadence
            if busy:
                # A step of pure-Python work that holds the GIL (a switch interval at a
                # time), then the scheduler's poll, then the rest of the period asleep.
                until = time.perf_counter() + busy * BUSY_PERIOD_S
                while time.perf_counter() < until:
                    pass
                if source is not None:
                    source.kv.poll_completed()
                wait = (1 - busy) * BUSY_PERIOD_S
            if not conn.poll(wait):
                if source is not None and not busy:
                    source.kv.poll_completed()  # one scheduler step: results, pins, events
                continue
            try:
                command, *args = conn.recv()
            except EOFError:
                return  # the parent is gone
            if command == "stop":
                if source is not None:
                    source.close()
                    source = None
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", commands[command](*args)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        if source is not None:
            source.close()


if __name__ == "__main__":
    main()
