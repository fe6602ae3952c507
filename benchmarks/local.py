"""Local (single-process, real NIXL) benchmark of kvcr's engine-facing path.

Run: ``uv run python benchmarks/local.py [--quick] [--json-only]``

Measures, in one run (so that ratios compare figures taken under the same machine noise):

1. deposit / deliver throughput through kvcr (16 x 7 MiB and 256 x 64 KiB per operation),
   beside ``np.copyto`` of the same bytes and a bare NIXL agent doing the same prepped
   loopback READ, and kvcr's cost per key over raw NIXL, ``(t_kvcr - t_raw) / keys``. NIXL
   merges descriptors adjacent on both sides into one copy, which raw NIXL's in-order blocks
   always allow and kvcr's pool slots often do not: a diagnostic row reverses the raw
   destinations to show what that is worth;
2. fixed cost per operation: round trip of a 1 x 4 KiB and a 16 x 4 KiB deposit and
   deliver, and the runtime's cost per extra key, ``(t16 - t1) / 15``;
3. ``query`` cost per key (1, 100, 10,000 keys; resident and all-miss);
4. median / p99 latency of every engine-facing call, as seen by the calling thread;
5. idle CPU of one instance.

Prints a human table, then one JSON line per measurement:
``{"bench", "case", "value", "unit", "baseline", "ratio"}``.

A kvcr operation is timed from the engine call until ``poll_completed`` has returned all of
its entries, polled the way an engine polls ("engine poll"): call ``poll_completed``, and if
the operation is not complete, ``time.sleep(0)`` before polling again. An engine calls
``poll_completed`` once per scheduler step and in between does work that releases the GIL
(GPU launches, I/O); ``time.sleep(0)`` is that GIL-releasing yield. These rows carry the
targets.

Rows marked "diag:" are diagnostics, not targets: the same operation with the engine thread
spinning on ``poll_completed`` in pure Python ("tight spin"), with the default switch
interval (5 ms) and with ``sys.setswitchinterval(0.0002)``. tight spin: the engine thread
holds the GIL; the runtime waits a switch interval per GIL hand-over (after its epoll wake,
and after NIXL's transfer post, which releases the GIL during the loopback copy). Another
diagnostic does the raw NIXL READ on a worker thread while the engine thread engine-polls
for it: the floor of any design that copies on a thread of its own, as kvcr's runtime does
(a thread wake-up, GIL hand-overs, and a copy that runs slower while the other core is busy).
"""

from __future__ import annotations

import functools
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from common import (
    KIB,
    MIB,
    CpuSpan,
    MachineLoad,
    Row,
    arguments,
    bare_agent,
    crcs,
    idle_row,
    log,
    make_instance,
    null_bindings,
    percentile,
    randomized,
    raw_transfer,
    repeated,
    report,
    runtime_thread,
    touched,
)

from kvcr import KVCR
from kvcr.types import MemoryRef, OpEntryStatus

OP_TIMEOUT_S = 30.0
DIAG_SWITCH_S = 0.0002  # sys.setswitchinterval for the diagnostic rows (default 0.005)
KVCR_POLL = "kvcr (engine poll: yield between polls)"
TIGHT_SPIN_NOTE = (
    "tight spin: the engine thread holds the GIL; the runtime waits a switch interval per GIL "
    "hand-over"
)
ENGINE_POLL_NOTE = (
    "engine poll: poll_completed, then time.sleep(0) (a GIL-releasing yield) until the op is "
    "complete; primary kvcr rows and targets use it"
)


# -- helpers -----------------------------------------------------------------------------


