"""Scale: what grows with the number of resident blocks, at 10k, 100k and 1M (issue 19).

Run: ``uv run python benchmarks/scale.py [--quick] [--json-only] [--runs N]`` (``--quick``: 10k and
100k only, ~1 min; the full run ~4 min and ~6 GiB of /dev/shm); ``nox -s scale``.

Blocks are 4 KiB so that a million fit this machine: the bookkeeping is per block, not per
byte. For each count N, one guard service with one group of N blocks:

1. **fill**: a KVCR over the group (this process) deposits N blocks, 1,000 a call, from a
   1,000-element engine region. Then, in this process, at N resident:
   - ``rss``: anonymous memory (``RssAnon``: the pools are shared mappings) grown per
     resident block, from before the instance existed to after the fill;
   - ``gc objects``: objects the cyclic garbage collector tracks, grown per resident block;
   - ``gc.collect``: a full collection, ms, after the fill (beside the same before it);
   - ``query``: a call for 1,024 keys, µs per key, all HIT and all MISS;
   - ``deposit``: 1,024 new keys into the full pool (each evicts one), from the engine call
     to the poll that returned the last entry, the engine polling every 0.5 ms as a
     scheduler does, µs per key (the 4 KiB copies included: ~0.5-1 µs each at memcpy
     speed; the last poll's wait: up to 0.5 µs a key), the median of 20 after 2 warm-ups;
     and the runtime thread's CPU time per key over those 20 (its clock,
     ``pthread_getcpuclockid``). The first deposit is a row of its own: its evictions
     choose the first eviction batch, one pass over the whole queue (then one per eighth
     of the pool evicted);
   - ``deliver``: 1,024 resident keys into the engine region, the same way;
   - the baseline: ``memmove`` of 4 KiB blocks between two shared mappings, µs per block,
     and deposit and deliver less it (their bookkeeping);
   - ``align_sequence`` for 1,024 resident keys: the engine call, and until an empty
     deliver made after it is answered (the runtime takes commands in order), beside that
     fence alone, and the difference (the align's own work), µs; and the runtime thread's
     CPU time for an align and a fence, less that for a fence alone (median of 21).
2. **warm start**: constructing a KVCR over the group that now holds N committed blocks
   (replay of its journal), until the constructor returns; checked by a query of all N.
3. **takeover**: a holder process (``recovery_holder.py``) claims the group (warm), is
   SIGKILLed, and the service serves the group: from the kill until ``status`` says
   ``serving``, and the service's own ``took_over`` figure; the second of two (the first
   also starts the service's NIXL agent).

Each row is beside the same figure at 10k (the baseline column), so the ratio is the growth.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import threading
import time
from typing import Any

import common
from common import GuardInstance, Row, log, poll_until, pool_service, run_main, succeeded

BLOCK = 4 * common.KIB
BATCH = 1000  # keys per fill call, and elements of the engine region
PROBE = 1024  # keys per query, deposit and align_sequence measurement
POLL_S = 0.5e-3  # the engine's poll cadence for deposit and deliver (a scheduler step)
# Deposits and delivers measured (the median), after warm-ups: this machine's figures move
# by tens of percent from one call to the next, so a median of a few is not one of record.
WARM_UPS, SAMPLES = 2, 20


def count(n: int) -> str:
    return f"{n // 10**6}M" if n >= 10**6 else f"{n // 1000}k"


def key(i: int) -> bytes:
    return i.to_bytes(8, "big")


def rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def full_collect_ms() -> float:
    t0 = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - t0) * 1e3


def best_of(times: int, measure: Any) -> float:
    return min(measure() for _ in range(times))


def measure_filled(service: common.GuardService, n: int, region: Any) -> dict[str, float]:
    """Fill the group with n blocks from this process; the figures taken at n resident."""
    out: dict[str, float] = {}
    gc.collect()
    rss0, objects0 = rss_anon(), len(gc.get_objects())
    out["gc_before_ms"] = best_of(7, full_collect_ms)
    inst = GuardInstance(service, f"scale-{os.getpid()}-{n}", BLOCK, region)
    try:
        inst.engine.fill(n, BATCH)
        gc.collect()
        out["rss_per_block"] = (rss_anon() - rss0) / n
        out["gc_objects_per_block"] = (len(gc.get_objects()) - objects0) / n
        out["gc_after_ms"] = best_of(7, full_collect_ms)
        kv = inst.kv
        hits = [key(i) for i in range(0, n, max(1, n // PROBE))][:PROBE]
        misses = [key(n + 10**9 + i) for i in range(PROBE)]
        for name, keys in (("query_hit_us", hits), ("query_miss_us", misses)):
            out[name] = best_of(5, lambda keys=keys: timed_call(kv.query, keys)) / len(keys)
        out["align_call_us"] = best_of(5, lambda: timed_call(kv.align_sequence, hits))
        out["align_us"] = best_of(5, lambda: fenced(inst, lambda: kv.align_sequence(hits)))
        out["fence_us"] = best_of(5, lambda: fenced(inst, lambda: None))
        out["align_cpu_us"] = runtime_cpu_us(inst, lambda: kv.align_sequence(hits))
        out["align_cpu_us"] -= runtime_cpu_us(inst, lambda: None)
        fresh = iter(range(n + 2 * 10**9, n + 3 * 10**9))
        new_blocks = (
            {key(next(fresh)): inst.engine.ref(i % BATCH) for i in range(PROBE)}
            for _ in range(WARM_UPS + SAMPLES)
        )
        wanted = {k: inst.engine.ref(i % BATCH) for i, k in enumerate(hits)}
        # Deliver first: the deposits evict (at 10k, 22 of them evict every block filled).
        # The engine polls every POLL_S, as a scheduler does (not spinning: a spinning engine
        # thread takes the GIL from the runtime's between its steps).
        poll = inst.engine.at(POLL_S)
        for name, submit in (
            ("deliver", lambda: kv.deliver(wanted)),
            ("deposit", lambda: kv.deposit(next(new_blocks))),
        ):

            def polled(submit: Any = submit) -> float:
                return poll.timed(submit, PROBE, succeeded)[0]

            cpu = runtime_clock(inst)
            warm_ups = [polled() for _ in range(WARM_UPS)]
            out[f"{name}_first_us"] = warm_ups[0] / PROBE * 1e6
            c0 = time.clock_gettime(cpu)
            times = [polled() for _ in range(SAMPLES)]
            out[f"{name}_cpu_us"] = (time.clock_gettime(cpu) - c0) / (SAMPLES * PROBE) * 1e6
            out[f"{name}_us"] = common.percentile(times, 50) / PROBE * 1e6
        out["copy_us"] = copy_us()
        out["deposit_over_copy_us"] = out["deposit_us"] - out["copy_us"]
        out["deliver_over_copy_us"] = out["deliver_us"] - out["copy_us"]
        out["align_work_us"] = out["align_us"] - out["fence_us"]
        out["resident"] = inst.runtime.gauges()["local_g2_blocks"]
    finally:
        inst.close()
    return out


def copy_us() -> float:
    """The baseline: µs per block of ``memmove`` of PROBE blocks between two mappings of
    4 KiB shared pages (the pools' kind), median of 7."""
    src, dst = common.shared_pages(BLOCK * PROBE, 1), common.shared_pages(BLOCK * PROBE)
    s, d = src.ctypes.data, dst.ctypes.data
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        for i in range(PROBE):
            ctypes.memmove(d + i * BLOCK, s + i * BLOCK, BLOCK)
        times.append(time.perf_counter() - t0)
    return common.percentile(times, 50) / PROBE * 1e6


def fenced(inst: GuardInstance, call: Any, pause: float = 0.0) -> float:
    """µs from ``call`` until an empty deliver made after it is answered: the runtime takes
    commands in order, so this covers the call's work there (beside the fence alone)."""
    kv = inst.kv
    t0 = time.perf_counter()
    call()
    fence = kv.deliver({})
    poll_until(kv, fence, 0, pause)
    return (time.perf_counter() - t0) * 1e6


def runtime_clock(inst: GuardInstance) -> int:
    """The CPU-time clock of the instance's runtime thread."""
    name = f"kvcr-{inst.engine.agent}"
    thread = next(t for t in threading.enumerate() if t.name == name)
    assert thread.ident is not None
    return time.pthread_getcpuclockid(thread.ident)


def runtime_cpu_us(inst: GuardInstance, call: Any, times: int = 21) -> float:
    """The runtime thread's CPU time, µs, for ``call`` and an empty deliver after it
    (median of ``times``); the engine polls every ``POLL_S`` meanwhile."""
    cpu, samples = runtime_clock(inst), []
    for _ in range(times):
        c0 = time.clock_gettime(cpu)
        fenced(inst, call, POLL_S)
        samples.append(time.clock_gettime(cpu) - c0)
    return common.percentile(samples, 50) * 1e6


def timed_call(call: Any, arg: Any) -> float:
    """µs of one engine call."""
    t0 = time.perf_counter()
    call(arg)
    return (time.perf_counter() - t0) * 1e6


def measure_warm_start(service: common.GuardService, n: int, region: Any, resident: int) -> float:
    """ms to construct a KVCR over the group holding ``resident`` committed blocks (about
    n: the deposit measurement evicted some and added others); all must come back."""
    t0 = time.perf_counter()
    inst = GuardInstance(service, f"scale-warm-{os.getpid()}-{n}", BLOCK, region)
    elapsed = time.perf_counter() - t0
    try:
        found = inst.runtime.gauges()["local_g2_blocks"]
        if found != resident:
            raise RuntimeError(f"warm start: {found} of {resident} blocks recovered")
    finally:
        inst.close()
    return elapsed * 1e3


def measure_takeover(service: common.GuardService, n: int) -> tuple[float, float]:
    """(ms from SIGKILL of a holder of the group until ``serving``, the service's own
    ``took_over`` ms), the second of two: the first takeover of a service also starts its
    NIXL agent. Each holder starts warm over the group (taking it back from the service the
    second time) and deposits its keys again (hits), so it holds what the group holds."""
    return [take_over_once(service, n) for _ in range(2)][-1]


def take_over_once(service: common.GuardService, n: int) -> tuple[float, float]:
    kill_to_serving = service.kill_a_holder(n) * 1e3
    return kill_to_serving, service.log_seconds("took_over")[-1] * 1e3


def bench(n: int, quiet: bool) -> dict[str, float]:
    region = common.randomized(BLOCK * BATCH, seed=n)
    service = pool_service(BLOCK * (n + 64))
    try:
        log(f"{n} blocks: fill and measure", quiet)
        out = measure_filled(service, n, region)
        log(f"{n} blocks: warm start", quiet)
        out["warm_start_ms"] = measure_warm_start(service, n, region, int(out["resident"]))
        log(f"{n} blocks: takeover", quiet)
        out["takeover_ms"], out["took_over_ms"] = measure_takeover(service, n)
    finally:
        service.stop()
    return out


ROWS = (  # figure, what it is, unit
    ("takeover_ms", "SIGKILL of the holder -> status says serving", "ms"),
    ("took_over_ms", "holder exit -> serving (the service's took_over)", "ms"),
    ("warm_start_ms", "warm start: construct over the group", "ms"),
    ("rss_per_block", "anonymous RSS per resident block", "B"),
    ("gc_objects_per_block", "GC-tracked objects per resident block", "objects"),
    ("gc_after_ms", "full gc.collect() after the fill", "ms"),
    ("gc_before_ms", "full gc.collect() before the instance", "ms"),
    ("query_hit_us", "query, 1,024 resident keys", "us/key"),
    ("query_miss_us", "query, 1,024 missing keys", "us/key"),
    ("deposit_us", "deposit of 1,024 new keys into the full pool (copies included)", "us/key"),
    (
        "deposit_first_us",
        "the first such deposit (its evictions choose an eviction batch)",
        "us/key",
    ),
    ("deliver_us", "deliver of 1,024 resident keys (copies included)", "us/key"),
    ("deposit_cpu_us", "deposit: the runtime thread's CPU (the copies run on others)", "us/key"),
    ("deliver_cpu_us", "deliver: the runtime thread's CPU (the copies run on others)", "us/key"),
    ("copy_us", "baseline: memmove of a 4 KiB block between shared mappings", "us/key"),
    ("deposit_over_copy_us", "deposit bookkeeping: deposit less the memmove baseline", "us/key"),
    ("deliver_over_copy_us", "deliver bookkeeping: deliver less the memmove baseline", "us/key"),
    ("align_call_us", "align_sequence of 1,024 resident keys: the engine call", "us"),
    ("align_us", "align_sequence of 1,024 resident keys, until a fence after it", "us"),
    ("fence_us", "the fence alone (an empty deliver, answered)", "us"),
    ("align_work_us", "align_sequence's own work: until the fence, less the fence", "us"),
    ("align_cpu_us", "align_sequence: the runtime thread's CPU, less an empty deliver's", "us"),
)


def measure(args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    counts = (10_000, 100_000) if args.quick else (10_000, 100_000, 1_000_000)
    figures = {n: bench(n, args.json_only) for n in counts}
    rows: list[Row] = []
    base = figures[counts[0]]
    for name, what, unit in ROWS:
        for n in counts:
            baseline = base[name] if n != counts[0] else None
            rows.append(
                Row("scale", f"{count(n)} blocks: {what}", figures[n][name], unit, baseline)
            )
    notes = [
        "4 KiB blocks; baseline column: the same figure at 10k blocks (the ratio is the growth)",
        f"this process's Python: {sys.version.split()[0]}, gc thresholds {gc.get_threshold()}",
    ]
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    return run_main(measure, argv, "kvcr at scale", "10k and 100k blocks only (~1 min)")


if __name__ == "__main__":
    sys.exit(main())
