"""Guard service benchmark: group creation per GiB, claim-and-map and release latency, and
KVCR start-up over guard pools, each beside a raw baseline measured in the same run.

    uv run python benchmarks/guard.py            # full, ~1 min
    uv run python benchmarks/guard.py --quick    # ~20 s
    uv run python benchmarks/guard.py --json-only

Rows:

- ``create``: seconds per GiB to create a group file (exclusive open, 0600, the free-space
  check, ``posix_fallocate``, shared lock), in ``/dev/shm`` and on the disk of ``$TMPDIR``;
  baseline: a bare ``open`` + ``posix_fallocate`` of the same size in the same directory.
- ``start``: the whole service, from ``exec`` until it answers ``status`` (interpreter and
  imports included), for 1 and 4 GiB groups in ``/dev/shm``.
- ``claim``: ``KVCRClient.claim`` (pidfd, one request on its own connection, two
  descriptors back, a shared lock, the mapping) and ``KVCRPoolHold.release`` (unmap, one
  request); baseline: a ``status`` request on the same service (the round trip with no work)
  plus a bare ``mmap`` + ``munmap`` of the group file.
- ``kvcr``: constructing and closing a KVCR whose pools come from the service (claim, NIXL
  registration, runtime start), beside the same KVCR over private pools of the same size.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import common
from common import (
    GuardService,
    Row,
    free_port,
    log,
    null_bindings,
    percentile,
    run_main,
)

from kvcr import KVCR
from kvcr.config import KVCRBackendConfigs, KVCRConfig, KVCRGuardConfig, LocalDramOptions
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.guard.pools import GIB, create_group_file, plan_group

BLOCK = 64 * 1024
DIGEST = "bench"
NOTES = (  # the closing notes: what the baselines are
    "create: the journal (100 MiB) is part of every group, so small groups pay it",
    "claim baseline: a status round trip on the same service plus a bare mmap/munmap",
)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_create(rows: list[Row], directory: Path, where: str, gib: float, reps: int) -> None:
    size = int(gib * GIB)
    layout = plan_group([size])
    kvcr_s, raw_s = [], []
    for rep in range(reps):
        group = None

        def make(rep: int = rep) -> None:
            nonlocal group
            group = create_group_file(directory, rep, layout)

        kvcr_s.append(timed(make))
        group.close(unlink=True)
        path = directory / f"raw-{rep}"

        def raw(path: Path = path) -> None:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, layout.total_size)
            finally:
                os.close(fd)

        raw_s.append(timed(raw))
        path.unlink()
    total_gib = layout.total_size / GIB
    rows.append(
        Row(
            "create",
            f"{where}, {gib:g} GiB pool (+100 MiB journal), s per GiB",
            percentile(kvcr_s, 50) / total_gib,
            "s/GiB",
            percentile(raw_s, 50) / total_gib,
        )
    )


def bench_start(rows: list[Row], gib: float, reps: int) -> None:
    times = []
    for _ in range(reps):
        service = GuardService(f"{gib:g}", DIGEST)
        times.append(service.start_s)
        service.stop()
    rows.append(
        Row(
            "start",
            f"service exec -> status answers, {gib:g} GiB group",
            percentile(times, 50) * 1e3,
            "ms",
        )
    )


def bench_claim(rows: list[Row], reps: int) -> None:
    service = GuardService("1", DIGEST)
    try:
        claim_s, release_s, status_s, mmap_s = [], [], [], []
        path = next((service.dir / "pools").iterdir())
        for _ in range(reps):
            hold = None

            def claim() -> None:
                nonlocal hold
                hold = service.client.claim(0, [("", BLOCK)], DIGEST, ("127.0.0.1", 0))

            claim_s.append(timed(claim))
            release_s.append(timed(hold.release))
            status_s.append(timed(service.client.status))

            def raw_map() -> None:
                fd = os.open(path, os.O_RDWR)
                try:
                    m = mmap.mmap(fd, os.fstat(fd).st_size)
                finally:
                    os.close(fd)
                m.close()

            mmap_s.append(timed(raw_map))
        base = [s + m for s, m in zip(status_s, mmap_s)]
        for q, name in ((50, "median"), (99, "p99")):
            for case, mine, theirs in (
                (f"claim and map, {name}", claim_s, base),
                (f"release (unmap + ack), {name}", release_s, status_s),
            ):
                us, base_us = percentile(mine, q) * 1e6, percentile(theirs, q) * 1e6
                rows.append(Row("claim", case, us, "us", base_us))
    finally:
        service.stop()


def bench_kvcr(rows: list[Row], reps: int) -> None:
    size = 256 << 20  # 4,096 blocks of 64 KiB
    config = KVCRConfig(nixl_agent_name=f"guard-bench-{os.getpid()}", pool_layouts=[("", BLOCK)])
    service = GuardService("0.25", DIGEST)
    private = common.touched(size)
    try:
        guarded_s, plain_s = [], []
        group_port = service.port  # the group's endpoint: every claim must name it
        for _ in range(reps):
            channel = ZmqPeerControlChannel("127.0.0.1", group_port, "127.0.0.1")
            bindings = null_bindings(framework_control=channel)

            def guarded(bindings=bindings) -> None:
                KVCR(
                    config,
                    bindings,
                    KVCRBackendConfigs(),
                    KVCRGuardConfig(service.socket_path, 0, DIGEST),
                ).close()

            guarded_s.append(timed(guarded))
            channel.close()
            channel = ZmqPeerControlChannel("127.0.0.1", free_port(), "127.0.0.1")
            local = LocalDramOptions(pools=[("", private.ctypes.data, size)])

            def plain(channel=channel, local=local) -> None:
                KVCR(
                    config,
                    null_bindings(framework_control=channel),
                    KVCRBackendConfigs(local_dram=local),
                ).close()

            plain_s.append(timed(plain))
            channel.close()
        rows.append(
            Row(
                "kvcr",
                "construct + close over a 256 MiB guard group, median",
                percentile(guarded_s, 50) * 1e3,
                "ms",
                percentile(plain_s, 50) * 1e3,
            )
        )
    finally:
        service.stop()


def measure(args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    quiet = args.json_only
    reps_create, reps_start, reps_claim, reps_kvcr = (
        (3, 2, 100, 3) if args.quick else (5, 5, 1000, 10)
    )
    rows: list[Row] = []
    disk = Path(tempfile.mkdtemp(prefix="kvcr-guard-bench-"))
    try:
        for gib in (1.0, 4.0):
            log(f"create {gib:g} GiB", quiet)
            with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
                bench_create(rows, Path(shm), "/dev/shm", gib, reps_create)
            bench_create(rows, disk, f"disk ({disk.parent})", gib, reps_create)
        for gib in (1.0, 4.0):
            log(f"start {gib:g} GiB", quiet)
            bench_start(rows, gib, reps_start)
        log("claim", quiet)
        bench_claim(rows, reps_claim)
        log("kvcr", quiet)
        bench_kvcr(rows, reps_kvcr)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    return rows, list(NOTES)


def main(argv: list[str] | None = None) -> int:
    return run_main(measure, argv, "kvcr guard service benchmark", "fewer repetitions (~20 s)")


if __name__ == "__main__":
    sys.exit(main())