class Engine:
    """The engine side of one instance: submits, and collects completions by handle.

    Polling is the engine's: ``poll_completed``, then, if the operation is not complete,
    ``time.sleep(0)`` (a GIL-releasing yield, as an engine's work between scheduler steps)
    before the next poll. ``spin=True`` is the diagnostic tight spin instead.
    """

    def __init__(self, kv: KVCR, agent: str) -> None:
        self.kv = kv
        self.agent = agent
        self.results: dict[int, dict[bytes, Any]] = {}

    def ref(self, element: int) -> list[MemoryRef]:
        return [MemoryRef(end_point_name=self.agent, element_index=element)]

    def wait(self, handle: int, nkeys: int) -> dict[bytes, Any]:
        """Engine poll until the op's ``nkeys`` entries are in; returns them."""
        entries = self.results.setdefault(handle, {})
        deadline = time.monotonic() + OP_TIMEOUT_S
        while True:
            for op, done in self.kv.poll_completed():
                self.results.setdefault(op, {}).update(done)
            if len(entries) >= nkeys:
                return self.results.pop(handle)
            time.sleep(0)
            if time.monotonic() > deadline:
                raise RuntimeError(f"op {handle}: {len(entries)}/{nkeys} entries after timeout")

    def timed(
        self, submit: Callable[[], int], nkeys: int, spin: bool = False
    ) -> tuple[float, dict[bytes, Any]]:
        """Seconds from the engine call until poll_completed returned all entries."""
        kv, clock, pause = self.kv, time.perf_counter, time.sleep
        t0 = clock()
        deadline = t0 + OP_TIMEOUT_S
        handle = submit()
        got: dict[bytes, Any] = {}
        while True:
            for op, done in kv.poll_completed():
                if op == handle:
                    got.update(done)
                else:
                    self.results.setdefault(op, {}).update(done)
            if len(got) >= nkeys:
                break
            if not spin:
                pause(0)
            if clock() > deadline:
                raise RuntimeError(f"op {handle}: {len(got)}/{nkeys} entries after timeout")
        elapsed = clock() - t0
        return elapsed, got


