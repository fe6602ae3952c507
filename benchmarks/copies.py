"""In-process copies on the memory engines give kvcr: deposit and deliver against memcpy.

Run: ``uv run python benchmarks/copies.py [--quick] [--json-only] [--runs N]``

The memory (target rows): shared mappings, as vLLM's adapter maps its secondary pool and
the guard maps its pools in /dev/shm, which get 4 KiB pages (no transparent huge pages for
shared memory). Rows marked "diag: thp" repeat a case on private memory that numpy backs
with transparent huge pages, where page walks cost less; with ``KVCR_BENCH_HUGETLBFS=DIR``
(a hugetlbfs mount with ~1.5 GiB of free 2 MiB pages), "diag: hugetlb" rows repeat them on
shared huge pages, as ``kvcr-guard --huge-pages`` gives them. Each row says which pages it
got.

The engine (target rows): it submits an operation and calls ``poll_completed`` once per
scheduler step, sleeping in between: every 0.5 ms and every 5 ms. An operation is timed from
the engine call until the poll that returned its last entry, so a 5 ms cadence adds up to
5 ms to any operation (the rows show what a scheduler sees).

Baselines, measured in the same run on the same kind of memory: ``np.copyto`` of the same
bytes on one thread (memcpy), and a bare NIXL agent's loopback READ of the same descriptors
(the copy kvcr did in process before its copy threads: CMA, which pins and walks every
page). kvcr rows are taken with 1 and 2 copy threads (``KVCR_COPY_THREADS``).

Targets (issue 17): on 4 KiB pages, kvcr >= 0.9x memcpy at 16 x 7 MiB and 16 x 2 MiB with
one copy thread, >= 1.2x with two; >= 0.6x at 256 x 64 KiB.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    KIB,
    MIB,
    MachineLoad,
    Row,
    arguments,
    crcs,
    hugetlb_pages,
    log,
    make_instance,
    null_bindings,
    page_kind,
    randomized,
    raw_transfer,
    repeated,
    report,
    shared_pages,
    touched,
)
from local import RawNixl

from kvcr.types import MemoryRef, OpEntryStatus

SIZES = (("7MiB", 7 * MIB, 16), ("2MiB", 2 * MIB, 16), ("64KiB", 64 * KIB, 256))
CADENCES_S = (0.0005, 0.005)
OP_TIMEOUT_S = 30.0


# KVCR_BENCH_HUGETLBFS=DIR (a hugetlbfs mount with free 2 MiB pages): also rows on memory
# mapped from files there, as `kvcr-guard --huge-pages` maps its groups.
_HUGE_DIR = os.environ.get("KVCR_BENCH_HUGETLBFS")
HUGETLBFS: Path | None = Path(_HUGE_DIR) if _HUGE_DIR else None


def allocate(kind: str, nbytes: int, fill: int) -> np.ndarray:
    if kind == "shm":
        return shared_pages(nbytes, fill)
    if kind == "hugetlb":
        assert HUGETLBFS is not None
        return hugetlb_pages(HUGETLBFS, nbytes, fill)
    return touched(nbytes, fill)  # numpy madvises large buffers for huge pages


def timed(kv: Any, submit: Callable[[], int], nkeys: int, cadence: float) -> float:
    """Seconds from the engine call until the poll that returned the op's last entry,
    polling every ``cadence`` seconds (sleeping between polls, as a scheduler does)."""
    clock = time.perf_counter
    t0 = clock()
    handle = submit()
    got = 0
    while True:
        for op, done in kv.poll_completed():
            if op != handle:
                raise RuntimeError(f"unexpected results for op {op}")
            bad = [k for k, v in done.items() if v.status is not OpEntryStatus.SUCCESS]
            if bad:
                raise RuntimeError(f"op {handle}: {len(bad)} entries failed")
            got += len(done)
        if got >= nkeys:
            return clock() - t0
        if clock() - t0 > OP_TIMEOUT_S:
            raise RuntimeError(f"op {handle}: {got}/{nkeys} entries after timeout")
        time.sleep(cadence)


def bench_case(
    rows: list[Row], raw: RawNixl, kind: str, label: str, block: int, count: int, reps: int
) -> None:
    nbytes = block * count
    gb = nbytes / 1e9
    engine = allocate(kind, 2 * nbytes, 0)  # [0, count): sources; [count, 2 count): targets
    engine[:nbytes] = randomized(nbytes, seed=block)
    pool = allocate(kind, 3 * nbytes, 0xAA)  # count held for deliver, 2 count for deposits
    scratch = allocate(kind, nbytes, 0x55)
    pages = "+".join(sorted({page_kind(engine), page_kind(pool)}))
    src_view, dst_view = engine[:nbytes], engine[nbytes:]
    src_crcs = crcs(src_view, block, count)
    times: dict[str, list[float]] = {}

    def memcpy() -> float:
        t0 = time.perf_counter()
        np.copyto(scratch, src_view)
        return time.perf_counter() - t0

    raw.register(engine)
    raw.register(scratch)
    scr_local, _ = raw.dlists(scratch, block, count)
    _, src_loop = raw.dlists(src_view, block, count)
    try:
        for rep in range(reps + 2):
            for name, run in (
                ("memcpy", memcpy),
                ("raw-nixl", lambda: raw_transfer_read(raw, scr_local, src_loop, count)),
            ):
                elapsed = run()
                if rep >= 2:
                    times.setdefault(name, []).append(elapsed)
        if crcs(scratch, block, count) != src_crcs:
            raise RuntimeError(f"{label}: a baseline moved wrong bytes")
    finally:
        raw.reset()

    for threads in (1, 2):
        os.environ["KVCR_COPY_THREADS"] = str(threads)
        agent = f"copies-{kind}-{label}-{threads}"
        kv = make_instance(agent, block, engine, pool, null_bindings())
        try:
            ref = [[MemoryRef(end_point_name=agent, element_index=i)] for i in range(2 * count)]
            resident = {b"R%06d" % i: ref[i] for i in range(count)}
            timed(kv, functools.partial(kv.deposit, resident, no_evict=True), count, 0.0005)
            delivery = {key: ref[count + i] for i, key in enumerate(resident)}
            serial = iter(range(10**9))
            for rep in range(reps + 2):
                for cadence in CADENCES_S:
                    blocks = {b"D%09d" % next(serial): ref[i] for i in range(count)}
                    deposit = timed(kv, functools.partial(kv.deposit, blocks), count, cadence)
                    deliver = timed(kv, functools.partial(kv.deliver, delivery), count, cadence)
                    if rep >= 2:
                        times.setdefault(f"deposit {threads} {cadence}", []).append(deposit)
                        times.setdefault(f"deliver {threads} {cadence}", []).append(deliver)
            if crcs(dst_view, block, count) != src_crcs:
                raise RuntimeError(f"{label}: delivered bytes differ from deposited bytes")
            dst_view.fill(0)
        finally:
            kv.close()
    os.environ.pop("KVCR_COPY_THREADS", None)

    def gbps(name: str) -> float:
        return gb / statistics.median(times[name])

    diag = "" if kind == "shm" else f"diag: {kind}, "
    what = f"{count} x {label}, {diag}{pages} pages"
    memcpy_gbps = gbps("memcpy")
    rows.append(Row("baseline", f"{what}: memcpy (1 thread) median", memcpy_gbps, "GB/s"))
    rows.append(
        Row(
            "baseline",
            f"{what}: raw NIXL loopback READ median",
            gbps("raw-nixl"),
            "GB/s",
            memcpy_gbps,
        )
    )
    for direction in ("deposit", "deliver"):
        for threads in (1, 2):
            for cadence in CADENCES_S:
                want = (0.9 if threads == 1 else 1.2) if block >= 2 * MIB else 0.6
                value = gbps(f"{direction} {threads} {cadence}")
                gated = kind == "shm"
                rows.append(
                    Row(
                        direction,
                        f"{what}: kvcr, {threads} copy thread{'s' if threads > 1 else ''}, "
                        f"engine polls every {cadence * 1000:g} ms, median vs memcpy",
                        value,
                        "GB/s",
                        memcpy_gbps,
                        f">={want}x memcpy" if gated else "",
                        value >= want * memcpy_gbps if gated else None,
                    )
                )


def raw_transfer_read(raw: RawNixl, dst_local: Any, src_loopback: Any, count: int) -> float:
    idx = list(range(count))
    return raw_transfer(raw.agent, "READ", dst_local, idx, src_loopback, idx)


def main(argv: Sequence[str] | None = None) -> int:
    args = arguments(__doc__.split("\n\n")[0], "fewer repetitions (~1 min)", argv)
    if args.runs > 1:
        return repeated(__file__, args, "kvcr in-process copies")
    quiet = args.json_only
    reps = (
        {"7MiB": 6, "2MiB": 12, "64KiB": 12}
        if args.quick
        else {"7MiB": 20, "2MiB": 40, "64KiB": 40}
    )
    started = time.monotonic()
    load = MachineLoad()
    rows: list[Row] = []
    raw = RawNixl("copies-raw")
    kinds = ("shm", "thp", "hugetlb") if HUGETLBFS is not None else ("shm", "thp")
    for kind in kinds:
        for label, block, count in SIZES:
            if kind != "shm" and label == "64KiB":
                continue
            log(f"{kind} {count} x {label}", quiet)
            bench_case(rows, raw, kind, label, block, count, reps[label])
    elapsed = time.monotonic() - started
    notes = [load.note(elapsed, "this process", "kvcr rows use up to three threads")]
    report(rows, notes, "kvcr in-process copies", args, elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
