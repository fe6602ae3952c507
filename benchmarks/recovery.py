"""Crash-recovery benchmark: what the recovery journal costs the deposit path, and how long a
worker takes to start warm from it, each beside a baseline measured in the same run.

    uv run python benchmarks/recovery.py            # full, ~1.5 min
    uv run python benchmarks/recovery.py --quick    # ~30 s
    uv run python benchmarks/recovery.py --json-only

Rows:

- ``deposit``: GB/s of deposits (engine poll, fresh keys, steady-state eviction) into a guard
  group's pools with the journal mirroring every commit and eviction, beside the same
  instance with its journal detached (rounds alternate), so that only the journal differs.
  Target at 7 MiB and 64 KiB blocks: the journal costs at most 5 % (ratio >= 0.95). At
  4 KiB blocks (a diagnostic) kvcr's per-key costs dominate, the journal's included.
- ``warm start``: constructing a KVCR over a group whose journal holds 100, 1,000 and 10,000
  committed blocks (replay, restoring the index, republishing inventory, a fresh snapshot),
  beside constructing it over an empty group; and the cost per recovered block.
- ``takeover``: a worker holding 100, 1,000 or 10,000 blocks is SIGKILLed; the service's own
  figure from the holder's exit to serving (``took_over``, the start of a KVCR over the
  group, warm from the journal), and from the kill until ``status`` says ``serving``.
- ``handback``: claiming that served group (the service stops serving, then grants), beside
  claiming an idle group.
- ``g3 serve``: a holder with G3 (one file) deposits 2 N blocks into an N-block pool, so the
  first N spill to G3, and is SIGKILLed; a peer then pulls (hinted ``deliver``, engine
  poll) the N blocks the service serves from G3 (read into bounce slots, then written),
  beside pulls of the N blocks it serves from G2: the same bytes (key ``k`` and key
  ``N + k`` were deposited from the same element), the same size, the same server, rounds
  alternating. The G3 file is in the page cache after the spill: this is the serving path's
  cost, not the disk's.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import shutil
import sys
import tempfile
import time
import zlib

import common
from common import (
    Engine,
    GuardInstance,
    Row,
    free_port,
    log,
    make_instance,
    null_bindings,
    percentile,
    pool_service,
    run_main,
)

from kvcr.config import RemoteFWDramOptions
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.hints import fetch_hint
from kvcr.types import MemoryRef

KIB, MIB = common.KIB, common.MIB
NOTES = (  # the closing notes: what the baselines are
    "deposit: one instance, its index's journal attached or detached by rounds",
    "warm start baseline: the same construction over an empty journal",
    "takeover: the first one in a service also starts its NIXL agent (excluded: median)",
    "handback baseline: claiming an idle group of the same service",
    "g3 serve baseline: pulls of as many G2 blocks (same bytes) from the same guard server",
)


class IntKeys:
    """Key adapter: a key is its router hash, 8 bytes big-endian."""

    def encode(self, framework_key: int) -> bytes:
        return framework_key.to_bytes(8, "big")

    def decode(self, block_key: bytes) -> int:
        return int.from_bytes(block_key, "big")


def bench_deposit(
    rows: list[Row],
    case: str,
    block: int,
    nkeys: int,
    reps: int,
    rounds: int,
    target: bool,
    quiet: bool,
) -> None:
    """One instance over a guard group; rounds alternate publishing to the journal and not
    (the index's journal detached), so only the journal differs. Detaching it leaves the
    journal stale: this group is thrown away afterwards, which no real worker could do."""
    region = common.randomized(block * nkeys, seed=nkeys)
    pool_bytes = block * nkeys * 4  # steady state: every deposit evicts after the first four
    service = pool_service(pool_bytes)
    times: dict[bool, list[float]] = {True: [], False: []}
    serial = iter(range(1 << 40))
    try:
        inst = GuardInstance(service, f"rec-{os.getpid()}-{nkeys}", block, region)
        index = inst.runtime.index
        mirror = index.journal
        try:
            for rnd in range(2 * rounds):
                journal = rnd % 2 == 0
                log(f"deposit {case} round {rnd} journal={'on' if journal else 'off'}", quiet)
                index.journal = mirror if journal else None
                for rep in range(reps + 2):
                    keys = [next(serial).to_bytes(8, "big") for _ in range(nkeys)]
                    blocks = {k: inst.engine.ref(i) for i, k in enumerate(keys)}
                    deposit = functools.partial(inst.kv.deposit, blocks)
                    elapsed = inst.engine.seconds(deposit, nkeys, f"deposit {case}")
                    if rep >= 2:  # two warm-ups per round
                        times[journal].append(elapsed)
        finally:
            index.journal = mirror
            inst.close()
    finally:
        service.stop()
    nbytes = block * nkeys
    on, off = (nbytes / percentile(times[j], 50) / 1e9 for j in (True, False))
    per_key = (percentile(times[True], 50) - percentile(times[False], 50)) / nkeys * 1e6
    if target:
        rows.append(
            Row(
                "deposit",
                f"{case}: journal on / off, median",
                on,
                "GB/s",
                off,
                ">= 0.95x",
                on / off >= 0.95,
            )
        )
    else:
        rows.append(Row("deposit", f"diag: {case}: journal on / off, median", on, "GB/s", off))
    rows.append(Row("deposit", f"diag: {case}: journal cost per key", per_key, "us/key"))


def bench_warm_start(rows: list[Row], nblocks: int, reps: int, quiet: bool) -> None:
    block = 4 * KIB
    region = common.randomized(block * 1000, seed=1)
    service = pool_service(block * max(nblocks, 1000) * 2)
    try:
        log(f"warm start: {nblocks} blocks", quiet)
        empty: list[float] = []
        for rep in range(reps):  # baseline first, while the journal is still empty
            t0 = time.perf_counter()
            inst = GuardInstance(service, f"warm0-{os.getpid()}-{rep}", block, region)
            empty.append(time.perf_counter() - t0)
            inst.close()
        inst = GuardInstance(service, f"fill-{os.getpid()}", block, region)
        inst.engine.fill(nblocks)
        inst.close()
        warm: list[float] = []
        for rep in range(reps):
            t0 = time.perf_counter()
            inst = GuardInstance(service, f"warm-{os.getpid()}-{rep}", block, region)
            warm.append(time.perf_counter() - t0)
            found = sum(
                1
                for status, _ in inst.kv.query([i.to_bytes(8, "big") for i in range(nblocks)])
                if status.name == "HIT"
            )
            inst.close()
            if found != nblocks:
                raise RuntimeError(f"warm start: {found} of {nblocks} blocks recovered")
    finally:
        service.stop()
    t_warm, t_empty = percentile(warm, 50), percentile(empty, 50)
    rows.append(
        Row("warm start", f"{nblocks} blocks: construct, median", t_warm * 1e3, "ms", t_empty * 1e3)
    )
    rows.append(
        Row(
            "warm start",
            f"{nblocks} blocks: per recovered block",
            (t_warm - t_empty) / nblocks * 1e6,
            "us/block",
        )
    )


def bench_takeover(rows: list[Row], nblocks: int, reps: int, quiet: bool) -> None:
    service = pool_service(4 * KIB * 20000, groups=2)
    kill_to_serving: list[float] = []
    claim_served: list[float] = []
    claim_idle: list[float] = []
    try:
        for rep in range(reps):
            log(f"takeover: {nblocks} blocks, rep {rep}", quiet)
            kill_to_serving.append(service.kill_a_holder(nblocks))
            t0 = time.perf_counter()
            hold = service.client.claim(
                0, [("", 4 * KIB)], service.digest, ("127.0.0.1", service.port)
            )
            claim_served.append(time.perf_counter() - t0)
            hold.release()
            t0 = time.perf_counter()
            other = service.client.claim(1, [("", 4 * KIB)], service.digest, ("127.0.0.1", 0))
            claim_idle.append(time.perf_counter() - t0)
            other.release()
        took = service.log_seconds("took_over")
        handed = service.log_seconds("handed_back")
    finally:
        service.stop()
    rows.append(
        Row(
            "takeover",
            f"{nblocks} blocks: holder exit -> serving (service), median",
            percentile(took, 50) * 1e3,
            "ms",
        )
    )
    rows.append(
        Row(
            "takeover",
            f"{nblocks} blocks: SIGKILL -> status says serving, median",
            percentile(kill_to_serving, 50) * 1e3,
            "ms",
        )
    )
    rows.append(
        Row(
            "handback",
            f"{nblocks} blocks: stop serving (service), median",
            percentile(handed, 50) * 1e3,
            "ms",
        )
    )
    rows.append(
        Row(
            "handback",
            f"{nblocks} blocks: claim of the served group, median",
            percentile(claim_served, 50) * 1e3,
            "ms",
            percentile(claim_idle, 50) * 1e3,
        )
    )


def bench_g3_serve(rows: list[Row], case: str, block: int, n: int, reps: int, quiet: bool) -> None:
    service = pool_service(block * n)
    g3_dir = tempfile.mkdtemp(prefix="kvcr-g3-serve-")
    expected = [zlib.crc32(b) for b in common.randomized(block * n, seed=block).reshape(n, -1)]
    name = f"g3-puller-{os.getpid()}-{block}"
    region = common.bench_pages(block * n, 0)
    channel = ZmqPeerControlChannel("127.0.0.1", free_port(), "127.0.0.1")
    kv = make_instance(
        name,
        block,
        region,
        common.bench_pages(2 * block, 0),  # unused: deliver writes the engine region
        null_bindings(framework_control=channel, key_adapter=IntKeys()),
        remote_fw_dram=RemoteFWDramOptions(eager_ctrl_connect=True),
    )
    engine = Engine(kv, name, 0.0005)
    blocks = {
        tier: {
            (first + i).to_bytes(8, "big"): [MemoryRef(end_point_name=name, element_index=i)]
            for i in range(n)
        }
        for tier, first in (("g3", 0), ("g2", n))
    }
    times: dict[str, list[float]] = {"g3": [], "g2": []}
    requests = itertools.count()
    try:
        log(f"g3 serve {case}: holder with G3, killed", quiet)
        service.kill_a_holder(2 * n, str(block), os.path.join(g3_dir, "g3.bin"))
        endpoint = f"tcp://127.0.0.1:{service.port}"
        for rep in range(2 * reps + 2):
            tier = ("g3", "g2")[rep % 2]
            request = f"{tier}-{next(requests)}"
            hashes = [int.from_bytes(k, "big") for k in blocks[tier]]
            kv.submit_hint(fetch_hint(endpoint, hashes, message_id=request), request_id=request)
            time.sleep(0.005)  # the runtime handles the hint's connect command first
            region[:] = 0
            deliver = functools.partial(kv.deliver, blocks[tier], request_id=request)
            elapsed, got = engine.timed(deliver, n)
            kv.discard_hint(request)
            failed = [k for k, v in got.items() if not v.success]
            if failed:
                raise RuntimeError(f"g3 serve {case}: {len(failed)} of {n} {tier} keys failed")
            crcs = [zlib.crc32(b) for b in region.reshape(n, -1)]
            if crcs != expected:
                raise RuntimeError(f"g3 serve {case}: {tier} blocks arrived with wrong bytes")
            if rep >= 2:  # a warm-up each (the first also sets up the link)
                times[tier].append(elapsed)
        served = service.client.status()[0]
        if served.served_g3_blocks != n * (reps + 1):
            raise RuntimeError(f"g3 serve {case}: status counts {served.served_g3_blocks}")
    finally:
        kv.close()
        channel.close()
        service.stop()
        shutil.rmtree(g3_dir, ignore_errors=True)
    g3, g2 = (block * n / percentile(times[t], 50) / 1e9 for t in ("g3", "g2"))
    rows.append(Row("g3 serve", f"{case}: guard G3 serve / G2 pull, median", g3, "GB/s", g2))


def measure(args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    quiet = args.json_only
    reps, rounds, warm_reps = (10, 2, 3) if args.quick else (100, 6, 7)
    rows: list[Row] = []
    bench_deposit(rows, "16 x 7 MiB", 7 * MIB, 16, max(reps // 4, 5), rounds, True, quiet)
    bench_deposit(rows, "256 x 64 KiB", 64 * KIB, 256, reps, rounds, True, quiet)
    bench_deposit(rows, "1024 x 4 KiB", 4 * KIB, 1024, reps, rounds, False, quiet)
    for n in (100, 1000, 10000):
        bench_warm_start(rows, n, warm_reps, quiet)
    for n in (100, 1000, 10000):
        bench_takeover(rows, n, max(warm_reps // 2, 2), quiet)
    g3_reps = 5 if args.quick else 20
    bench_g3_serve(rows, "64 x 1 MiB", MIB, 64, g3_reps, quiet)
    bench_g3_serve(rows, "256 x 64 KiB", 64 * KIB, 256, g3_reps, quiet)
    return rows, list(NOTES)


def main(argv: list[str] | None = None) -> int:
    return run_main(measure, argv, "kvcr crash-recovery benchmark", "fewer repetitions (~30 s)")


if __name__ == "__main__":
    sys.exit(main())