class Worker:
    """A thread of its own that runs what the engine thread hands it, while the engine thread
    engine-polls for the result: raw NIXL done this way is the floor of any design that
    copies on a runtime thread (thread wake-up, GIL hand-overs, both cores busy)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="bench-worker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            run, out = job
            try:
                out.append(run())
            except BaseException as exc:
                out.append(exc)

    def timed(self, run: Callable[[], object]) -> float:
        """Seconds from the hand-over until the engine thread sees the job done."""
        out: list[object] = []
        clock, pause = time.perf_counter, time.sleep
        t0 = clock()
        self._jobs.put((run, out))
        while not out:
            pause(0)
            if clock() - t0 > OP_TIMEOUT_S:
                raise RuntimeError("worker: job not done after timeout")
        elapsed = clock() - t0
        if isinstance(out[0], BaseException):
            raise out[0]
        return elapsed

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()


def all_success(what: str, entries: dict[bytes, Any], nkeys: int) -> None:
    bad = {k: v.status.name for k, v in entries.items() if v.status is not OpEntryStatus.SUCCESS}
    if bad or len(entries) != nkeys:
        raise RuntimeError(f"{what}: not all {nkeys} entries succeeded: {bad or len(entries)}")


# -- 1. throughput -----------------------------------------------------------------------


class RawNixl:
    """A bare NIXL agent doing the same loopback READ kvcr does (transport/nixl.py)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.agent = bare_agent(name)
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

    def read(self, dst_local: Any, src_loopback: Any, count: int, reverse: bool = False) -> float:
        """Copy ``count`` blocks (dst <- src); seconds from make to release. NIXL merges
        descriptors adjacent on both sides into one copy; ``reverse`` (block i to block
        count - 1 - i) prevents that, as kvcr's pool slots after evictions often do."""
        idx = list(range(count))
        dst_idx = idx[::-1] if reverse else idx
        return raw_transfer(self.agent, "READ", dst_local, dst_idx, src_loopback, idx)

    def reset(self) -> None:
        for dlist in self._dlists:
            dlist.release()
        self._dlists.clear()
        while self._regs:
            self.agent.deregister_memory(self._regs.pop())


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
    kv = make_instance(agent, block, engine, pool, null_bindings())
    eng = Engine(kv, agent)
    worker = Worker()
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

        def deposit(spin: bool = False) -> float:
            blocks = {b"D%09d" % next(serial): eng.ref(i) for i in range(count)}
            elapsed, got = eng.timed(lambda: kv.deposit(blocks), count, spin)
            all_success("deposit", got, count)
            return elapsed

        def deliver(spin: bool = False) -> float:
            elapsed, got = eng.timed(lambda: kv.deliver(delivery), count, spin)
            all_success("deliver", got, count)
            return elapsed

        def memcpy(dst: np.ndarray, src: np.ndarray) -> float:
            t0 = time.perf_counter()
            np.copyto(dst, src)
            return time.perf_counter() - t0

        cases: dict[str, Callable[[], float]] = {
            "deposit/memcpy": lambda: memcpy(scratch, src_view),
            "deposit/raw-nixl": lambda: raw.read(scr_local, src_loop, count),
            "deposit/raw-nixl-reverse": lambda: raw.read(scr_local, src_loop, count, True),
            "deposit/raw-nixl-worker": lambda: worker.timed(
                lambda: raw.read(scr_local, src_loop, count)
            ),
            "deposit/kvcr": deposit,
            "deposit/kvcr-spin": lambda: deposit(spin=True),
            "deposit/kvcr-spin-switch": lambda: short_switch(deposit),
            "deliver/memcpy": lambda: memcpy(scratch2, scratch),
            "deliver/raw-nixl": lambda: raw.read(scr2_local, scr_loop, count),
            "deliver/raw-nixl-reverse": lambda: raw.read(scr2_local, scr_loop, count, True),
            "deliver/raw-nixl-worker": lambda: worker.timed(
                lambda: raw.read(scr2_local, scr_loop, count)
            ),
            "deliver/kvcr": deliver,
            "deliver/kvcr-spin": lambda: deliver(spin=True),
            "deliver/kvcr-spin-switch": lambda: short_switch(deliver),
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
        worker.close()
        kv.close()
        raw.reset()

    def seconds(name: str) -> float:
        return statistics.median(times[name])

    def gbps(name: str) -> tuple[float, float]:
        samples = times[name]
        return gb / statistics.median(samples), gb / min(samples)

    what = f"{label} x{count}"
    for direction in ("deposit", "deliver"):
        mc_med, mc_best = gbps(f"{direction}/memcpy")
        raw_med, raw_best = gbps(f"{direction}/raw-nixl")
        reverse_med, _ = gbps(f"{direction}/raw-nixl-reverse")
        worker_med, _ = gbps(f"{direction}/raw-nixl-worker")
        kv_med, kv_best = gbps(f"{direction}/kvcr")
        spin_med, _ = gbps(f"{direction}/kvcr-spin")
        switch_med, _ = gbps(f"{direction}/kvcr-spin-switch")
        overhead = (seconds(f"{direction}/kvcr") - seconds(f"{direction}/raw-nixl")) / count * 1e6
        per_key[f"{direction} {what}"] = overhead
        gated = block == 7 * MIB
        target = ">=0.8x memcpy" if gated else ""
        rows += [
            Row(direction, f"{what} memcpy median", mc_med, "GB/s"),
            Row(direction, f"{what} memcpy best", mc_best, "GB/s"),
            Row(direction, f"{what} raw-nixl median", raw_med, "GB/s", mc_med),
            Row(direction, f"{what} raw-nixl best", raw_best, "GB/s", mc_best),
            Row(
                direction,
                f"{what} {KVCR_POLL} median vs memcpy",
                kv_med,
                "GB/s",
                mc_med,
                target,
                kv_med >= 0.8 * mc_med if gated else None,
            ),
            Row(direction, f"{what} {KVCR_POLL} median vs raw-nixl", kv_med, "GB/s", raw_med),
            Row(direction, f"{what} {KVCR_POLL} best vs memcpy", kv_best, "GB/s", mc_best),
            Row(direction, f"{what} {KVCR_POLL} best vs raw-nixl", kv_best, "GB/s", raw_best),
            Row(
                direction,
                f"{what} kvcr us per key overhead ((kvcr - raw-nixl) / {count}, medians)",
                overhead,
                "us/key",
            ),
            Row(
                direction,
                f"{what} diag: raw-nixl, destinations reversed (no descriptor merge) median",
                reverse_med,
                "GB/s",
                raw_med,
            ),
            Row(
                direction,
                f"{what} diag: raw-nixl on a worker thread, engine poll, median",
                worker_med,
                "GB/s",
                raw_med,
            ),
            Row(
                direction,
                f"{what} diag: {KVCR_POLL} median vs raw-nixl on a worker thread",
                kv_med,
                "GB/s",
                worker_med,
            ),
            Row(direction, f"{what} diag: kvcr tight spin median", spin_med, "GB/s", mc_med),
            Row(
                direction,
                f"{what} diag: kvcr tight spin, switchinterval 0.2ms median",
                switch_med,
                "GB/s",
                mc_med,
            ),
        ]


def short_switch(run: Callable[..., float]) -> float:
    """Diagnostic: tight spin, but the GIL changes hands every 0.2 ms, not 5 ms."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(DIAG_SWITCH_S)
    try:
        return run(spin=True)
    finally:
        sys.setswitchinterval(previous)


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
    agent = "bench-trip"
    kv = make_instance(agent, block, engine, pool, null_bindings())
    eng = Engine(kv, agent)
    worker = Worker()
    settle = 100e-6  # let the runtime go idle between samples (outside the timed region)
    sizes = (1, held)
    times: dict[str, list[float]] = {}
    try:
        raw.register(engine)
        raw.register(scratch)
        _, src_loop = raw.dlists(engine[: block * held], block, held)
        scr_local, _ = raw.dlists(scratch, block, held)

        resident = {b"K%06d" % i: eng.ref(i) for i in range(held)}
        all_success("held deposit", eng.wait(kv.deposit(resident, no_evict=True), held), held)
        targets = {
            n: {key: eng.ref(held + i) for i, key in enumerate(list(resident)[:n])} for n in sizes
        }
        all_success("check deliver", eng.wait(kv.deliver(targets[held]), held), held)
        src_crcs = crcs(engine, block, held)
        if crcs(engine[block * held :], block, held) != src_crcs:
            raise RuntimeError("round trip: delivered bytes differ from deposited bytes")
        raw.read(scr_local, src_loop, held)
        if crcs(scratch, block, held) != src_crcs:
            raise RuntimeError("round trip: raw NIXL READ moved wrong bytes")

        serial = iter(range(10**9))

        def deposit(n: int, spin: bool = False) -> float:
            blocks = {b"t%09d" % next(serial): eng.ref(i) for i in range(n)}
            elapsed, got = eng.timed(lambda: kv.deposit(blocks), n, spin)
            all_success("round trip deposit", got, n)
            return elapsed

        def deliver(n: int) -> float:
            elapsed, got = eng.timed(lambda: kv.deliver(targets[n]), n)
            all_success("round trip deliver", got, n)
            return elapsed

        cases: dict[str, Callable[[], float]] = {}
        for n in sizes:
            cases[f"deposit/{n}"] = functools.partial(deposit, n)
            cases[f"deliver/{n}"] = functools.partial(deliver, n)
            cases[f"raw-nixl/{n}"] = functools.partial(raw.read, scr_local, src_loop, n)
            cases[f"worker/{n}"] = functools.partial(
                worker.timed, functools.partial(raw.read, scr_local, src_loop, n)
            )
        spin_case = functools.partial(deposit, 1, spin=True)
        times = {name: [] for name in [*cases, "spin"]}
        for trip in range(warm + trips):  # interleaved cases
            for name, run in cases.items():
                elapsed = run()
                if trip >= warm:
                    times[name].append(elapsed * 1e6)
                time.sleep(settle)
            if trip % spin_every == 0:  # ~10 ms each: sampled less often
                elapsed = spin_case()
                if trip >= warm:
                    times["spin"].append(elapsed * 1e6)
                time.sleep(settle)
        if crcs(engine[block * held :], block, held) != src_crcs:
            raise RuntimeError("round trip: timed delivers left wrong bytes")
    finally:
        worker.close()
        kv.close()
        raw.reset()

    med = {name: statistics.median(values) for name, values in times.items()}
    for n in sizes:
        rows.append(Row("roundtrip", f"raw-nixl {n}x4KiB READ median", med[f"raw-nixl/{n}"], "us"))
    for kind in ("deposit", "deliver"):
        for n in sizes:
            values = times[f"{kind}/{n}"]
            what = f"{kind} {n}x4KiB, engine poll"
            rows.append(
                Row("roundtrip", f"{what}, median", med[f"{kind}/{n}"], "us", med[f"raw-nixl/{n}"])
            )
            rows.append(Row("roundtrip", f"{what}, p99", percentile(values, 99), "us"))
        slope = (med[f"{kind}/{held}"] - med[f"{kind}/1"]) / (held - 1)
        per_key[f"{kind}/4KiB"] = slope
        rows.append(
            Row(
                "roundtrip",
                f"{kind} kvcr us per key ((t{held} - t1) / {held - 1}, medians)",
                slope,
                "us/key",
                (med[f"raw-nixl/{held}"] - med["raw-nixl/1"]) / (held - 1),
            )
        )
    for n in sizes:
        rows.append(
            Row(
                "roundtrip",
                f"diag: raw-nixl {n}x4KiB READ on a worker thread, engine poll, median",
                med[f"worker/{n}"],
                "us",
                med[f"raw-nixl/{n}"],
            )
        )
    rows.append(Row("roundtrip", "diag: deposit 1x4KiB, tight spin, median", med["spin"], "us"))
    rows.append(
        Row(
            "roundtrip",
            "diag: deposit 1x4KiB, tight spin, p99",
            percentile(times["spin"], 99),
            "us",
        )
    )


# -- 3. query ----------------------------------------------------------------------------


def bench_query(rows: list[Row], samples: int, quiet: bool) -> None:
    block, resident_keys, region = 4 * KIB, 10_000, 256
    log(f"query: {resident_keys} resident keys, {samples} samples per case", quiet)
    engine = randomized(block * region, seed=7)
    pool = touched(block * (resident_keys + 240))
    agent = "bench-query"
    kv = make_instance(agent, block, engine, pool, null_bindings())
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


# -- 4. engine-facing call latency -------------------------------------------------------


def bench_calls(rows: list[Row], notes: list[str], samples: int, quiet: bool) -> None:
    block, region, held = 4 * KIB, 256, 64
    log(f"engine-facing calls: {samples} samples each", quiet)
    engine = randomized(block * region, seed=11)
    pool = touched(block * 2048)
    agent = "bench-calls"
    kv = make_instance(agent, block, engine, pool, null_bindings(stats=True), telemetry=True)
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
    finally:
        kv.close()

    for name, values in results.items():
        med = statistics.median(values)
        rows.append(Row("call", f"{name} median", med, "us", target="<=20 us", ok=med <= 20.0))
        rows.append(Row("call", f"{name} p99", percentile(values, 99), "us"))


# -- 5. idle CPU -------------------------------------------------------------------------


def bench_idle(rows: list[Row], seconds: float, quiet: bool) -> None:
    log(f"idle CPU: 1 s settle, {seconds:.0f} s measured", quiet)
    block = 4 * KIB
    engine = randomized(block * 64, seed=3)
    pool = touched(block * 64)
    agent = "bench-idle"
    kv = make_instance(agent, block, engine, pool, null_bindings())
    try:
        thread = runtime_thread(agent)
        time.sleep(1.0)
        span = CpuSpan(thread)
        time.sleep(seconds)  # the main thread sleeps: process CPU is kvcr's (and NIXL's)
        cpu = span.end()
    finally:
        kv.close()
    rows.append(idle_row(f"runtime thread kvcr-{agent}", 100 * cpu["thread"] / cpu["wall"]))
    rows.append(idle_row("whole process (main thread asleep)", 100 * cpu["proc"] / cpu["wall"]))


# -- main --------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = arguments(__doc__.split("\n\n")[0], "fewer repetitions (~1 min)", argv)
    if args.runs > 1:
        return repeated(__file__, args, "kvcr local benchmark")
    quiet = args.json_only
    if args.quick:  # ~45 s on 2 cores
        reps_big, reps_small, trips, spin_every = 80, 250, 2000, 10
        q_samples, c_samples = 300, 1500
    else:  # ~2.5 min on 2 cores
        reps_big, reps_small, trips, spin_every = 300, 800, 6000, 10
        q_samples, c_samples = 1000, 5000
    started = time.monotonic()
    load = MachineLoad()
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
    elapsed = time.monotonic() - started
    notes.append(load.note(elapsed, "this process", "kvcr rows need both cores"))
    # local.py's table has always picked decimals by signed value (see common._fmt).
    report(rows, notes, "kvcr local benchmark", args, elapsed, by_magnitude=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
