"""Engine calls: µs per call and per key of every public KVCR call on the engine's thread.

Run: ``uv run python benchmarks/calls.py [--quick] [--json-only] [--runs N]``

What a scheduler pays on its own thread for each call, the call alone: ``time.perf_counter_ns``
just before and just after it, nothing else inside the span (the untimed work of a sample:
building its keys, polling its operation to completion, checking the results). For each call
at 1, 100 and 10,000 keys: the median and p99 µs per call, and µs per key (median / keys).

- ``query``: HIT, MISS and FETCHABLE (a router hint of the request names a peer, a second
  kvcr instance in this process; the instance's key adapter decodes keys to router hashes),
  also at 10 and 1,000 keys, over an index of 10k resident blocks and one of 1M (64-byte
  blocks, so that a million fit a small pool; ``--quick`` skips 1M). Keys are 8 bytes, a
  different window of a shuffled set every sample. Targets (issue 36): HIT and MISS <= 0.5 µs
  + 0.05 µs per key; FETCHABLE <= 0.1 µs per key beyond the hint lookup, i.e. the slope
  ``(t(n) - t(1)) / (n - 1)``. ``diag:`` FETCHABLE with ``opportunistic_query`` instead of a
  key adapter (no decode per key).
- ``deposit`` (fresh keys every sample, into a full pool: each deposit evicts), ``deliver``
  and ``fetch`` (resident keys), ``release`` (of the fetch's handles), then the engine
  polls the operation to completion every 0.5 ms, outside the timed span.
- ``submit_hint`` (a hint of that many block hashes, a new request every sample) and
  ``discard_hint``; ``align_sequence`` (resident keys; after each, an empty fetch is polled
  to completion, untimed: the runtime takes commands in order, so the align is done before
  the next sample); ``poll_completed`` with nothing ready.

Between samples the engine behaves as a scheduler: it polls an operation to completion at
its 0.5 ms cadence, and makes calls that return at once (query, submit_hint,
poll_completed) ten in a row, yielding (``time.sleep(0)``) before every tenth, as a step
queries its waiting requests; kvcr's runtime thread runs in the background as usual. The
first call after a yield is slower (on this VM a syscall costs the next ~1 µs of Python its
caches): it is in the p99 (and ``diag: HIT after a yield``), not in the median. After set-up
``gc.collect(); gc.freeze()``, as vLLM does after start-up. The ``timer`` row is an empty
span (two clock reads): it is inside every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import attrs
import numpy as np
from common import (
    KIB,
    Engine,
    Row,
    engine_of,
    free_port,
    log,
    make_instance,
    null_bindings,
    percentile,
    run_main,
    touched,
)

from kvcr import KVCR
from kvcr.config import RemoteFWDramOptions
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.hints import fetch_hint
from kvcr.types import CacheTier, MemoryRef, QueryStatus

TITLE = "kvcr engine calls"
CALL_SIZES = (1, 100, 10_000)
QUERY_SIZES = (1, 10, 100, 1_000, 10_000)
MOST = max(CALL_SIZES + QUERY_SIZES)  # keys in the largest call
CADENCE = 0.5e-3  # the engine's poll cadence for operations (a scheduler step)
QUERY_BLOCK = 64  # bytes: the index is per block, so tiny blocks keep a 1M pool small
CALL_BLOCK = 4 * KIB
FILL_BATCH = 10_000  # keys per deposit while filling an index
CHANNEL = "peer channel"  # label of the instance with a control channel and a hint
BURST = 10  # sync calls: the engine yields before every 10th (a scheduler's step)
STRIDE = 7919  # window i starts at i * STRIDE: successive samples ask for other keys

# Key spaces (8-byte big-endian ints, which the key adapter decodes to router hashes).
RESIDENT = 0
MISSING = 1 << 40
HINTED = 1 << 41
FRESH = 1 << 42  # deposits: a new key every time
SUBMITTED = 1 << 43  # submit_hint's hashes

HIT = (QueryStatus.HIT, CacheTier.LOCAL_G2)
MISS = (QueryStatus.MISS, None)
FETCHABLE = (QueryStatus.FETCHABLE, CacheTier.REMOTE_G2)


def key(i: int) -> bytes:
    return i.to_bytes(8, "big")


class IntKeys:
    """The key adapter of an engine whose block keys are the router's hashes, 8 bytes
    big-endian: its ``decode`` is part of what a FETCHABLE answer costs per key."""

    def encode(self, framework_key: int) -> bytes:
        return key(framework_key)

    def decode(self, block_key: bytes) -> int:
        return int.from_bytes(block_key, "big")


class Windows:
    """Keys for each sample: window ``i`` of ``n`` distinct keys out of a fixed set (stored
    twice so that a window can wrap), built once, so that successive samples ask for
    different keys as a scheduler's requests do, without making keys in the loop."""

    def __init__(self, keys: list[bytes]) -> None:
        self.size = len(keys)
        self._keys = keys + keys

    def at(self, i: int, n: int) -> list[bytes]:
        start = i * STRIDE % self.size
        return self._keys[start : start + n]


