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

import argparse
import functools
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from common import (
    KIB,
    MIB,
    RawNixl,
    Row,
    check_crcs,
    crcs,
    engine_of,
    gbps,
    hugetlb_pages,
    interleaved,
    log,
    memcpy,
    page_kind,
    randomized,
    run_main,
    shared_pages,
    succeeded,
    touched,
)

SIZES = (("7MiB", 7 * MIB, 16), ("2MiB", 2 * MIB, 16), ("64KiB", 64 * KIB, 256))
CADENCES_S = (0.0005, 0.005)


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


def bench_case(
    rows: list[Row], raw: RawNixl, kind: str, label: str, block: int, count: int, reps: int
) -> None:
    nbytes = block * count
    engine = allocate(kind, 2 * nbytes, 0)  # [0, count): sources; [count, 2 count): targets
    engine[:nbytes] = randomized(nbytes, seed=block)
    pool = allocate(kind, 3 * nbytes, 0xAA)  # count held for deliver, 2 count for deposits
    scratch = allocate(kind, nbytes, 0x55)
    pages = "+".join(sorted({page_kind(engine), page_kind(pool)}))
    src_view, dst_view = engine[:nbytes], engine[nbytes:]
    src_crcs = crcs(src_view, block, count)
    with raw:
        raw.register(engine, scratch)
        scr_local, _ = raw.dlists(scratch, block, count)
        _, src_loop = raw.dlists(src_view, block, count)
        times = interleaved(
            {
                "memcpy": functools.partial(memcpy, scratch, src_view),
                "raw-nixl": functools.partial(raw.read, scr_local, src_loop, count),
            },
            reps,
        )
        check_crcs(f"{label}: a baseline moved wrong bytes", scratch, block, count, src_crcs)

    for threads in (1, 2):
        os.environ["KVCR_COPY_THREADS"] = str(threads)
        agent = f"copies-{kind}-{label}-{threads}"
        with engine_of(agent, block, engine, pool) as eng:
            kv, ref = eng.kv, eng.ref
            resident = {b"R%06d" % i: ref(i) for i in range(count)}
            held = functools.partial(kv.deposit, resident, no_evict=True)
            eng.at(0.0005).timed(held, count, succeeded)
            delivery = {key: ref(count + i) for i, key in enumerate(resident)}
            serial = iter(range(10**9))
            engines = {cadence: eng.at(cadence) for cadence in CADENCES_S}
            for rep in range(reps + 2):
                for cadence, poll in engines.items():
                    blocks = {b"D%09d" % next(serial): ref(i) for i in range(count)}
                    deposit, _ = poll.timed(functools.partial(kv.deposit, blocks), count, succeeded)
                    deliver, _ = poll.timed(
                        functools.partial(kv.deliver, delivery), count, succeeded
                    )
                    if rep >= 2:
                        times.setdefault(f"deposit {threads} {cadence}", []).append(deposit)
                        times.setdefault(f"deliver {threads} {cadence}", []).append(deliver)
            wrong = f"{label}: delivered bytes differ from deposited bytes"
            check_crcs(wrong, dst_view, block, count, src_crcs)
            dst_view.fill(0)
    os.environ.pop("KVCR_COPY_THREADS", None)

    def median_gbps(name: str) -> float:
        return gbps(nbytes, times[name])[0]

    diag = "" if kind == "shm" else f"diag: {kind}, "
    what = f"{count} x {label}, {diag}{pages} pages"
    memcpy_gbps = median_gbps("memcpy")
    rows.append(Row("baseline", f"{what}: memcpy (1 thread) median", memcpy_gbps, "GB/s"))
    rows.append(
        Row(
            "baseline",
            f"{what}: raw NIXL loopback READ median",
            median_gbps("raw-nixl"),
            "GB/s",
            memcpy_gbps,
        )
    )
    for direction in ("deposit", "deliver"):
        for threads in (1, 2):
            for cadence in CADENCES_S:
                want = (0.9 if threads == 1 else 1.2) if block >= 2 * MIB else 0.6
                value = median_gbps(f"{direction} {threads} {cadence}")
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


def measure(args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    reps = (
        {"7MiB": 6, "2MiB": 12, "64KiB": 12}
        if args.quick
        else {"7MiB": 20, "2MiB": 40, "64KiB": 40}
    )
    rows: list[Row] = []
    raw = RawNixl("copies-raw")
    kinds = ("shm", "thp", "hugetlb") if HUGETLBFS is not None else ("shm", "thp")
    for kind in kinds:
        for label, block, count in SIZES:
            if kind != "shm" and label == "64KiB":
                continue
            log(f"{kind} {count} x {label}", args.json_only)
            bench_case(rows, raw, kind, label, block, count, reps[label])
    return rows, []


def main(argv: Sequence[str] | None = None) -> int:
    load = ("this process", "kvcr rows use up to three threads")
    return run_main(measure, argv, "kvcr in-process copies", "fewer repetitions (~1 min)", load)


if __name__ == "__main__":
    sys.exit(main())
