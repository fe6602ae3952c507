"""Crash trials: a worker over guard group 0 is SIGKILLed at a random point (idle, during a
deposit, while it writes to a peer). Then the guard serves its committed blocks on the same
endpoint, byte-exact and nothing else, and a replacement worker claims the group, sees the
same blocks as HIT and serves them. State carries over from trial to trial.

The kill points are drawn from a seeded generator: every run replays the same 20 trials.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from guard_world import BLOCK, GuardedWorker
from peer_world import key
from procs import GuardProcess, SourceWorker, free_port, wait_until

pytestmark = pytest.mark.integration

# Ten trials cover the three kill points; ``nox -s crash-cold`` runs twenty.
TRIALS = int(os.environ.get("KVCR_CRASH_TRIALS", "10"))
SIZES = (BLOCK, 16, 32)  # block bytes, (unused) own pool blocks, engine region blocks
PER_TRIAL = 12


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Iterator[tuple[GuardProcess, GuardedWorker, int]]:
    # 32 MiB groups: 512 blocks, more than all trials deposit, so nothing is evicted and
    # "every committed block" is exact.
    guard = GuardProcess(tmp_path_factory.mktemp("crash"), pool_sizes_gb="0.03125")
    peer = GuardedWorker(guard, 1)
    port = free_port()
    # Warm up: the first takeover starts the service's NIXL agent, which keeps a few fds.
    first = SourceWorker("warm-up", SIZES, port, guard=(guard.socket_path, 0, guard.digest))
    first.kill()
    wait_until(lambda: guard.states()[0] == ("serving", None), what="first takeover")
    SourceWorker("warm-up-2", SIZES, port, guard=(guard.socket_path, 0, guard.digest)).stop()
    fds = len(os.listdir(f"/proc/{guard.proc.pid}/fd"))
    try:
        yield guard, peer, port
        peer.close()
        assert guard.states() == [("idle", None), ("idle", None)]
        assert len(os.listdir(f"/proc/{guard.proc.pid}/fd")) <= fds + 2  # no fd leak per trial
    finally:
        code = guard.stop()
    assert code == 0, guard.log()
    assert list(guard.pool_dir.iterdir()) == []


class Ledger:
    """What the test knows: checksums of blocks committed for sure, and of blocks whose
    deposit may or may not have committed when the worker died."""

    def __init__(self) -> None:
        self.committed: dict[int, list[int]] = {}
        self.maybe: dict[int, list[int]] = {}


LEDGER = Ledger()
WORKERS: list[SourceWorker] = []


def kill_somewhere(
    rng: random.Random, worker: SourceWorker, peer: GuardedWorker, trial: int
) -> str:
    """Deposit this trial's blocks, then SIGKILL the worker at a random point."""
    base = 1000 * (trial + 1)
    first = [(base + i, i, rng.randrange(1 << 30)) for i in range(PER_TRIAL // 2)]
    sums = worker("deposit", first)
    assert {status for status, _ in sums.values()} == {"SUCCESS"}
    LEDGER.committed.update({k: checksum for k, (_, checksum) in sums.items()})
    point = rng.choice(["idle", "deposit", "peer-transfer"])
    if point == "deposit":
        second = [(base + 100 + i, 16 + i, rng.randrange(1 << 30)) for i in range(PER_TRIAL // 2)]
        LEDGER.maybe.update(worker("deposit_nowait", second))
        time.sleep(rng.uniform(0, 0.004))
    elif point == "peer-transfer":
        handle = peer.start_pull(
            worker, [(k, 16 + i) for i, (k, _, _) in enumerate(first)], f"t{trial}"
        )
        time.sleep(rng.uniform(0, 0.004))
        worker.kill()
        # The pull ends (written, refused by the guard's new incarnation, or failed): its
        # memory is never left held.
        peer.engine.wait(peer.kv, handle, len(first), timeout=15)
        return point
    worker.kill()
    return point


def served_by(
    peer: GuardedWorker, source: SourceWorker, keys: list[int], request: str
) -> dict[int, list[int]]:
    """Pull ``keys`` from ``source`` into the peer (elements 0..): the checksums of the keys
    that arrived."""
    got: dict[int, list[int]] = {}
    for start in range(0, len(keys), 32):  # the peer's region has 64 elements
        chunk = keys[start : start + 32]
        result = peer.pull(source, [(k, i) for i, k in enumerate(chunk)], f"{request}-{start}")
        for i, k in enumerate(chunk):
            if result[key(k)] == "SUCCESS":
                got[k] = peer.engine.checksum(i)
    return got


def check_served(got: dict[int, list[int]]) -> None:
    for k, checksum in LEDGER.committed.items():
        assert got.get(k) == checksum, f"committed block {k} missing or wrong"
    for k, checksum in got.items():
        if k not in LEDGER.committed:
            assert LEDGER.maybe.get(k) == checksum, f"block {k} was never committed as served"


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_sigkilled_worker_loses_no_committed_block(world, trial) -> None:
    guard, peer, port = world
    rng = random.Random(7919 * trial)
    worker = SourceWorker(f"victim{trial}", SIZES, port, guard=(guard.socket_path, 0, guard.digest))
    WORKERS.append(worker)
    point = kill_somewhere(rng, worker, peer, trial)
    wait_until(lambda: guard.states()[0] == ("serving", None), what=f"takeover after {point}")

    keys = sorted({*LEDGER.committed, *LEDGER.maybe})
    got = served_by(peer, worker, keys, f"served{trial}")
    check_served(got)
    # What may have committed either did, for good, or did not: the heir agrees with the guard.
    LEDGER.committed.update({k: v for k, v in got.items()})
    LEDGER.maybe.clear()

    heir = SourceWorker(f"heir{trial}", SIZES, port, guard=(guard.socket_path, 0, guard.digest))
    WORKERS.append(heir)
    try:
        assert guard.states()[0] == ("held", heir.proc.pid)
        statuses = heir("query", keys)
        assert {k for k, s in zip(keys, statuses) if s == "HIT"} == set(LEDGER.committed)
        sample = rng.sample(sorted(LEDGER.committed), 4)
        assert served_by(peer, heir, sample, f"heir{trial}") == {
            k: LEDGER.committed[k] for k in sample
        }
    finally:
        heir.stop()
    assert guard.states()[0] == ("idle", None)


def test_no_worker_process_is_left_behind(world) -> None:
    assert len(WORKERS) == 2 * TRIALS
    assert all(w.proc.poll() is not None for w in WORKERS)
    assert os.path.exists(world[0].socket_path)
    assert len(list(Path(world[0].pool_dir).iterdir())) == 2