@attrs.define
class Case:
    """One call at one size (``n`` keys; 0: a call that takes none): the µs of each timed
    span. Queries also say what they answer and over which index, and whether the row
    carries the issue's HIT / MISS target."""

    bench: str
    label: str
    n: int
    us: list[float]
    answer: str = ""
    index: str = ""
    target: bool = False

    @property
    def median(self) -> float:
        return statistics.median(self.us)


@attrs.frozen
class Plan:
    """Samples per case (after warm-ups), by how long one takes."""

    quick: bool

    def sync(self, n: int) -> int:
        """Calls that return at once (query, submit_hint, release, poll_completed)."""
        if n <= 100:
            return 600 if self.quick else 10_000
        return 100 if self.quick else 1000

    def polled(self, n: int) -> int:
        """Calls whose operation the engine polls to completion (0.5 ms or more a sample)."""
        if n <= 100:
            return 200 if self.quick else 2000
        return 15 if self.quick else 100


def run(sample: Callable[[int], int], count: int, warm: int = 20) -> list[float]:
    """``warm`` + ``count`` samples; the µs of the last ``count``. ``sample(i)`` returns
    the ns of its timed span."""
    out: list[float] = []
    for i in range(warm + count):
        ns = sample(i)
        if i >= warm:
            out.append(ns / 1e3)
    return out


def settled() -> None:
    """As vLLM after start-up: what set-up made is never collected again, so the
    collections during the samples are the engine's own (young objects)."""
    gc.collect()
    gc.freeze()


# -- instances -----------------------------------------------------------------------------


@contextlib.contextmanager
def hinted_instance(
    name: str, block: int, region: np.ndarray, pool: np.ndarray, opportunistic: bool = False
) -> Iterator[Engine]:
    """A kvcr instance with a peer control channel and the key adapter (as an engine that
    takes router hints has), polling every ``CADENCE``; with ``opportunistic`` every hinted
    key is FETCHABLE without decoding it."""
    channel = ZmqPeerControlChannel("127.0.0.1", free_port(), "127.0.0.1")
    bindings = null_bindings(framework_control=channel, key_adapter=IntKeys())
    remote = RemoteFWDramOptions(opportunistic_query=opportunistic)
    try:
        kv = make_instance(name, block, region, pool, bindings, remote_fw_dram=remote)
        try:
            yield Engine(kv, name, CADENCE)
        finally:
            kv.close()
    finally:
        channel.close()


@contextlib.contextmanager
def peer() -> Iterator[str]:
    """A second kvcr instance that router hints name as the source: its control endpoint.
    Hints greet it (``eager_ctrl_connect``); no block moves from it here."""
    channel = ZmqPeerControlChannel("127.0.0.1", free_port(), "127.0.0.1")
    region, pool = touched(QUERY_BLOCK * 64), touched(QUERY_BLOCK * 64)
    try:
        kv = make_instance(
            "calls-peer", QUERY_BLOCK, region, pool, null_bindings(framework_control=channel)
        )
        try:
            yield channel.endpoint
        finally:
            kv.close()
    finally:
        channel.close()


def sources(agent: str, first: int, count: int) -> list[list[MemoryRef]]:
    """``count`` single-element block descriptors from element ``first`` on."""
    return [[MemoryRef(end_point_name=agent, element_index=first + i)] for i in range(count)]


def fill(eng: Engine, count: int, refs: list[list[MemoryRef]], no_evict: bool = False) -> None:
    """Deposit keys ``RESIDENT .. RESIDENT + count - 1``, ``len(refs)`` a call, polled to
    completion."""
    batch = len(refs)
    for first in range(0, count, batch):
        keys = [key(RESIDENT + first + i) for i in range(min(batch, count - first))]
        blocks = dict(zip(keys, refs))
        eng.done(eng.kv.deposit(blocks, no_evict=no_evict), len(blocks), "fill")


# -- query ---------------------------------------------------------------------------------


