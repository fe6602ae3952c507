"""The guard service's own death: three workers pull from each other while the service is
SIGKILLed and started again with the same flags. No worker crashes and no wrong byte
arrives; each worker notices (``guard_lost``), reports recovery as disabled and stops
journaling; the restarted service adopts the groups detached, each worker re-attaches on its
own, and its recovery is on again: a worker killed afterwards has its blocks served by the
new service. A restart with another digest refuses the re-attach and says why.

Everything is real: ``python -m kvcr.kvcr_service``, ``worker_proc.py`` children with real
NIXL and ZMQ, real SIGKILL. Block content is derived from the key (``soak.expected``).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from procs import GuardProcess, SourceWorker, free_port, wait_until
from soak import BLOCK, expected

pytestmark = pytest.mark.integration

SIZES = (BLOCK, 16, 64)  # block bytes, (unused) own pool blocks, engine region blocks
KEYS = 8  # per worker
GUARD_FLAGS = ("--idle-timeout-s", "0.5", "--heartbeat-timeout-ms", "2000")


def start_guard(directory: Path, digest: str = "digest-restart") -> GuardProcess:
    return GuardProcess(
        directory, guard_count=3, pool_sizes_gb="0.03125", digest=digest, extra=GUARD_FLAGS
    )


class Load:
    """Each worker pulls the next worker's blocks through a router hint, over and over, in a
    thread of its own; every block that arrives is checked against its key."""

    def __init__(self, workers: list[SourceWorker], keys: list[list[int]]) -> None:
        self.workers, self.keys = workers, keys
        # One command at a time per worker: the test asks them for gauges meanwhile.
        self.locks = {id(worker): threading.Lock() for worker in workers}
        self.stop = threading.Event()
        self.pulled = [0] * len(workers)
        self.failed: list[str] = []
        self.threads = [
            threading.Thread(target=self._pull, args=(i,), daemon=True) for i in range(len(workers))
        ]
        for thread in self.threads:
            thread.start()

    def _pull(self, i: int) -> None:
        source = (i + 1) % len(self.workers)
        worker, keys = self.workers[i], self.keys[source]
        try:
            while not self.stop.is_set():
                result = self.call(worker, "soak_deliver", keys, self.workers[source].endpoint)
                for k, (status, checksum) in result["entries"].items():
                    if status == "SUCCESS":
                        if checksum != expected(k):
                            self.failed.append(f"worker {i}: key {k} arrived wrong")
                        self.pulled[i] += 1
        except Exception as exc:  # a worker that died or stopped answering
            self.failed.append(f"worker {i}: {exc!r}")

    def call(self, worker: SourceWorker, *command: object) -> Any:
        with self.locks[id(worker)]:
            return worker(*command)

    def gauges(self, worker: SourceWorker) -> dict[str, float]:
        return self.call(worker, "gauges")

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        assert not self.failed, self.failed


@pytest.fixture
def world(tmp_path) -> Iterator[tuple[GuardProcess, list[SourceWorker], list[list[int]]]]:
    guard = start_guard(tmp_path)
    logs = [tmp_path / f"worker{i}.log" for i in range(3)]
    workers = [
        SourceWorker(
            f"w{i}", SIZES, free_port(), guard=(guard.socket_path, i, guard.digest), log=logs[i]
        )
        for i in range(3)
    ]
    keys = [[1000 * (i + 1) + j for j in range(KEYS)] for i in range(3)]
    for worker, mine in zip(workers, keys):
        assert set(worker("soak_deposit", mine, False).values()) == {"SUCCESS"}
    try:
        yield guard, workers, keys
    finally:
        for worker in workers:
            worker.stop()


def test_a_service_killed_under_load_and_restarted_loses_nothing(world) -> None:
    first, workers, keys = world
    directory = first.directory
    load = Load(workers, keys)
    try:
        wait_until(lambda: min(load.pulled) >= 2 * KEYS, what="load under way")
        first.stop(signal.SIGKILL)
        for worker in workers:  # each notices, goes on, and stops journaling
            wait_until(lambda w=worker: load.gauges(w)["guard_attached"] == 0.0, what="lost")
            assert load.gauges(worker)["recovery_disabled"] == 1.0
        during = list(load.pulled)
        wait_until(lambda: all(n > d + KEYS for n, d in zip(load.pulled, during)), what="pulls")

        second = start_guard(directory)
        wait_until(
            lambda: second.states() == [("held", w.proc.pid) for w in workers],
            30,
            "every worker re-attached",
        )
        for worker in workers:
            wait_until(lambda w=worker: load.gauges(w)["recovery_disabled"] == 0.0, what="on")
            assert load.gauges(worker)["guard_attached"] == 1.0
        after = list(load.pulled)
        wait_until(lambda: all(n > a + KEYS for n, a in zip(load.pulled, after)), what="pulls")
    finally:
        load.finish()
    assert all(worker.proc.poll() is None for worker in workers)  # nobody crashed
    for i in range(len(workers)):
        log = (directory / f"worker{i}.log").read_text()
        assert log.count("guard_lost") == 1 and "guard_reattached" in log
    log = second.log()
    assert log.count("group_detached") == 3 and log.count("reattached") >= 3

    # Recovery is really on again: the new service takes a killed worker's group over and
    # serves what it had committed (the snapshot written at the re-attach, and what came
    # after it).
    fresh = [9000 + j for j in range(KEYS)]
    assert set(workers[0]("soak_deposit", fresh, False).values()) == {"SUCCESS"}
    workers[0].kill()
    wait_until(lambda: second.states()[0] == ("serving", None), what="takeover by the new service")
    result = workers[1]("soak_deliver", keys[0] + fresh, workers[0].endpoint)
    arrived = {k: c for k, (s, c) in result["entries"].items() if s == "SUCCESS"}
    assert set(arrived) == set(keys[0] + fresh)
    assert all(c == expected(k) for k, c in arrived.items())
    for worker in workers[1:]:
        worker.stop()
    assert second.stop() == 0, second.log()
    assert not [p for p in (directory / "pools").iterdir() if p.suffix == ".pool"]


def test_a_restart_with_another_digest_refuses_the_reattach_and_says_why(world) -> None:
    running, workers, _ = world
    directory = running.directory
    running.stop(signal.SIGKILL)
    wrong = start_guard(directory, digest="another-digest")
    try:
        log = directory / "worker0.log"
        wait_until(lambda: "reattach_refused" in log.read_text(), 15, "refused re-attach")
        text = log.read_text()
        assert "digest_mismatch" in text and "'digest-restart' does not match" in text
        assert wrong.states() == [("detached", None)] * 3
        assert all(worker.proc.poll() is None for worker in workers)
    finally:
        assert wrong.stop() == 0
    # The right service again: the workers re-attach (they kept trying).
    right = start_guard(directory)
    try:
        wait_until(
            lambda: right.states() == [("held", w.proc.pid) for w in workers],
            30,
            "re-attached to the right service",
        )
    finally:
        for worker in workers:
            worker.stop()
        assert right.stop() == 0
