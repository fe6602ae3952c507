"""Crash-recovery benchmark: what the recovery journal costs the deposit path, and how long a
worker takes to start warm from it, each beside a baseline measured in the same run.

    uv run python benchmarks/recovery.py            # full, ~1.5 min
    uv run python benchmarks/recovery.py --quick    # ~30 s
    uv run python benchmarks/recovery.py --json-only

Rows:

- ``deposit``: GB/s of deposits (engine poll, fresh keys, steady-state eviction) into a guard
  group's pools with the journal mirroring every commit and eviction, beside the same pools
  claimed without a journal (``KVCRClient.claim`` + ``local_dram``). Rounds alternate the two
  instances. Target: the journal costs at most 5 % (ratio >= 0.95).
- ``warm start``: constructing a KVCR over a group whose journal holds 100, 1,000 and 10,000
  committed blocks (replay, restoring the index, republishing inventory, a fresh snapshot),
  beside constructing it over an empty group; and the cost per recovered block.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
from common import Row, arguments, log, null_bindings, percentile, report
from local import Engine, all_success

from kvcr import KVCR, KVCRClient
from kvcr.config import KVCRBackendConfigs, KVCRConfig, KVCRGuardConfig
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.errors import KVCRSocketError
from kvcr.types import RegionDescriptor

KIB, MIB = common.KIB, common.MIB
DIGEST = "recovery-bench"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Service:
    """A kvcr-guard with one group of one pool, in /dev/shm."""

    def __init__(self, pool_bytes: int) -> None:
        self.dir = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="kvcr-rec-"))
        self.socket_path = str(self.dir / "g.sock")
        (self.dir / "pools").mkdir()
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "kvcr.kvcr_service", "--socket-path", self.socket_path),
                *("--pool-dir", str(self.dir / "pools"), "--guard-count", "1"),
                *("--pool-sizes-gb", f"{pool_bytes / 2**30!r}", "--compatibility-digest", DIGEST),
                *("--log-level", "WARNING"),
            ]
        )
        self.client = KVCRClient(self.socket_path)
        self.port = free_port()
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client.status()
                return
            except KVCRSocketError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("kvcr-guard did not start") from None
                time.sleep(0.01)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        shutil.rmtree(self.dir, ignore_errors=True)


class Instance:
    """A KVCR over the service's group: with the journal (guard_config) or without it (the
    same pools, claimed by hand and passed as local_dram)."""

    def __init__(self, service: Service, name: str, block: int, region: Any, journal: bool):
        self.channel = ZmqPeerControlChannel("127.0.0.1", service.port, "127.0.0.1")
        config = KVCRConfig(
            name, [("", block)], operation_timeout_ms=20_000, abandon_timeout_ms=40_000
        )
        regions = [
            RegionDescriptor(addr=region.ctypes.data, size=block, count=region.nbytes // block)
        ]
        bindings = null_bindings(framework_control=self.channel)
        self.hold = None
        if journal:
            guard = KVCRGuardConfig(service.socket_path, 0, DIGEST)
            self.kv = KVCR(config, bindings, KVCRBackendConfigs(framework_regions=regions), guard)
        else:
            self.hold = service.client.claim(0, [("", block)], DIGEST, ("127.0.0.1", service.port))
            self.hold.hand_listener_to(self.channel.adopt_listener)
            backends = KVCRBackendConfigs(
                framework_regions=regions, local_dram=self.hold.local_dram
            )
            self.kv = KVCR(config, bindings, backends)
        self.engine = Engine(self.kv, name)

    def close(self) -> None:
        self.kv.close()
        self.channel.close()
        if self.hold is not None:
            self.hold.release()


def bench_deposit(
    rows: list[Row], case: str, block: int, nkeys: int, reps: int, rounds: int, quiet: bool
) -> None:
    region = common.randomized(block * nkeys, seed=nkeys)
    pool_bytes = block * nkeys * 4  # steady state: every deposit evicts after the first four
    service = Service(pool_bytes)
    times: dict[bool, list[float]] = {True: [], False: []}
    serial = iter(range(1 << 40))
    try:
        for rnd in range(rounds):
            for journal in (rnd % 2 == 0, rnd % 2 == 1):
                log(f"deposit {case} round {rnd} journal={'on' if journal else 'off'}", quiet)
                inst = Instance(
                    service, f"rec-{os.getpid()}-{rnd}-{journal}", block, region, journal
                )
                try:
                    for rep in range(reps + 2):
                        keys = [next(serial).to_bytes(8, "big") for _ in range(nkeys)]
                        blocks = {k: inst.engine.ref(i) for i, k in enumerate(keys)}
                        kv = inst.kv
                        elapsed, got = inst.engine.timed(
                            lambda b=blocks, kv=kv: kv.deposit(b), nkeys
                        )
                        all_success(f"deposit {case}", got, nkeys)
                        if rep >= 2:  # two warm-ups per instance
                            times[journal].append(elapsed)
                finally:
                    inst.close()
    finally:
        service.stop()
    nbytes = block * nkeys
    on, off = (nbytes / percentile(times[j], 50) / 1e9 for j in (True, False))
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


def bench_warm_start(rows: list[Row], nblocks: int, reps: int, quiet: bool) -> None:
    block = 4 * KIB
    region = common.randomized(block * 1000, seed=1)
    service = Service(block * max(nblocks, 1000) * 2)
    try:
        log(f"warm start: {nblocks} blocks", quiet)
        empty: list[float] = []
        for rep in range(reps):  # baseline first, while the journal is still empty
            t0 = time.perf_counter()
            inst = Instance(service, f"warm0-{os.getpid()}-{rep}", block, region, True)
            empty.append(time.perf_counter() - t0)
            inst.close()
        inst = Instance(service, f"fill-{os.getpid()}", block, region, True)
        for first in range(0, nblocks, 1000):
            count = min(1000, nblocks - first)
            keys = [(first + i).to_bytes(8, "big") for i in range(count)]
            handle = inst.kv.deposit({k: inst.engine.ref(i) for i, k in enumerate(keys)})
            all_success("fill", inst.engine.wait(handle, count), count)
        inst.close()
        warm: list[float] = []
        for rep in range(reps):
            t0 = time.perf_counter()
            inst = Instance(service, f"warm-{os.getpid()}-{rep}", block, region, True)
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


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__.split("\n\n")[0], "fewer repetitions (~30 s)", argv)
    quiet = args.json_only
    reps, rounds, warm_reps = (10, 2, 3) if args.quick else (40, 4, 7)
    started = time.monotonic()
    rows: list[Row] = []
    bench_deposit(rows, "256 x 64 KiB", 64 * KIB, 256, reps, rounds, quiet)
    bench_deposit(rows, "16 x 7 MiB", 7 * MIB, 16, max(reps // 4, 5), rounds, quiet)
    bench_deposit(rows, "1024 x 4 KiB", 4 * KIB, 1024, reps, rounds, quiet)
    for n in (100, 1000, 10000):
        bench_warm_start(rows, n, warm_reps, quiet)
    elapsed = time.monotonic() - started
    notes = [
        "deposit: the same guard pools either way; only the journal differs",
        "warm start baseline: the same construction over an empty journal",
        "takeover (the Guard serving a dead worker's blocks) is not built yet",
    ]
    report(rows, notes, "kvcr crash-recovery benchmark", args, elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