def bench_query(
    cases: list[Case], resident: int, endpoint: str, plan: Plan, quiet: bool, diag: bool
) -> None:
    """Over an index of ``resident`` blocks: HIT and MISS on an instance without a peer
    control channel (no hint to look up) and, at 1 and ``MOST`` keys, on one with a channel
    and a hint for another request (the lookup every query then makes); FETCHABLE there.
    With ``diag``: HIT after a yield, and FETCHABLE with ``opportunistic_query``; over an
    index larger than a call: HIT of the same keys every sample (cached)."""
    index = f"{resident // 1000}k" if resident < 1_000_000 else f"{resident // 1_000_000}M"
    region = touched(QUERY_BLOCK * FILL_BATCH)
    pool = touched(QUERY_BLOCK * resident)
    refs_of = functools.partial(sources, first=0, count=FILL_BATCH)
    rng = random.Random(resident)
    hits = [key(RESIDENT + i) for i in rng.sample(range(resident), resident)]
    misses = [key(MISSING + i) for i in range(2 * MOST)]
    hinted = [key(HINTED + i) for i in range(2 * MOST)]

    log(f"query over {index}: filling {resident} blocks of {QUERY_BLOCK} B", quiet)
    name = f"calls-query-{index}"
    with engine_of(name, QUERY_BLOCK, region, pool) as eng:
        fill(eng.at(CADENCE), resident, refs_of(name))
        settled()
        log(f"query over {index}: HIT, MISS", quiet)
        for answer, keys in (("HIT", hits), ("MISS", misses)):
            label = f"{answer}, {index} resident"
            bench_answer(cases, eng.kv, label, answer, keys, None, index, QUERY_SIZES, plan)
        if diag:
            us = run(query_sample(eng.kv.query, Windows(hits), 1, None, burst=1), plan.sync(1))
            cases.append(Case("query", f"diag: HIT after a yield, {index} resident", 1, us))
        if resident > MOST:  # the table outgrows the caches: the same keys again stay cached
            for n in (1, MOST):
                us = run(query_sample(eng.kv.query, Windows(hits[:n]), n, None), plan.sync(n))
                label = f"diag: HIT, the same keys every sample, {index} resident"
                cases.append(Case("query", label, n, us))

    log(f"query over {index}: filling again, peer channel and a router hint", quiet)
    name = f"calls-hinted-{index}"
    with hinted_instance(name, QUERY_BLOCK, region, pool) as eng:
        kv = eng.kv
        fill(eng, resident, refs_of(name))
        kv.submit_hint(fetch_hint(endpoint, [HINTED + i for i in range(2 * MOST)]), "hinted")
        settled()
        log(f"query over {index}: HIT, MISS, FETCHABLE", quiet)
        for answer, keys in (("HIT", hits), ("MISS", misses)):
            label = f"{answer}, {CHANNEL}, {index} resident"
            bench_answer(cases, kv, label, answer, keys, None, index, (1, MOST), plan)
        label = f"FETCHABLE, {index} resident"
        bench_answer(cases, kv, label, "FETCHABLE", hinted, "hinted", index, QUERY_SIZES, plan)
    if not diag:
        return

    log("query: FETCHABLE with opportunistic_query (no key adapter decode)", quiet)
    pool = touched(QUERY_BLOCK * FILL_BATCH)
    name = "calls-opportunistic"
    with hinted_instance(name, QUERY_BLOCK, region, pool, opportunistic=True) as eng:
        fill(eng, FILL_BATCH, refs_of(name))
        eng.kv.submit_hint(fetch_hint(endpoint, [HINTED]), "hinted")  # covers every key
        settled()
        label = "diag: FETCHABLE, opportunistic_query, 10k resident"
        bench_answer(cases, eng.kv, label, "FETCHABLE", hinted, "hinted", "10k", QUERY_SIZES, plan)


def bench_answer(
    cases: list[Case],
    kv: KVCR,
    label: str,
    answer: str,
    keys: list[bytes],
    request: str | None,
    index: str,
    sizes: Sequence[int],
    plan: Plan,
) -> None:
    """``query`` of ``keys`` (for ``request``), all answering ``answer``, at ``sizes``: one
    case each. The answers are checked before and after, so that a query that went wrong
    (e.g. a hint marked failed) cannot pass for a fast one."""
    expected = {"HIT": HIT, "MISS": MISS, "FETCHABLE": FETCHABLE}[answer]
    windows = Windows(keys)
    target = answer != "FETCHABLE" and not label.startswith("diag")
    for when in ("before", "after"):
        bad = [a for a in kv.query(keys, request) if a != expected]
        if bad:
            raise RuntimeError(f"query {label} {when}: {len(bad)} keys not {expected}: {bad[0]}")
        if when == "before":
            for n in sizes:
                us = run(query_sample(kv.query, windows, n, request), plan.sync(n))
                cases.append(Case("query", label, n, us, answer, index, target))


