"""The guard serves the G3 blocks of a group whose holder died (real processes, real NIXL:
UCX between processes, POSIX for the files).

A worker over group 0 with a G3 tier fills its pool, so half its blocks spill to the files;
it is SIGKILLed. The service then serves every committed block, G2 and G3, byte-exact on the
group's endpoint, counts the G3 ones in ``kvcr-guard status`` and the metrics, and hands the
files back with the group: the heir opens them (their locks are free again) and serves the
same blocks. A G3 file deleted, truncated, replaced or zeroed while the service serves it
turns its blocks into misses, never into wrong bytes.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_guard_metrics import group_value, metrics_url, scrape

from damage import KINDS
from damage import damage as damage_file
from guard_world import BLOCK, GuardedWorker
from kvcr.guard.cli import group_record, status_table
from peer_world import key
from procs import GuardProcess, SourceWorker, free_port, wait_until

pytestmark = pytest.mark.integration

POOL = 4  # blocks in the group's pool: the second deposit of four spills the first to G3
SLOTS_PER_FILE = 8
SIZES = (BLOCK, POOL, 32)  # block bytes, (guard's) pool blocks, engine region blocks


class World:
    def __init__(self, directory: Path) -> None:
        self.guard = GuardProcess(
            directory,
            pool_sizes_gb=str(POOL * BLOCK / 2**30),
            extra=("--idle-timeout-s", "0.5", "--metrics-port", "0"),
        )
        self.files = (directory / "d0" / "g3.bin", directory / "d1" / "g3.bin")
        self.env = {
            "KVCR_TEST_G3": json.dumps(
                {
                    "paths": [str(p) for p in self.files],
                    "capacity_bytes_per_file": SLOTS_PER_FILE * BLOCK,
                }
            )
        }
        self.port = free_port()
        self.peer = GuardedWorker(self.guard, 1)  # a worker over group 1 pulls
        self.workers: list[SourceWorker] = []

    def worker(self, name: str) -> SourceWorker:
        guard = (self.guard.socket_path, 0, self.guard.digest)
        worker = SourceWorker(name, SIZES, self.port, guard=guard, env=self.env)
        self.workers.append(worker)
        return worker

    def close(self) -> None:
        for worker in self.workers:
            worker.kill() if worker.proc.poll() is None else None
        self.peer.close()
        code = self.guard.stop()
        assert code == 0, self.guard.log()


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    try:
        yield w
    finally:
        w.close()


def spill_and_die(
    world: World, before_death: Callable[[], None] = lambda: None
) -> tuple[SourceWorker, dict[int, list[int]]]:
    """A holder deposits 8 blocks into its 4-block pool (0-3 spill to G3) and is killed
    (``before_death`` runs just before); returns it and the checksums of its blocks once
    the service serves the group."""
    holder = world.worker("holder")
    sums: dict[int, list[int]] = {}
    for batch in (range(4), range(4, 8)):
        result = holder("deposit", [(k, k, 500 + k) for k in batch])
        assert {status for status, _ in result.values()} == {"SUCCESS"}
        sums.update({k: checksum for k, (_, checksum) in result.items()})
    assert holder("query", list(range(8))) == ["FETCHABLE"] * 4 + ["HIT"] * 4
    before_death()
    holder.kill()
    wait_until(lambda: world.guard.states()[0] == ("serving", None), what="takeover")
    return holder, sums


def pulled(world: World, source: SourceWorker, request: str) -> dict[int, list[int] | None]:
    """Pull keys 0-7 from ``source`` into the peer's elements 0-7: each key's checksum, or
    None for a miss."""
    result = world.peer.pull(source, [(k, k) for k in range(8)], request)
    return {
        k: world.peer.engine.checksum(k) if result[key(k)] == "SUCCESS" else None for k in range(8)
    }


def test_a_dead_holders_g3_blocks_come_byte_exact_from_the_guard_then_from_the_heir(
    world: World,
) -> None:
    holder, sums = spill_and_die(world)

    assert pulled(world, holder, "from-guard") == sums  # G2 and G3 blocks, byte-exact
    (group,) = [g for g in world.guard.client.status() if g.index == 0]
    assert (group.served_blocks, group.served_g3_blocks) == (8, 4)
    assert group_record(group)["served_g3_blocks"] == 4
    assert "8 (G3 4)" in status_table([group])
    samples = scrape(metrics_url(world.guard))
    assert group_value(samples, "kvcr_guard_served_blocks_total", 0) == 8
    assert group_value(samples, "kvcr_guard_served_g3_blocks_total", 0) == 4

    heir = world.worker("heir")  # the files' locks are free: the service closed them
    assert world.guard.states()[0] == ("held", heir.proc.pid)
    assert heir("query", list(range(8))) == ["FETCHABLE"] * 4 + ["HIT"] * 4
    assert pulled(world, heir, "from-heir") == sums
    heir.stop()

    log = world.guard.log()
    assert "g3_recovered" in log and "handed_back" in log
    assert "group_unusable" not in log and "takeover_failed" not in log
    (group,) = [g for g in world.guard.client.status() if g.index == 0]
    assert (group.served_blocks, group.served_g3_blocks) == (8, 4)  # counted at hand back


@pytest.mark.parametrize("how", KINDS)
def test_a_g3_file_damaged_while_the_guard_serves_it_gives_misses_never_wrong_bytes(
    world: World, how: str
) -> None:
    holder, sums = spill_and_die(world)
    damage_file(world.files[0], how)  # G3 slots are striped: two of the four blocks

    got = pulled(world, holder, f"damaged-{how}")

    for k, checksum in got.items():
        assert checksum is None or checksum == sums[k], f"block {k}: wrong bytes"
    assert all(got[k] == sums[k] for k in range(4, 8))  # G2 blocks are not touched
    missed = [k for k in range(4) if got[k] is None]
    assert len(missed) == 2, got  # those of the damaged file, and only those
    assert "g3_record_invalid" in world.guard.log()
    (group,) = [g for g in world.guard.client.status() if g.index == 0]
    assert (group.served_blocks, group.served_g3_blocks) == (6, 2)

    if how == "truncate":
        return  # a file of the wrong size is refused at open, naming it (files.py): no heir
    # The service forgot them for good: the heir does not look for them either.
    heir = world.worker("heir")
    statuses = heir("query", list(range(4)))
    assert [k for k in range(4) if statuses[k] == "FETCHABLE"] == [
        k for k in range(4) if k not in missed
    ]
    heir.stop()


def test_g3_files_the_guard_cannot_open_leave_it_serving_g2_alone(world: World) -> None:
    """Another process takes a file's lock as the holder dies: the service serves the G2
    blocks, says why not the G3 ones, and leaves the files and their records to the heir."""
    fds: list[int] = []
    locked = threading.Event()

    def lock_when_free() -> None:  # blocks until the holder's exit drops its lock
        fcntl.flock(fds[0], fcntl.LOCK_EX)
        locked.set()

    def take_the_lock_at_death() -> None:
        fds.append(os.open(world.files[0], os.O_RDWR))
        taker.start()

    taker = threading.Thread(target=lock_when_free)
    try:
        holder, sums = spill_and_die(world, take_the_lock_at_death)
        assert locked.wait(10)

        got = pulled(world, holder, "g2-alone")
        assert got == {k: None if k < 4 else sums[k] for k in range(8)}
        assert "g3_not_served" in world.guard.log()
    finally:
        taker.join(10)
        for fd in fds:
            os.close(fd)  # drops the lock

    heir = world.worker("heir")
    assert heir("query", list(range(8))) == ["FETCHABLE"] * 4 + ["HIT"] * 4
    assert pulled(world, heir, "from-heir") == sums
    heir.stop()
