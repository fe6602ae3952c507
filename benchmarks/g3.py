"""G3 benchmark: store and fill GB/s through kvcr beside raw NIXL POSIX on the same files.

    uv run python benchmarks/g3.py            # full, 200 repetitions, ~15 s
    uv run python benchmarks/g3.py --quick    # 30 repetitions, ~5 s
    uv run python benchmarks/g3.py --json-only

Rows (median over repetitions, 64 blocks of 1 MiB and 256 blocks of 64 KiB per batch):

- ``store``: kvcr's spill of a batch evicted from a full G2 pool (each deposit of a fresh
  batch evicts the previous one, which the G3 policy moves to the files); the duration is
  the runtime's own ``g3_store`` measurement (slot reservation, record writes, the NIXL
  transfer and its polling), beside a bare NIXL agent with the POSIX backend writing the
  same number of blocks from the same engine memory into the same files.
- ``fill``: ``deliver`` of a batch that is in G3 only, straight into engine memory; the
  duration is the runtime's own ``g3_deliver`` measurement (record checks before and after,
  the NIXL transfer and its polling), beside the bare agent reading the same blocks from
  the same file offsets.
- ``us per block over raw`` (no target): what kvcr adds to each block of a batch, the
  per-block share of its bookkeeping (eviction, records, index) beside raw's copy.
- ``deliver, engine view`` (no target): the same deliver timed from the engine's call until
  ``poll_completed`` returned every entry, which adds the hand-over to the runtime thread,
  the answer and the engine's polling.

The engine polls ``poll_completed`` every 100 µs, as an engine does between its steps: a
loop that polls without pause would take the GIL back from the runtime thread after every
NIXL call (NIXL releases it while it copies), on two cores the copy's own.

Target: kvcr >= 0.85x raw NIXL. The bare agent is configured as kvcr's file agent (no
progress thread), and runs before kvcr's operations in every other repetition (after them
in the others), so that neither side always finds the caches as the other left them.
Files live in ``$TMPDIR``; raw NIXL cycles through the file slots as kvcr does, so that
both touch as many distinct page-cache pages (writing a fixed range again would stay cached
and flatter raw), and every slot is written once before the measured repetitions (the first
touch of a fallocated page is slow). Bytes are checked with CRCs once per case.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import common
from common import Engine, Row, log, percentile, run_main

from kvcr import KVCRBindings
from kvcr.config import G3Options, KVCRBackendConfigs, KVCRConfig, LocalDramOptions
from kvcr.telemetry import DURATION_METRIC, InMemoryStats
from kvcr.testing import open_kvcr
from kvcr.types import MemoryRef, RegionDescriptor

try:
    from nixl_cu13._api import nixl_agent, nixl_agent_config
except ImportError:  # the meta package's shim
    from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]

KIB, MIB = common.KIB, common.MIB
ENGINE_POLL_S = 100e-6
NOTES = (  # the closing notes: what the baselines are
    "store: kvcr's runtime-measured g3_store per spilled batch; raw: post..DONE",
    "fill: kvcr's runtime-measured g3_deliver into engine memory; raw: post..DONE",
    "engine view: deliver call .. poll_completed returned every entry (100 us polls)",
)


class RawPosix:
    """A bare NIXL agent (POSIX backend) over the engine region and the same G3 files."""

    def __init__(self, region: Any, paths: list[Path]) -> None:
        self.agent = nixl_agent(
            f"g3-raw-{os.getpid()}", nixl_agent_config(enable_prog_thread=False, backends=[])
        )
        self.agent.create_backend("POSIX", {})
        self.fds = [os.open(p, os.O_RDWR) for p in paths]
        self.sizes = [p.stat().st_size for p in paths]
        self.agent.register_memory([(region.ctypes.data, region.nbytes, 0, "")], "DRAM")
        self.agent.register_memory(
            [(0, size, fd, "") for fd, size in zip(self.fds, self.sizes)], "FILE"
        )
        self.region = region

    def run(self, op: str, block: int, count: int, area: int, first: int, slots: int) -> float:
        """``count`` blocks between the region and file slots ``first``.. (striped, wrapping
        at ``slots`` per file), the access pattern kvcr's spills and fills have."""
        base = self.region.ctypes.data
        local = [(base + i * block, block, 0) for i in range(count)]
        nfiles = len(self.fds)
        remote = [
            (area + ((first + i) // nfiles % slots) * block, block, self.fds[(first + i) % nfiles])
            for i in range(count)
        ]
        t0 = time.perf_counter()
        handle = self.agent.initialize_xfer(
            op,
            self.agent.get_xfer_descs(local, "DRAM"),
            self.agent.get_xfer_descs(remote, "FILE"),
            self.agent.name,
        )
        state = self.agent.transfer(handle)
        while state == "PROC":
            state = self.agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - t0
        self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"raw {op} ended {state}")
        return elapsed

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def bench_case(rows: list[Row], label: str, block: int, count: int, reps: int, quiet: bool) -> None:
    directory = Path(tempfile.mkdtemp(prefix="kvcr-g3-bench-"))
    name = f"g3-bench-{os.getpid()}-{block}"
    region = common.randomized(block * count * 2, seed=block)
    pool = common.touched(block * count)
    paths = (directory / "d0" / "g3.bin", directory / "d1" / "g3.bin")
    g3 = G3Options(paths=paths, capacity_bytes_per_file=block * count * 2)
    stats = InMemoryStats()
    opened = open_kvcr(
        KVCRConfig(
            name,
            [("", block)],
            enable_telemetry=True,
            operation_timeout_ms=60_000,
            abandon_timeout_ms=120_000,
        ),
        KVCRBindings(
            request_pin=lambda keys: 0,
            poll_pin_results=list,
            release_pin=lambda handle: True,
            stats_factory=lambda: stats,
        ),
        KVCRBackendConfigs(
            framework_regions=[
                RegionDescriptor(addr=region.ctypes.data, size=block, count=2 * count)
            ],
            local_dram=LocalDramOptions([("", pool.ctypes.data, pool.nbytes)]),
            g3=g3,
        ),
    )
    kv, runtime = opened.kv, opened.runtime
    eng = Engine(kv, name, ENGINE_POLL_S)
    raw = None
    serial = iter(range(1 << 40))
    store_s, fill_s, engine_s, raw_store_s, raw_fill_s = [], [], [], [], []

    def deposit(keys: list[bytes]) -> None:
        entries = eng.wait(kv.deposit({k: eng.ref(i) for i, k in enumerate(keys)}), len(keys))
        assert all(e.success for e in entries.values()), "deposit failed"

    try:
        previous = [next(serial).to_bytes(8, "big") for _ in range(count)]
        deposit(previous)
        raw = RawPosix(region, list(paths))
        area = runtime.g3.files.area
        # Pre-touch every slot of the files (fresh fallocated pages are several times slower
        # to write the first time): otherwise kvcr, whose spill comes first in each repetition,
        # pays the first touch of the 4 * count slots it cycles through and raw never does.
        for first in range(0, 4 * count, count):
            raw.run("WRITE", block, count, area, first, 2 * count)

        def raw_pair(rep: int) -> None:
            # The same number of distinct file pages as kvcr, which cycles through all its
            # slots: a fixed range would stay in the page cache and flatter raw. The read
            # takes the window written one repetition earlier: read straight after its own
            # write, raw found 16 MiB of source and destination still in the CPU's cache,
            # where kvcr's read comes after the deposit's 16 MiB copy.
            first = rep * count
            raw_store_s.append(raw.run("WRITE", block, count, area, first, 2 * count))
            raw_fill_s.append(raw.run("READ", block, count, area, first - count, 2 * count))

        for rep in range(reps + 1):
            log(f"{label}: rep {rep}", quiet)
            if rep % 2:  # raw first in every other repetition: neither side always follows
                raw_pair(rep)
            fresh = [next(serial).to_bytes(8, "big") for _ in range(count)]
            kv.get_stats()  # a fresh interval: the next g3_store observation is this spill
            deposit(fresh)  # evicts `previous`: one spill of `count` blocks
            stored = stats.histograms.get((DURATION_METRIC, ("g3_store", "success")), [])
            elapsed, entries = eng.timed(
                lambda previous=previous: kv.deliver(  # the refs are made in the timed region
                    {
                        k: [MemoryRef(end_point_name=name, element_index=count + i)]
                        for i, k in enumerate(previous)
                    }
                ),
                count,
            )
            assert all(e.success for e in entries.values()), "deliver from G3 failed"
            delivered = stats.histograms.get((DURATION_METRIC, ("g3_deliver", "success")), [])
            if rep == 0:  # bytes checked once: what came back is what was deposited
                for i in range(count):
                    src = region[i * block : (i + 1) * block]
                    dst = region[(count + i) * block : (count + i + 1) * block]
                    assert zlib.crc32(src) == zlib.crc32(dst), "G3 round trip changed bytes"
            else:
                store_s.append(stored[-1])
                fill_s.append(delivered[-1])
                engine_s.append(elapsed)
                if rep % 2 == 0:
                    raw_pair(rep)
            previous = fresh
    finally:
        if raw is not None:
            raw.close()
        kv.close()
        shutil.rmtree(directory, ignore_errors=True)
    nbytes = block * count
    for what, mine, theirs in (
        ("store", store_s, raw_store_s),
        ("fill (deliver)", fill_s, raw_fill_s),
    ):
        value = nbytes / percentile(mine, 50) / 1e9
        baseline = nbytes / percentile(theirs, 50) / 1e9
        rows.append(
            Row(
                "g3",
                f"{label} {what}: kvcr vs raw NIXL POSIX, median",
                value,
                "GB/s",
                baseline,
                ">=0.85x raw",
                value / baseline >= 0.85,
            )
        )
    for what, mine, theirs in (("store", store_s, raw_store_s), ("fill", fill_s, raw_fill_s)):
        rows.append(
            Row(
                "g3",
                f"{label} {what}: kvcr us per block over raw ((kvcr - raw) / blocks, medians)",
                (percentile(mine, 50) - percentile(theirs, 50)) / count * 1e6,
                "us/block",
            )
        )
    engine = nbytes / percentile(engine_s, 50) / 1e9
    rows.append(
        Row(
            "g3",
            f"{label} deliver, engine view: call to last entry polled, median",
            engine,
            "GB/s",
            nbytes / percentile(raw_fill_s, 50) / 1e9,
        )
    )


def measure(args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    reps = 30 if args.quick else 200
    rows: list[Row] = []
    bench_case(rows, "64 x 1 MiB", MIB, 64, reps, args.json_only)
    bench_case(rows, "256 x 64 KiB", 64 * KIB, 256, reps, args.json_only)
    return rows, list(NOTES)


def main(argv: list[str] | None = None) -> int:
    quick_help = "30 repetitions instead of 200 (~5 s)"
    return run_main(measure, argv, "kvcr G3 benchmark", quick_help)


if __name__ == "__main__":
    sys.exit(main())
