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
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common
from common import Row, arguments, log, null_bindings, percentile, repeated, report
from local import Engine, all_success

from kvcr.config import KVCRBackendConfigs, KVCRConfig, KVCRGuardConfig
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.testing import open_kvcr
from kvcr.types import RegionDescriptor

KIB, MIB = common.KIB, common.MIB
DIGEST = "recovery-bench"


def guard_service(pool_bytes: int, groups: int = 1) -> common.GuardService:
    """A kvcr-guard with ``groups`` groups of one pool of ``pool_bytes``."""
    return common.GuardService(f"{pool_bytes / 2**30!r}", DIGEST, groups, prefix="kvcr-rec-")


class Instance:
    """A KVCR over group 0 of the service (guard_config: pools, endpoint and journal)."""

    def __init__(self, service: common.GuardService, name: str, block: int, region: Any) -> None:
        self.channel = ZmqPeerControlChannel("127.0.0.1", service.port, "127.0.0.1")
        config = KVCRConfig(
            name, [("", block)], operation_timeout_ms=20_000, abandon_timeout_ms=40_000
        )
        regions = [
            RegionDescriptor(addr=region.ctypes.data, size=block, count=region.nbytes // block)
        ]
        opened = open_kvcr(
            config,
            null_bindings(framework_control=self.channel),
            KVCRBackendConfigs(framework_regions=regions),
            KVCRGuardConfig(service.socket_path, 0, DIGEST),
        )
        self.kv, self.runtime = opened.kv, opened.runtime
        self.engine = Engine(self.kv, name)

    def close(self) -> None:
        self.kv.close()
        self.channel.close()


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
    service = guard_service(pool_bytes)
    times: dict[bool, list[float]] = {True: [], False: []}
    serial = iter(range(1 << 40))
    try:
        inst = Instance(service, f"rec-{os.getpid()}-{nkeys}", block, region)
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
                    kv = inst.kv
                    elapsed, got = inst.engine.timed(lambda b=blocks, kv=kv: kv.deposit(b), nkeys)
                    all_success(f"deposit {case}", got, nkeys)
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
    service = guard_service(block * max(nblocks, 1000) * 2)
    try:
        log(f"warm start: {nblocks} blocks", quiet)
        empty: list[float] = []
        for rep in range(reps):  # baseline first, while the journal is still empty
            t0 = time.perf_counter()
            inst = Instance(service, f"warm0-{os.getpid()}-{rep}", block, region)
            empty.append(time.perf_counter() - t0)
            inst.close()
        inst = Instance(service, f"fill-{os.getpid()}", block, region)
        for first in range(0, nblocks, 1000):
            count = min(1000, nblocks - first)
            keys = [(first + i).to_bytes(8, "big") for i in range(count)]
            handle = inst.kv.deposit({k: inst.engine.ref(i) for i, k in enumerate(keys)})
            all_success("fill", inst.engine.wait(handle, count), count)
        inst.close()
        warm: list[float] = []
        for rep in range(reps):
            t0 = time.perf_counter()
            inst = Instance(service, f"warm-{os.getpid()}-{rep}", block, region)
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


HOLDER = Path(__file__).resolve().parent / "recovery_holder.py"


def kill_a_holder(service: common.GuardService, nblocks: int) -> float:
    """Start a holder of ``nblocks`` blocks over group 0 (``recovery_holder.py``), SIGKILL
    it once it is ready: the seconds until ``status`` says the group is served."""
    holder = subprocess.Popen(
        [sys.executable, str(HOLDER), service.socket_path, str(service.port), str(nblocks), DIGEST],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    if holder.stdout.readline().strip() != "ready":
        raise RuntimeError("the holder did not start")
    t0 = time.perf_counter()
    holder.kill()
    while service.state(0) != "serving":
        time.sleep(0.0005)
    elapsed = time.perf_counter() - t0
    holder.wait()
    return elapsed


def bench_takeover(rows: list[Row], nblocks: int, reps: int, quiet: bool) -> None:
    service = guard_service(4 * KIB * 20000, groups=2)
    kill_to_serving: list[float] = []
    claim_served: list[float] = []
    claim_idle: list[float] = []
    try:
        for rep in range(reps):
            log(f"takeover: {nblocks} blocks, rep {rep}", quiet)
            kill_to_serving.append(kill_a_holder(service, nblocks))
            t0 = time.perf_counter()
            hold = service.client.claim(0, [("", 4 * KIB)], DIGEST, ("127.0.0.1", service.port))
            claim_served.append(time.perf_counter() - t0)
            hold.release()
            t0 = time.perf_counter()
            other = service.client.claim(1, [("", 4 * KIB)], DIGEST, ("127.0.0.1", 0))
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


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__.split("\n\n")[0], "fewer repetitions (~30 s)", argv)
    if args.runs > 1:
        return repeated(__file__, args, "kvcr recovery benchmark")
    quiet = args.json_only
    reps, rounds, warm_reps = (10, 2, 3) if args.quick else (100, 6, 7)
    started = time.monotonic()
    rows: list[Row] = []
    bench_deposit(rows, "16 x 7 MiB", 7 * MIB, 16, max(reps // 4, 5), rounds, True, quiet)
    bench_deposit(rows, "256 x 64 KiB", 64 * KIB, 256, reps, rounds, True, quiet)
    bench_deposit(rows, "1024 x 4 KiB", 4 * KIB, 1024, reps, rounds, False, quiet)
    for n in (100, 1000, 10000):
        bench_warm_start(rows, n, warm_reps, quiet)
    for n in (100, 1000, 10000):
        bench_takeover(rows, n, max(warm_reps // 2, 2), quiet)
    elapsed = time.monotonic() - started
    notes = [
        "deposit: one instance, its index's journal attached or detached by rounds",
        "warm start baseline: the same construction over an empty journal",
        "takeover: the first one in a service also starts its NIXL agent (excluded: median)",
        "handback baseline: claiming an idle group of the same service",
    ]
    report(rows, notes, "kvcr crash-recovery benchmark", args, elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
