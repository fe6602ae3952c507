"""Local (single-process, real NIXL) benchmark of kvcr's engine-facing path.

Run: ``uv run python benchmarks/local.py [--quick] [--json-only]``

Measures, in one run (so that ratios compare figures taken under the same machine noise):

1. deposit / deliver throughput through kvcr (7 MiB and 64 KiB blocks), beside ``np.copyto``
   of the same bytes and a bare NIXL agent doing the same prepped loopback READ;
2. ``query`` cost per key (1, 100, 10,000 keys; resident and all-miss);
3. median / p99 latency of every engine-facing call, as seen by the calling thread;
4. idle CPU of one instance.

Prints a human table, then one JSON line per measurement:
``{"bench", "case", "value", "unit", "baseline", "ratio"}``.

A kvcr operation is timed from the engine call until ``poll_completed`` has returned all of
its entries, polling in a tight loop (how an engine measures it). Two diagnostic rows
("diag:") repeat it with ``time.sleep(0)`` between polls, and with a tight poll under
``sys.setswitchinterval(0.0002)`` (default 0.005): both let the runtime thread get the GIL
back sooner, so their gap to the plain rows is what GIL hand-over costs.
"""

from __future__ import annotations

import os

# Must be set before nixl is imported (nixl-on-cpu.md).
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MEM_EVENTS", "no")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import argparse
import json
import statistics
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kvcr import KVCR, KVCRBindings
from kvcr.config import KVCRBackendConfigs, KVCRConfig, LocalDramOptions
from kvcr.telemetry import InMemoryStats
from kvcr.types import MemoryRef, OpEntryStatus, RegionDescriptor

try:
    from nixl_cu13._api import nixl_agent, nixl_agent_config
except ImportError:  # the meta package's shim
    from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]

KIB = 1 << 10
MIB = 1 << 20
OP_TIMEOUT_S = 30.0
DIAG_SWITCH_S = 0.0002  # sys.setswitchinterval for the diagnostic rows (default 0.005)


# -- results -----------------------------------------------------------------------------


@attrs.define
class Row:
    bench: str
    case: str
    value: float
    unit: str
    baseline: float | None = None
    target: str = ""
    ok: bool | None = None  # None: no target

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or not self.baseline:
            return None
        return self.value / self.baseline

    def as_json(self) -> str:
        ratio = self.ratio
        return json.dumps(
            {
                "bench": self.bench,
                "case": self.case,
                "value": round(self.value, 4),
                "unit": self.unit,
                "baseline": None if self.baseline is None else round(self.baseline, 4),
                "ratio": None if ratio is None else round(ratio, 4),
            }
        )


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if x >= 0.1 else f"{x:.3f}"


def print_table(rows: Sequence[Row], header: str) -> None:
    cols = ["bench", "case", "value", "unit", "baseline", "ratio", "target", "status"]
    table = [
        [
            r.bench,
            r.case,
            _fmt(r.value),
            r.unit,
            _fmt(r.baseline),
            _fmt(r.ratio),
            r.target or "",
            "" if r.ok is None else ("PASS" if r.ok else "MISS"),
        ]
        for r in rows
    ]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    right = {2, 4, 5}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    print(header)
    print(line(cols))
    print(line(["-" * w for w in widths]))
    previous = None
    for r, t in zip(rows, table):
        if previous is not None and r.bench != previous:
            print()
        previous = r.bench
        print(line(t))
    print(flush=True)


def log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"# {msg}", file=sys.stderr, flush=True)


# -- helpers -----------------------------------------------------------------------------


def touched(nbytes: int, fill: int = 0) -> np.ndarray:
    """A buffer whose pages are all faulted in (np.zeros would map them lazily)."""
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(fill)
    return buf


def randomized(nbytes: int, seed: int) -> np.ndarray:
    buf = np.empty(nbytes, dtype=np.uint8)
    np.random.default_rng(seed).random(out=buf.view(np.float64))
    return buf


def crcs(buf: np.ndarray, block: int, count: int) -> list[int]:
    return [zlib.crc32(buf[i * block : (i + 1) * block]) for i in range(count)]


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def null_bindings(stats: bool = False) -> KVCRBindings:
    return KVCRBindings(
        request_pin=lambda keys: 0,
        poll_pin_results=lambda: [],
        release_pin=lambda handle: True,
        stats_factory=InMemoryStats if stats else None,
    )


