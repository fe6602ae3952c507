"""Local (single-process, real NIXL) benchmark of kvcr's engine-facing path.

Run: ``uv run python benchmarks/local.py [--quick] [--json-only] [--runs N]``

In one run (ratios compare figures taken under the same machine noise): 1. deposit / deliver
GB/s (16 x 7 MiB, 256 x 64 KiB per operation) beside ``np.copyto`` and a bare NIXL agent's
loopback READ, and kvcr's cost per key over raw NIXL; 2. the fixed cost per operation (1 and
16 x 4 KiB round trips); 3. ``query`` per key; 4. median / p99 of every engine-facing call;
5. idle CPU of one instance. kvcr is timed by the harness's engine loop (``engine_loop.py``),
the engine pausing with ``time.sleep(0)`` between polls ("engine poll", ``YIELD``); "diag:"
rows: the engine spinning without pause ("tight spin", ``SPIN``), with the default switch
interval and 0.2 ms, and the raw READ on a worker thread (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
from common import (
    KIB,
    MIB,
    SPIN,
    Engine,
    RawNixl,
    Row,
    Worker,
    check_crcs,
    crcs,
    engine_of,
    gbps,
    idle_cpu,
    idle_row,
    interleaved,
    log,
    memcpy,
    null_bindings,
    percentile,
    randomized,
    run_main,
    runtime_thread,
    short_switch,
    touched,
)

TITLE = "kvcr local benchmark"
KVCR_POLL = "kvcr (engine poll: yield between polls)"
TIGHT_SPIN_NOTE = (
    "tight spin: the engine thread holds the GIL; the runtime waits a switch interval per GIL "
    "hand-over"
)
ENGINE_POLL_NOTE = (
    "engine poll: poll_completed, then time.sleep(0) (a GIL-releasing yield) until the op is "
    "complete; primary kvcr rows and targets use it"
)


# -- 1. throughput -----------------------------------------------------------------------


def bench_throughput(
    rows: list[Row],
    per_key: dict[str, float],
    raw: RawNixl,
    label: str,
    block: int,
    count: int,
    reps: int,
    quiet: bool,
) -> None:
    nbytes = block * count
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
    dst = (dst_view, block, count)

    with engine_of(f"bench-{label}", block, engine, pool) as eng, Worker() as worker, raw:
        kv = eng.kv
        raw.register(engine, scratch, scratch2)
        src_local, src_loop = raw.dlists(src_view, block, count)
        scr_local, scr_loop = raw.dlists(scratch, block, count)
        scr2_local, _ = raw.dlists(scratch2, block, count)
        del src_local

        # Resident keys for deliver, held (no_evict) so rotating deposits cannot evict them.
        resident = {b"R%06d" % i: eng.ref(i) for i in range(count)}
        eng.done(kv.deposit(resident, no_evict=True), count, "resident deposit")
        delivery = {key: eng.ref(count + i) for i, key in enumerate(resident)}

        # Verify once: kvcr deposit + deliver, raw NIXL and memcpy all move the right bytes.
        eng.done(kv.deliver(delivery), count, "verification deliver")
        check_crcs(f"{label}: delivered bytes differ from deposited bytes", *dst, src_crcs)
        raw.read(scr_local, src_loop, count)
        check_crcs(f"{label}: raw NIXL READ moved wrong bytes", scratch, block, count, src_crcs)
        raw.read(scr2_local, scr_loop, count)
        check_crcs(f"{label}: raw NIXL READ moved wrong bytes", scratch2, block, count, src_crcs)
        scratch2.fill(0x66)
        np.copyto(scratch2, scratch)
        check_crcs(f"{label}: memcpy moved wrong bytes", scratch2, block, count, src_crcs)
        dst_view.fill(0)

        serial = iter(range(10**9))
        spin = eng.at(SPIN)

        def deposit(engine: Engine = eng) -> float:
            blocks = {b"D%09d" % next(serial): eng.ref(i) for i in range(count)}
            return engine.seconds(lambda: kv.deposit(blocks), count, "deposit")

        def deliver(engine: Engine = eng) -> float:
            return engine.seconds(lambda: kv.deliver(delivery), count, "deliver")

        cases: dict[str, Callable[[], float]] = {}
        for direction, kvcr, copy, local, loop in (
            ("deposit", deposit, (scratch, src_view), scr_local, src_loop),
            ("deliver", deliver, (scratch2, scratch), scr2_local, scr_loop),
        ):
            read = functools.partial(raw.read, local, loop, count)
            cases |= {
                f"{direction}/memcpy": functools.partial(memcpy, *copy),
                f"{direction}/raw-nixl": read,
                f"{direction}/raw-nixl-reverse": functools.partial(read, True),
                f"{direction}/raw-nixl-worker": functools.partial(worker.timed, read),
                f"{direction}/kvcr": kvcr,
                f"{direction}/kvcr-spin": functools.partial(kvcr, spin),
                f"{direction}/kvcr-spin-switch": functools.partial(
                    short_switch, functools.partial(kvcr, spin)
                ),
            }
        times = interleaved(cases, reps)  # two warm-up rounds, interleaved cases

        # The timed delivers must have rewritten the targets with the deposited bytes, and
        # the last timed deposit must be resident with the right bytes.
        check_crcs(f"{label}: timed delivers left wrong bytes", *dst, src_crcs)
        newest = next(serial) - 1
        last = {b"D%09d" % (newest - i): eng.ref(count + i) for i in range(count)}
        dst_view.fill(0)
        eng.done(kv.deliver(last), count, "check deliver")
        if sorted(crcs(dst_view, block, count)) != sorted(src_crcs):
            raise RuntimeError(f"{label}: a timed deposit stored wrong bytes")

    what = f"{label} x{count}"
    for direction in ("deposit", "deliver"):
        mc_med, mc_best = gbps(nbytes, times[f"{direction}/memcpy"])
        raw_med, raw_best = gbps(nbytes, times[f"{direction}/raw-nixl"])
        reverse_med, _ = gbps(nbytes, times[f"{direction}/raw-nixl-reverse"])
        worker_med, _ = gbps(nbytes, times[f"{direction}/raw-nixl-worker"])
        kv_med, kv_best = gbps(nbytes, times[f"{direction}/kvcr"])
        spin_med, _ = gbps(nbytes, times[f"{direction}/kvcr-spin"])
        switch_med, _ = gbps(nbytes, times[f"{direction}/kvcr-spin-switch"])
        kv_s, raw_s = (statistics.median(times[f"{direction}/{c}"]) for c in ("kvcr", "raw-nixl"))
        overhead = (kv_s - raw_s) / count * 1e6
        per_key[f"{direction} {what}"] = overhead
        kp = KVCR_POLL
        for case, value, baseline in (
            ("memcpy median", mc_med, None),
            ("memcpy best", mc_best, None),
            ("raw-nixl median", raw_med, mc_med),
            ("raw-nixl best", raw_best, mc_best),
            (f"{kp} median vs memcpy", kv_med, mc_med),
            (f"{kp} median vs raw-nixl", kv_med, raw_med),
            (f"{kp} best vs memcpy", kv_best, mc_best),
            (f"{kp} best vs raw-nixl", kv_best, raw_best),
            (f"kvcr us per key overhead ((kvcr - raw-nixl) / {count}, medians)", overhead, None),
            (
                "diag: raw-nixl, destinations reversed (no descriptor merge) median",
                reverse_med,
                raw_med,
            ),
            ("diag: raw-nixl on a worker thread, engine poll, median", worker_med, raw_med),
            (f"diag: {kp} median vs raw-nixl on a worker thread", kv_med, worker_med),
            ("diag: kvcr tight spin median", spin_med, mc_med),
            ("diag: kvcr tight spin, switchinterval 0.2ms median", switch_med, mc_med),
        ):
            unit = "us/key" if "us per key" in case else "GB/s"
            rows.append(Row(direction, f"{what} {case}", value, unit, baseline))
            if block == 7 * MIB and case == f"{kp} median vs memcpy":  # the target
                rows[-1].target, rows[-1].ok = ">=0.8x memcpy", kv_med >= 0.8 * mc_med


# -- 2. fixed cost per operation ----------------------------------------------------------


def bench_roundtrip(
    rows: list[Row],
    per_key: dict[str, float],
    raw: RawNixl,
    trips: int,
    spin_every: int,
    quiet: bool,
) -> None:
    """Round trip (engine call -> poll_completed has every entry) of small operations, so
    that kvcr's fixed cost per operation and its runtime cost per key show."""
    block, held, warm = 4 * KIB, 16, 30
    log(f"round trips: 1 and {held} x 4 KiB, {trips} trips", quiet)
    region = 4 * held  # [0, held) deposit sources, [held, 2 held) deliver targets
    engine = randomized(block * region, seed=13)
    # A small pool: after the warm-up trips every deposit evicts, as in steady state.
    pool = touched(block * 256)
    scratch = touched(block * held, 0x77)  # raw NIXL: engine sources -> scratch
    settle = 100e-6  # let the runtime go idle between samples (outside the timed region)
    sizes = (1, held)
    with engine_of("bench-trip", block, engine, pool) as eng, Worker() as worker, raw:
        kv = eng.kv
        raw.register(engine, scratch)
        _, src_loop = raw.dlists(engine[: block * held], block, held)
        scr_local, _ = raw.dlists(scratch, block, held)

        resident = {b"K%06d" % i: eng.ref(i) for i in range(held)}
        eng.done(kv.deposit(resident, no_evict=True), held, "held deposit")
        targets = {
            n: {key: eng.ref(held + i) for i, key in enumerate(list(resident)[:n])} for n in sizes
        }
        eng.done(kv.deliver(targets[held]), held, "check deliver")
        src_crcs = crcs(engine, block, held)
        dst = (engine[block * held :], block, held)
        check_crcs("round trip: delivered bytes differ from deposited bytes", *dst, src_crcs)
        raw.read(scr_local, src_loop, held)
        check_crcs("round trip: raw NIXL READ moved wrong bytes", scratch, block, held, src_crcs)

        serial = iter(range(10**9))

        def deposit(n: int, engine: Engine = eng) -> float:
            blocks = {b"t%09d" % next(serial): eng.ref(i) for i in range(n)}
            return engine.seconds(lambda: kv.deposit(blocks), n, "round trip deposit")

        def deliver(n: int) -> float:
            return eng.seconds(lambda: kv.deliver(targets[n]), n, "round trip deliver")

        cases: dict[str, Callable[[], float]] = {}
        for n in sizes:
            read = functools.partial(raw.read, scr_local, src_loop, n)
            cases[f"deposit/{n}"] = functools.partial(deposit, n)
            cases[f"deliver/{n}"] = functools.partial(deliver, n)
            cases[f"raw-nixl/{n}"] = read
            cases[f"worker/{n}"] = functools.partial(worker.timed, read)
        cases["spin"] = functools.partial(deposit, 1, eng.at(SPIN))  # ~10 ms: sampled less often
        samples = interleaved(cases, trips, warm, settle, every={"spin": spin_every})
        times = {name: [t * 1e6 for t in values] for name, values in samples.items()}
        check_crcs("round trip: timed delivers left wrong bytes", *dst, src_crcs)

    med = {name: statistics.median(values) for name, values in times.items()}
    for n in sizes:
        rows.append(Row("roundtrip", f"raw-nixl {n}x4KiB READ median", med[f"raw-nixl/{n}"], "us"))
    for kind in ("deposit", "deliver"):
        for n in sizes:
            what, median = f"{kind} {n}x4KiB, engine poll", med[f"{kind}/{n}"]
            rows.append(Row("roundtrip", f"{what}, median", median, "us", med[f"raw-nixl/{n}"]))
            rows.append(
                Row("roundtrip", f"{what}, p99", percentile(times[f"{kind}/{n}"], 99), "us")
            )
        slope = (med[f"{kind}/{held}"] - med[f"{kind}/1"]) / (held - 1)
        per_key[f"{kind}/4KiB"] = slope
        raw_slope = (med[f"raw-nixl/{held}"] - med["raw-nixl/1"]) / (held - 1)
        what = f"{kind} kvcr us per key ((t{held} - t1) / {held - 1}, medians)"
        rows.append(Row("roundtrip", what, slope, "us/key", raw_slope))
    for n in sizes:
        what = f"diag: raw-nixl {n}x4KiB READ on a worker thread, engine poll, median"
        rows.append(Row("roundtrip", what, med[f"worker/{n}"], "us", med[f"raw-nixl/{n}"]))
    rows.append(Row("roundtrip", "diag: deposit 1x4KiB, tight spin, median", med["spin"], "us"))
    p99 = percentile(times["spin"], 99)
    rows.append(Row("roundtrip", "diag: deposit 1x4KiB, tight spin, p99", p99, "us"))