def query_sample(
    query: Callable[..., object],
    windows: Windows,
    n: int,
    request: str | None,
    burst: int = BURST,
) -> Callable[[int], int]:
    """Sample ``i``: ``query`` of window ``i`` (for ``request``), the first of every
    ``burst`` after a yield."""
    clock, pause = time.perf_counter_ns, time.sleep

    def plain(i: int) -> int:
        keys = windows.at(i, n)
        if not i % burst:
            pause(0)
        t0 = clock()
        query(keys)
        return clock() - t0

    def hinted(i: int) -> int:
        keys = windows.at(i, n)
        if not i % burst:
            pause(0)
        t0 = clock()
        query(keys, request)
        return clock() - t0

    return plain if request is None else hinted


# -- the other calls -----------------------------------------------------------------------


def bench_calls(cases: list[Case], endpoint: str, plan: Plan, quiet: bool) -> None:
    """deposit, deliver, fetch + release, submit_hint + discard_hint, align_sequence and
    poll_completed on one instance: ``MOST`` keys held resident (``no_evict``, so that
    deposits cannot evict them), and room for one more deposit of ``MOST`` keys (a full
    pool after the first: every deposit then evicts, as in steady state). Engine elements
    [0, MOST) are deposit sources, [MOST, 2 MOST) deliver destinations."""
    name = "calls"
    region = touched(CALL_BLOCK * 2 * MOST)
    pool = touched(CALL_BLOCK * (2 * MOST + 1024))
    log(f"calls: {MOST} resident blocks of {CALL_BLOCK} B", quiet)
    with hinted_instance(name, CALL_BLOCK, region, pool) as eng:
        kv = eng.kv
        srcs = sources(name, 0, MOST)
        dsts = sources(name, MOST, MOST)
        fill(eng, MOST, srcs, no_evict=True)
        rng = random.Random(1)
        held = Windows([key(RESIDENT + i) for i in rng.sample(range(MOST), MOST)])
        settled()
        clock, pause = time.perf_counter_ns, time.sleep
        serial = iter(range(FRESH, FRESH + 10**12))

        for n in CALL_SIZES:
            log(f"calls: {n} keys", quiet)

            def deposit(i: int, n: int = n) -> int:
                blocks = dict(zip([key(next(serial)) for _ in range(n)], srcs))
                t0 = clock()
                handle = kv.deposit(blocks)
                ns = clock() - t0
                eng.done(handle, n, "deposit")
                return ns

            def deliver(i: int, n: int = n) -> int:
                blocks = dict(zip(held.at(i, n), dsts))
                t0 = clock()
                handle = kv.deliver(blocks)
                ns = clock() - t0
                eng.done(handle, n, "deliver")
                return ns

            released: list[float] = []

            def fetch(i: int, n: int = n, released: list[float] = released) -> int:
                keys = held.at(i, n)
                t0 = clock()
                handle = kv.fetch(keys)
                ns = clock() - t0
                entries = eng.done(handle, n, "fetch")
                handles = [entry.release_handle for entry in entries.values()]
                t0 = clock()
                results = kv.release(handles)
                released.append((clock() - t0) / 1e3)
                if not all(ok for _, ok in results):
                    raise RuntimeError("release: a live fetch handle was refused")
                return ns

            discarded: list[float] = []

            def submit(i: int, n: int = n, discarded: list[float] = discarded) -> int:
                first = SUBMITTED + i * MOST
                hint = fetch_hint(endpoint, list(range(first, first + n)), message_id=i)
                request = f"request-{i}"
                if not i % BURST:
                    pause(0)
                t0 = clock()
                kv.submit_hint(hint, request)
                ns = clock() - t0
                t0 = clock()
                kv.discard_hint(request)
                discarded.append((clock() - t0) / 1e3)
                return ns

            def align(i: int, n: int = n) -> int:
                keys = held.at(i, n)
                t0 = clock()
                kv.align_sequence(keys)
                ns = clock() - t0
                eng.done(kv.fetch([]), 0, "fence")  # the runtime has done the align
                return ns

            polled, sync = plan.polled(n), plan.sync(n)
            warm = 20 if n <= 100 else 3
            cases.append(Case("deposit", "fresh keys, full pool", n, run(deposit, polled, warm)))
            cases.append(Case("deliver", "resident keys", n, run(deliver, polled, warm)))
            cases.append(Case("fetch", "resident keys", n, run(fetch, polled, warm)))
            cases.append(Case("release", "fetch's handles", n, released[warm:]))
            cases.append(Case("submit_hint", "new request, n block hashes", n, run(submit, sync)))
            if n == 1:
                cases.append(Case("discard_hint", "the request's hint", 0, discarded[20:]))
            cases.append(Case("align_sequence", "resident keys", n, run(align, polled, warm)))

        log("calls: poll_completed with nothing ready", quiet)

        def poll(i: int) -> int:
            if not i % BURST:
                pause(0)
            t0 = clock()
            results = kv.poll_completed()
            ns = clock() - t0
            if results:
                raise RuntimeError(f"poll_completed: unexpected results {results}")
            return ns

        cases.append(Case("poll_completed", "nothing ready", 0, run(poll, plan.sync(1))))