def make_instance(
    name: str,
    block: int,
    engine: np.ndarray,
    pool: np.ndarray,
    telemetry: bool = False,
) -> KVCR:
    config = KVCRConfig(
        name,
        [("", block)],
        enable_telemetry=telemetry,
        operation_timeout_ms=20_000,
        abandon_timeout_ms=40_000,
    )
    backends = KVCRBackendConfigs(
        framework_regions=[
            RegionDescriptor(addr=engine.ctypes.data, size=block, count=engine.nbytes // block)
        ],
        local_dram=LocalDramOptions([("", pool.ctypes.data, pool.nbytes)]),
    )
    return KVCR(config, null_bindings(telemetry), backends)


class Engine:
    """The engine side of one instance: submits, and collects completions by handle."""

    def __init__(self, kv: KVCR, agent: str) -> None:
        self.kv = kv
        self.agent = agent
        self.results: dict[int, dict[bytes, Any]] = {}

    def ref(self, element: int) -> list[MemoryRef]:
        return [MemoryRef(end_point_name=self.agent, element_index=element)]

    def wait(self, handle: int, nkeys: int, yielding: bool = True) -> dict[bytes, Any]:
        """Poll until the op's ``nkeys`` entries are in; returns them."""
        entries = self.results.setdefault(handle, {})
        deadline = time.monotonic() + OP_TIMEOUT_S
        while len(entries) < nkeys:
            for op, done in self.kv.poll_completed():
                self.results.setdefault(op, {}).update(done)
            if yielding:
                time.sleep(0)
            if time.monotonic() > deadline:
                raise RuntimeError(f"op {handle}: {len(entries)}/{nkeys} entries after timeout")
        return self.results.pop(handle)

    def timed(
        self, submit: Callable[[], int], nkeys: int, yielding: bool = False
    ) -> tuple[float, dict[bytes, Any]]:
        """Seconds from the engine call until poll_completed returned all entries."""
        kv, clock = self.kv, time.perf_counter
        t0 = clock()
        deadline = t0 + OP_TIMEOUT_S
        handle = submit()
        got: dict[bytes, Any] = {}
        while len(got) < nkeys:
            for op, done in kv.poll_completed():
                if op == handle:
                    got.update(done)
                else:
                    self.results.setdefault(op, {}).update(done)
            if yielding:
                time.sleep(0)
            if clock() > deadline:
                raise RuntimeError(f"op {handle}: {len(got)}/{nkeys} entries after timeout")
        elapsed = clock() - t0
        return elapsed, got


def all_success(what: str, entries: dict[bytes, Any], nkeys: int) -> None:
    bad = {k: v.status.name for k, v in entries.items() if v.status is not OpEntryStatus.SUCCESS}
    if bad or len(entries) != nkeys:
        raise RuntimeError(f"{what}: not all {nkeys} entries succeeded: {bad or len(entries)}")


# -- 1. throughput -----------------------------------------------------------------------


class RawNixl:
    """A bare NIXL agent doing the same loopback READ kvcr does (transport/nixl.py)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        self.agent.create_backend("UCX", {})
        self._regs: list[Any] = []
        self._dlists: list[Any] = []

    def register(self, buf: np.ndarray) -> None:
        self._regs.append(
            self.agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        )

    def dlists(self, buf: np.ndarray, block: int, count: int) -> tuple[Any, Any]:
        """(local, loopback) prepped descriptor lists of ``count`` blocks of ``buf``."""
        descs = [(buf.ctypes.data + i * block, block, 0) for i in range(count)]
        local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, "DRAM")
        loopback = self.agent.prep_xfer_dlist(self.name, descs, "DRAM")
        self._dlists += [local, loopback]
        return local, loopback

    def read(self, dst_local: Any, src_loopback: Any, count: int) -> float:
        """Copy ``count`` blocks (dst <- src); seconds from make to release."""
        agent = self.agent
        idx = list(range(count))
        t0 = time.perf_counter()
        handle = agent.make_prepped_xfer("READ", dst_local, idx, src_loopback, idx)
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        elapsed = time.perf_counter() - t0
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ ended in state {state}")
        return elapsed

    def reset(self) -> None:
        for dlist in self._dlists:
            dlist.release()
        self._dlists.clear()
        while self._regs:
            self.agent.deregister_memory(self._regs.pop())


def bench_throughput(
    rows: list[Row], raw: RawNixl, label: str, block: int, count: int, reps: int, quiet: bool
) -> None:
    nbytes = block * count
    gb = nbytes / 1e9
    log(f"throughput {label}: {count} x {block} B per op, {reps} reps", quiet)
    # Engine region: blocks [0, count) are deposit sources, [count, 2 count) deliver targets.
    engine = randomized(2 * nbytes, seed=block)
    engine[nbytes:] = 0
    pool = touched(3 * nbytes, 0xAA)  # count held for deliver, 2 count rotating deposits
    scratch = touched(nbytes, 0x55)  # baselines: src -> scratch (deposit direction)
    scratch2 = touched(nbytes, 0x66)  # baselines: scratch -> scratch2 (deliver direction)
    src_view = engine[:nbytes]
    dst_view = engine[nbytes:]
    src_crcs = crcs(src_view, block, count)

    agent = f"bench-{label}"
    kv = make_instance(agent, block, engine, pool)
    eng = Engine(kv, agent)
    try:
        raw.register(engine)
        raw.register(scratch)
        raw.register(scratch2)
        src_local, src_loop = raw.dlists(src_view, block, count)
        scr_local, scr_loop = raw.dlists(scratch, block, count)
        scr2_local, _ = raw.dlists(scratch2, block, count)
        del src_local

        # Resident keys for deliver, held (no_evict) so rotating deposits cannot evict them.
        resident = {b"R%06d" % i: eng.ref(i) for i in range(count)}
        h = kv.deposit(resident, no_evict=True)
        entries = eng.wait(h, count)
        all_success("resident deposit", entries, count)
        delivery = {key: eng.ref(count + i) for i, key in enumerate(resident)}

        # Verify once: kvcr deposit + deliver, raw NIXL and memcpy all move the right bytes.
        entries = eng.wait(kv.deliver(delivery), count)
        all_success("verification deliver", entries, count)
        if crcs(dst_view, block, count) != src_crcs:
            raise RuntimeError(f"{label}: delivered bytes differ from deposited bytes")
        raw.read(scr_local, src_loop, count)
        if crcs(scratch, block, count) != src_crcs:
            raise RuntimeError(f"{label}: raw NIXL READ moved wrong bytes")
        raw.read(scr2_local, scr_loop, count)
        if crcs(scratch2, block, count) != src_crcs:
            raise RuntimeError(f"{label}: raw NIXL READ moved wrong bytes")
        scratch2.fill(0x66)
        np.copyto(scratch2, scratch)
        if crcs(scratch2, block, count) != src_crcs:
            raise RuntimeError(f"{label}: memcpy moved wrong bytes")
        dst_view.fill(0)

        serial = iter(range(10**9))

        def deposit(yielding: bool) -> float:
            blocks = {b"D%09d" % next(serial): eng.ref(i) for i in range(count)}
            elapsed, got = eng.timed(lambda: kv.deposit(blocks), count, yielding)
            all_success("deposit", got, count)
            return elapsed

        def deliver(yielding: bool) -> float:
            elapsed, got = eng.timed(lambda: kv.deliver(delivery), count, yielding)
            all_success("deliver", got, count)
            return elapsed

        def short_switch(run: Callable[[bool], float]) -> float:
            """Diagnostic: tight poll, but the GIL changes hands every 0.2 ms, not 5 ms."""
            previous = sys.getswitchinterval()
            sys.setswitchinterval(DIAG_SWITCH_S)
            try:
                return run(False)
            finally:
                sys.setswitchinterval(previous)

        def memcpy(dst: np.ndarray, src: np.ndarray) -> float:
            t0 = time.perf_counter()
            np.copyto(dst, src)
            return time.perf_counter() - t0

        cases: dict[str, Callable[[], float]] = {
            "deposit/memcpy": lambda: memcpy(scratch, src_view),
            "deposit/raw-nixl": lambda: raw.read(scr_local, src_loop, count),
            "deposit/kvcr": lambda: deposit(False),
            "deposit/kvcr-yielding": lambda: deposit(True),
            "deposit/kvcr-switch": lambda: short_switch(deposit),
            "deliver/memcpy": lambda: memcpy(scratch2, scratch),
            "deliver/raw-nixl": lambda: raw.read(scr2_local, scr_loop, count),
            "deliver/kvcr": lambda: deliver(False),
            "deliver/kvcr-yielding": lambda: deliver(True),
            "deliver/kvcr-switch": lambda: short_switch(deliver),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for rep in range(reps + 2):  # two warm-up rounds, interleaved cases
            for name, run in cases.items():
                elapsed = run()
                if rep >= 2:
                    times[name].append(elapsed)

        # The timed delivers must have rewritten the targets with the deposited bytes, and
        # the last timed deposit must be resident with the right bytes.
        if crcs(dst_view, block, count) != src_crcs:
            raise RuntimeError(f"{label}: timed delivers left wrong bytes")
        newest = next(serial) - 1
        last = {b"D%09d" % (newest - i): eng.ref(count + i) for i in range(count)}
        dst_view.fill(0)
        entries = eng.wait(kv.deliver(last), count)
        all_success("check deliver", entries, count)
        got = crcs(dst_view, block, count)
        if sorted(got) != sorted(src_crcs):
            raise RuntimeError(f"{label}: a timed deposit stored wrong bytes")
    finally:
        kv.close()
        raw.reset()

    def gbps(name: str) -> tuple[float, float]:
        samples = times[name]
        return gb / statistics.median(samples), gb / min(samples)

    what = f"{label} x{count}"
    for direction in ("deposit", "deliver"):
        mc_med, mc_best = gbps(f"{direction}/memcpy")
        raw_med, raw_best = gbps(f"{direction}/raw-nixl")
        kv_med, kv_best = gbps(f"{direction}/kvcr")
        ky_med, _ = gbps(f"{direction}/kvcr-yielding")
        ks_med, _ = gbps(f"{direction}/kvcr-switch")
        gated = block == 7 * MIB
        target = ">=0.8x memcpy" if gated else ""
        rows += [
            Row(direction, f"{what} memcpy median", mc_med, "GB/s"),
            Row(direction, f"{what} memcpy best", mc_best, "GB/s"),
            Row(direction, f"{what} raw-nixl median", raw_med, "GB/s", mc_med),
            Row(direction, f"{what} raw-nixl best", raw_best, "GB/s", mc_best),
            Row(
                direction,
                f"{what} kvcr median vs memcpy",
                kv_med,
                "GB/s",
                mc_med,
                target,
                kv_med >= 0.8 * mc_med if gated else None,
            ),
            Row(direction, f"{what} kvcr median vs raw-nixl", kv_med, "GB/s", raw_med),
            Row(direction, f"{what} kvcr best vs memcpy", kv_best, "GB/s", mc_best),
            Row(direction, f"{what} kvcr best vs raw-nixl", kv_best, "GB/s", raw_best),
            Row(direction, f"{what} diag: kvcr yielding poll median", ky_med, "GB/s", mc_med),
            Row(
                direction, f"{what} diag: kvcr switchinterval 0.2ms median", ks_med, "GB/s", mc_med
            ),
        ]


# -- 2. query ----------------------------------------------------------------------------


def bench_query(rows: list[Row], samples: int, quiet: bool) -> None:
    block, resident_keys, region = 4 * KIB, 10_000, 256
    log(f"query: {resident_keys} resident keys, {samples} samples per case", quiet)
    engine = randomized(block * region, seed=7)
    pool = touched(block * (resident_keys + 240))
    agent = "bench-query"
    kv = make_instance(agent, block, engine, pool)
    eng = Engine(kv, agent)
    try:
        keys = [b"Q%09d" % i for i in range(resident_keys)]
        misses = [b"M%09d" % i for i in range(resident_keys)]
        for start in range(0, resident_keys, 1000):
            batch = {k: eng.ref(i % region) for i, k in enumerate(keys[start : start + 1000])}
            all_success("query fill", eng.wait(kv.deposit(batch), len(batch)), len(batch))
        check = kv.query(keys)
        if any(status.name != "HIT" for status, _ in check) or any(
            status.name != "MISS" for status, _ in kv.query(misses)
        ):
            raise RuntimeError("query: resident keys are not all HIT or misses not all MISS")

        for n in (1, 100, 10_000):
            calls = max(1, 100 // n)  # calls per sample, so the timer does not dominate
            for kind, pool_keys in (("resident", keys), ("all-miss", misses)):
                batch = pool_keys[:n]
                query = kv.query
                per_key = []
                for _ in range(samples):
                    t0 = time.perf_counter_ns()
                    for _ in range(calls):
                        query(batch)
                    per_key.append((time.perf_counter_ns() - t0) / 1e3 / calls / n)
                med = statistics.median(per_key)
                gated = n == 10_000
                rows.append(
                    Row(
                        "query",
                        f"{n} keys {kind} per key (median)",
                        med,
                        "us/key",
                        target="<=2 us/key" if gated else "",
                        ok=med <= 2.0 if gated else None,
                    )
                )
    finally:
        kv.close()


# -- 3. engine-facing call latency -------------------------------------------------------


def bench_calls(rows: list[Row], notes: list[str], samples: int, trips: int, quiet: bool) -> None:
    block, region, held = 4 * KIB, 256, 64
    log(f"engine-facing calls: {samples} samples each", quiet)
    engine = randomized(block * region, seed=11)
    pool = touched(block * 2048)
    agent = "bench-calls"
    kv = make_instance(agent, block, engine, pool, telemetry=True)
    eng = Engine(kv, agent)
    settle = 100e-6  # let the runtime go idle between samples (outside the timed region)
    results: dict[str, list[float]] = {}
    clock = time.perf_counter_ns
    try:
        resident = [b"H%06d" % i for i in range(held)]
        blocks = {k: eng.ref(i) for i, k in enumerate(resident)}
        all_success("held deposit", eng.wait(kv.deposit(blocks, no_evict=True), held), held)

        def sample(name: str, body: Callable[[int], None]) -> None:
            for i in range(samples + 50):
                body(i)
            results[name] = results[name][50:]  # warm-up

        def record(name: str, ns: int) -> None:
            results.setdefault(name, []).append(ns / 1e3)

        def deposit(i: int) -> None:
            blocks = {b"d%09d" % i: eng.ref(i % held)}
            t0 = clock()
            h = kv.deposit(blocks)
            record("deposit (1 key)", clock() - t0)
            eng.wait(h, 1)
            time.sleep(settle)

        def deliver(i: int) -> None:
            blocks = {resident[i % held]: eng.ref(held + i % (region - held))}
            t0 = clock()
            h = kv.deliver(blocks)
            record("deliver (1 key)", clock() - t0)
            all_success("deliver", eng.wait(h, 1), 1)
            time.sleep(settle)

        handles: list[int] = []

        def fetch(i: int) -> None:
            keys = [resident[i % held]]
            t0 = clock()
            h = kv.fetch(keys)
            record("fetch (1 key)", clock() - t0)
            entries = eng.wait(h, 1)
            all_success("fetch", entries, 1)
            handles.append(next(iter(entries.values())).release_handle)
            time.sleep(settle)

        def release(i: int) -> None:
            batch = [handles[i]]
            t0 = clock()
            result = kv.release(batch)
            record("release (1 handle)", clock() - t0)
            if not result[0][1]:
                raise RuntimeError("release: a live handle was refused")
            time.sleep(settle)

        aborted = [0]

        def abort(i: int) -> None:
            h = kv.deposit({b"a%09d" % i: eng.ref(i % held)})
            t0 = clock()
            ok = kv.abort(h)
            record("abort (in-flight deposit)", clock() - t0)
            aborted[0] += bool(ok)
            eng.wait(h, 1)
            time.sleep(settle)

        def align(i: int) -> None:
            keys = resident[i % (held - 10) :][:10]
            t0 = clock()
            kv.align_sequence(keys)
            record("align_sequence (10 keys)", clock() - t0)
            time.sleep(settle)

        def poll(i: int) -> None:
            t0 = clock()
            out = kv.poll_completed()
            record("poll_completed (empty)", clock() - t0)
            if out:
                raise RuntimeError(f"poll_completed: unexpected results {out}")

        def stats(i: int) -> None:
            t0 = clock()
            snapshot = kv.get_stats()
            record("get_stats", clock() - t0)
            if snapshot is None:
                raise RuntimeError("get_stats returned None with telemetry enabled")

        def query(i: int) -> None:
            keys = [resident[i % held]]
            t0 = clock()
            kv.query(keys)
            record("query (1 key)", clock() - t0)

        sample("deposit (1 key)", deposit)
        sample("deliver (1 key)", deliver)
        sample("fetch (1 key)", fetch)
        handles = handles[50:] + handles[:50]  # any order; all are live
        sample("release (1 handle)", release)
        sample("abort (in-flight deposit)", abort)
        notes.append(
            f"abort: {aborted[0]} of {samples + 50} aborts found the deposit still pending "
            "(returned True)"
        )
        sample("align_sequence (10 keys)", align)
        sample("poll_completed (empty)", poll)
        sample("get_stats", stats)
        sample("query (1 key)", query)

        # Round trip of a 1-key deposit, call -> poll_completed has its entry: with the
        # engine thread spinning on poll_completed, and yielding (time.sleep(0)) meanwhile.
        trip: dict[str, list[float]] = {"tight poll": [], "yielding poll": []}
        for i in range(trips + 10):
            for j, values in enumerate(trip.values()):
                blocks = {b"t%09d" % (2 * i + j): eng.ref(i % held)}
                elapsed, got = eng.timed(lambda b=blocks: kv.deposit(b), 1, j == 1)
                all_success("round trip deposit", got, 1)
                if i >= 10:
                    values.append(elapsed * 1e6)
                time.sleep(settle)
    finally:
        kv.close()

    for name, values in results.items():
        med = statistics.median(values)
        rows.append(Row("call", f"{name} median", med, "us", target="<=20 us", ok=med <= 20.0))
        rows.append(Row("call", f"{name} p99", percentile(values, 99), "us"))
    for mode, values in trip.items():
        rows.append(
            Row("roundtrip", f"deposit 1x4KiB, {mode}, median", statistics.median(values), "us")
        )
        rows.append(Row("roundtrip", f"deposit 1x4KiB, {mode}, p99", percentile(values, 99), "us"))


# -- 4. idle CPU -------------------------------------------------------------------------


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds of one thread, via its CPU clock (or /proc as a fallback)."""
    assert thread.ident is not None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, AttributeError):
        with open(f"/proc/self/task/{thread.native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_idle(rows: list[Row], seconds: float, quiet: bool) -> None:
    log(f"idle CPU: 1 s settle, {seconds:.0f} s measured", quiet)
    block = 4 * KIB
    engine = randomized(block * 64, seed=3)
    pool = touched(block * 64)
    agent = "bench-idle"
    kv = make_instance(agent, block, engine, pool)
    try:
        thread = next(t for t in threading.enumerate() if t.name == f"kvcr-{agent}")
        time.sleep(1.0)
        wall0, proc0, thr0 = time.monotonic(), time.process_time(), thread_cpu_s(thread)
        time.sleep(seconds)  # the main thread sleeps: process CPU is kvcr's (and NIXL's)
        wall = time.monotonic() - wall0
        proc = time.process_time() - proc0
        thr = thread_cpu_s(thread) - thr0
    finally:
        kv.close()
    thr_pct, proc_pct = 100 * thr / wall, 100 * proc / wall
    rows.append(
        Row(
            "idle",
            f"runtime thread kvcr-{agent}",
            thr_pct,
            "% core",
            target="<=2 %",
            ok=thr_pct <= 2.0,
        )
    )
    rows.append(
        Row(
            "idle",
            "whole process (main thread asleep)",
            proc_pct,
            "% core",
            target="<=2 %",
            ok=proc_pct <= 2.0,
        )
    )


# -- main --------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (< ~1 min)")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON lines")
    args = parser.parse_args(argv)
    quiet = args.json_only
    if args.quick:
        reps_big, reps_small, q_samples, c_samples, trips = 6, 15, 300, 1500, 100
    else:
        reps_big, reps_small, q_samples, c_samples, trips = 40, 100, 1000, 5000, 400
    started = time.monotonic()
    rows: list[Row] = []
    notes: list[str] = []
    bench_idle(rows, 5.0, quiet)
    raw = RawNixl("bench-raw")
    bench_throughput(rows, raw, "7MiB", 7 * MIB, 16, reps_big, quiet)
    bench_throughput(rows, raw, "64KiB", 64 * KIB, 256, reps_small, quiet)
    del raw
    bench_query(rows, q_samples, quiet)
    bench_calls(rows, notes, c_samples, trips, quiet)
    order = {"deposit": 0, "deliver": 1, "query": 2, "call": 3, "roundtrip": 4, "idle": 5}
    rows.sort(key=lambda r: order[r.bench])  # stable: keeps case order within a bench
    elapsed = time.monotonic() - started
    if not args.json_only:
        mode = "quick" if args.quick else "full"
        print_table(
            rows,
            f"kvcr local benchmark ({mode}, {elapsed:.0f} s, {os.cpu_count()} CPUs, "
            f"Python {sys.version.split()[0]})",
        )
        missed = [r for r in rows if r.ok is False]
        print(f"targets: {sum(r.ok is True for r in rows)} PASS, {len(missed)} MISS")
        for note in notes:
            print(f"note: {note}")
        print()
    for row in rows:
        print(row.as_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