# -- 3. query ----------------------------------------------------------------------------


def bench_query(rows: list[Row], samples: int, quiet: bool) -> None:
    block, resident_keys, region = 4 * KIB, 10_000, 256
    log(f"query: {resident_keys} resident keys, {samples} samples per case", quiet)
    engine = randomized(block * region, seed=7)
    pool = touched(block * (resident_keys + 240))
    with engine_of("bench-query", block, engine, pool) as eng:
        kv = eng.kv
        keys = [b"Q%09d" % i for i in range(resident_keys)]
        misses = [b"M%09d" % i for i in range(resident_keys)]
        for start in range(0, resident_keys, 1000):
            batch = {k: eng.ref(i % region) for i, k in enumerate(keys[start : start + 1000])}
            eng.done(kv.deposit(batch), len(batch), "query fill")
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


# -- 4. engine-facing call latency -------------------------------------------------------


def bench_calls(rows: list[Row], notes: list[str], samples: int, quiet: bool) -> None:
    block, region, held = 4 * KIB, 256, 64
    log(f"engine-facing calls: {samples} samples each", quiet)
    engine = randomized(block * region, seed=11)
    pool = touched(block * 2048)
    bindings = null_bindings(stats=True)
    results: dict[str, list[float]] = {}
    clock = time.perf_counter_ns
    with engine_of("bench-calls", block, engine, pool, bindings, telemetry=True) as eng:
        kv = eng.kv
        resident = [b"H%06d" % i for i in range(held)]
        blocks = {k: eng.ref(i) for i, k in enumerate(resident)}
        eng.done(kv.deposit(blocks, no_evict=True), held, "held deposit")

        def sample(name: str, body: Callable[[int], None], settle: float = 100e-6) -> None:
            """``samples`` calls after 50 warm-ups; ``settle``: let the runtime go idle
            between samples (outside the timed region)."""
            for i in range(samples + 50):
                body(i)
                if settle:
                    time.sleep(settle)
            results[name] = results[name][50:]  # warm-up

        def record(name: str, ns: int) -> None:
            results.setdefault(name, []).append(ns / 1e3)

        def deposit(i: int) -> None:
            blocks = {b"d%09d" % i: eng.ref(i % held)}
            t0 = clock()
            h = kv.deposit(blocks)
            record("deposit (1 key)", clock() - t0)
            eng.wait(h, 1)

        def deliver(i: int) -> None:
            blocks = {resident[i % held]: eng.ref(held + i % (region - held))}
            t0 = clock()
            h = kv.deliver(blocks)
            record("deliver (1 key)", clock() - t0)
            eng.done(h, 1, "deliver")

        handles: list[int] = []

        def fetch(i: int) -> None:
            keys = [resident[i % held]]
            t0 = clock()
            h = kv.fetch(keys)
            record("fetch (1 key)", clock() - t0)
            entries = eng.done(h, 1, "fetch")
            handles.append(next(iter(entries.values())).release_handle)

        def release(i: int) -> None:
            batch = [handles[i]]
            t0 = clock()
            result = kv.release(batch)
            record("release (1 handle)", clock() - t0)
            if not result[0][1]:
                raise RuntimeError("release: a live handle was refused")

        aborted = [0]

        def abort(i: int) -> None:
            h = kv.deposit({b"a%09d" % i: eng.ref(i % held)})
            t0 = clock()
            ok = kv.abort(h)
            record("abort (in-flight deposit)", clock() - t0)
            aborted[0] += bool(ok)
            eng.wait(h, 1)

        def align(i: int) -> None:
            keys = resident[i % (held - 10) :][:10]
            t0 = clock()
            kv.align_sequence(keys)
            record("align_sequence (10 keys)", clock() - t0)

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
        sample("poll_completed (empty)", poll, settle=0.0)
        sample("get_stats", stats, settle=0.0)
        sample("query (1 key)", query, settle=0.0)

    for name, values in results.items():
        med = statistics.median(values)
        rows.append(Row("call", f"{name} median", med, "us", target="<=20 us", ok=med <= 20.0))
        rows.append(Row("call", f"{name} p99", percentile(values, 99), "us"))