def timer_case(plan: Plan) -> Case:
    """The empty span: two clock reads, which every figure includes."""
    clock = time.perf_counter_ns

    def empty(i: int) -> int:
        t0 = clock()
        return clock() - t0

    return Case("timer", "empty span (perf_counter_ns twice)", 0, run(empty, plan.sync(1)))


# -- rows ----------------------------------------------------------------------------------


def rows_of(cases: Sequence[Case]) -> list[Row]:
    """Per case: median and p99 µs per call, µs per key. HIT and MISS medians against
    0.5 µs + 0.05 µs a key; FETCHABLE beside the plain MISS of the same size and index, and
    its slope beyond one key against 0.1 µs a key (issue 36)."""
    by_label = {(c.label, c.n): c for c in cases}
    rows: list[Row] = []
    for case in cases:
        n, median = case.n, case.median
        what = case.label if not n else f"{case.label}, {n} key{'s' if n > 1 else ''}"
        row = Row(case.bench, f"{what}: median", median, "us")
        if case.target:
            limit = 0.5 + 0.05 * n
            row.target, row.ok = f"<={limit:g} us", median <= limit
        if case.answer == "FETCHABLE":
            miss = by_label.get((f"MISS, {case.index} resident", n))
            row.baseline = None if miss is None else miss.median
        rows.append(row)
        rows.append(Row(case.bench, f"{what}: p99", percentile(case.us, 99), "us"))
        if n > 1:
            rows.append(Row(case.bench, f"{what}: per key", median / n, "us/key"))
        one = by_label.get((case.label, 1))
        if case.answer == "FETCHABLE" and n > 1 and one is not None:
            slope = (median - one.median) / (n - 1)
            rows.append(Row(case.bench, f"{what}: per key beyond 1 key", slope, "us/key"))
            if not case.label.startswith("diag"):
                rows[-1].target, rows[-1].ok = "<=0.1 us/key", slope <= 0.1
    return rows


# -- main ----------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    quiet = args.json_only
    plan = Plan(args.quick)
    cases: list[Case] = [timer_case(plan)]
    with peer() as endpoint:
        bench_query(cases, 10_000, endpoint, plan, quiet, diag=True)
        if not args.quick:
            bench_query(cases, 1_000_000, endpoint, plan, quiet, diag=False)
        bench_calls(cases, endpoint, plan, quiet)
    log("done", quiet)
    order = ["timer", "query", "deposit", "deliver", "fetch", "release", "submit_hint"]
    order += ["discard_hint", "align_sequence", "poll_completed"]
    cases.sort(key=lambda c: order.index(c.bench))  # stable: sizes stay in order
    notes = [
        "every figure is the call alone on the engine thread (perf_counter_ns around it), "
        "the empty span included; query keys are 8 bytes, a new window of a shuffled set "
        "every sample",
        "FETCHABLE: baseline = MISS of the same size and index; 'per key beyond 1 key' = "
        "(t(n) - t(1)) / (n - 1), the target's 'beyond the hint lookup'",
    ]
    return rows_of(cases), notes


def main(argv: Sequence[str] | None = None) -> int:
    load = ("this process", "the timed calls need a core, the runtime thread the other")
    return run_main(measure, argv, TITLE, "fewer samples, no 1M index (~1 min)", load)


if __name__ == "__main__":
    sys.exit(main())