# -- 5. idle CPU -------------------------------------------------------------------------


def bench_idle(rows: list[Row], seconds: float, quiet: bool) -> None:
    log(f"idle CPU: 1 s settle, {seconds:.0f} s measured", quiet)
    block = 4 * KIB
    engine = randomized(block * 64, seed=3)
    with engine_of("bench-idle", block, engine, touched(block * 64)) as eng:
        cpu = idle_cpu(runtime_thread(eng.agent), seconds)
    rows.append(idle_row(f"runtime thread kvcr-{eng.agent}", 100 * cpu["thread"] / cpu["wall"]))
    rows.append(idle_row("whole process (main thread asleep)", 100 * cpu["proc"] / cpu["wall"]))


# -- main --------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    quiet = args.json_only
    if args.quick:  # ~45 s on 2 cores
        reps_big, reps_small, trips, spin_every = 80, 250, 2000, 10
        q_samples, c_samples = 300, 1500
    else:  # ~2.5 min on 2 cores
        reps_big, reps_small, trips, spin_every = 300, 800, 6000, 10
        q_samples, c_samples = 1000, 5000
    rows: list[Row] = []
    notes: list[str] = [ENGINE_POLL_NOTE, TIGHT_SPIN_NOTE]
    per_key: dict[str, float] = {}
    bench_idle(rows, 5.0, quiet)
    raw = RawNixl("bench-raw")
    bench_throughput(rows, per_key, raw, "7MiB", 7 * MIB, 16, reps_big, quiet)
    bench_throughput(rows, per_key, raw, "64KiB", 64 * KIB, 256, reps_small, quiet)
    bench_roundtrip(rows, per_key, raw, trips, spin_every, quiet)
    del raw
    bench_query(rows, q_samples, quiet)
    bench_calls(rows, notes, c_samples, quiet)
    log("done", quiet)
    order = {"deposit": 0, "deliver": 1, "roundtrip": 2, "query": 3, "call": 4, "idle": 5}
    rows.sort(key=lambda r: order[r.bench])  # stable: keeps case order within a bench
    notes.append(
        "kvcr us per key overhead, (t_kvcr - t_raw-nixl) / keys: "
        + ", ".join(f"{k} {v:.2f}" for k, v in per_key.items() if "/" not in k)
        + "; runtime per extra key at 4 KiB, (t16 - t1) / 15: "
        + ", ".join(f"{k.split('/')[0]} {v:.2f}" for k, v in per_key.items() if "/" in k)
    )
    return rows, notes


def main(argv: Sequence[str] | None = None) -> int:
    # local.py's table has always picked decimals by signed value (see common._fmt).
    load = ("this process", "kvcr rows need both cores")
    return run_main(measure, argv, TITLE, "fewer repetitions (~1 min)", load, by_magnitude=False)


if __name__ == "__main__":
    sys.exit(main())
