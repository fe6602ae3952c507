"""KVCR workers over a guard service's pool groups: pools in the service's shared memory,
control endpoints bound by the service and adopted by the workers, blocks moving peer to
peer through those endpoints (real service, real NIXL, real ZMQ)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_guard_metrics import group_value, metrics_url, scrape

from guard_world import BLOCK, GuardedWorker
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.types import CacheTier, QueryStatus
from peer_world import key
from procs import GuardProcess, SourceWorker, free_port, wait_until

pytestmark = pytest.mark.integration

SIZES = (BLOCK, 16, 32)  # block bytes, (unused) own pool blocks, engine region blocks


class SendOnly:
    """A control channel that cannot adopt a shared listener."""

    def send(self, endpoint: str, message: bytes) -> bool:
        return False

    def recv(self) -> list[bytes]:
        return []


@pytest.fixture
def guard(tmp_path: Path) -> Iterator[GuardProcess]:
    service = GuardProcess(
        tmp_path,
        pool_sizes_gb="0.0078125",  # 8 MiB: 128 blocks
        extra=("--idle-timeout-s", "0.5", "--metrics-port", "0"),
    )
    yield service
    assert service.stop() == 0, service.log()


def test_two_workers_on_two_groups_move_blocks_through_the_group_endpoints(guard) -> None:
    port = free_port()
    source = SourceWorker("a", SIZES, port, guard=(guard.socket_path, 0, guard.digest))
    destination = GuardedWorker(guard, 1)
    try:
        groups = guard.client.status()
        assert [(g.state, g.holder_pid) for g in groups] == [
            ("held", source.proc.pid),
            ("held", os.getpid()),
        ]
        assert source.endpoint == f"tcp://127.0.0.1:{groups[0].control_port}"
        assert groups[0].control_port == port  # the service bound what the worker asked for

        sums = source("deposit", [(k, k, 500 + k) for k in range(6)])
        assert {status for status, _ in sums.values()} == {"SUCCESS"}
        result = destination.pull(source, [(k, 10 + k) for k in range(6)], "req-1")

        assert set(result.values()) == {"SUCCESS"}
        for k in range(6):
            assert destination.engine.checksum(10 + k) == sums[k][1]
    finally:
        destination.close()
        source.stop()
    # Each close released its lease, having closed its channel first: the group's listener
    # must only be accepted on by its next holder (or the guard).
    assert guard.states() == [("idle", None), ("idle", None)]
    assert destination.channel.closed


def test_the_group_endpoint_outlives_a_sigkilled_worker(guard) -> None:
    port = free_port()
    first = SourceWorker("a1", SIZES, port, guard=(guard.socket_path, 0, guard.digest))
    destination = GuardedWorker(guard, 1)
    try:
        first("deposit", [(1, 1, 11)])
        assert destination.pull(first, [(1, 1)], "req-1") == {key(1): "SUCCESS"}
        first.kill()
        guard.wait_free(0)

        second = SourceWorker("a2", SIZES, port, guard=(guard.socket_path, 0, guard.digest))
        try:
            assert second.endpoint == first.endpoint
            sums = second("deposit", [(2, 2, 22)])
            assert destination.pull(second, [(2, 3)], "req-2") == {key(2): "SUCCESS"}
            assert destination.engine.checksum(3) == sums[2][1]
        finally:
            second.stop()
    finally:
        destination.close()


def test_a_control_channel_that_cannot_share_its_listener_is_refused_at_startup(guard) -> None:
    with pytest.raises(ValueError, match="can adopt the pool group's shared control listener"):
        GuardedWorker(guard, 0, channel=SendOnly())
    assert guard.states()[0] == ("idle", None)  # nothing was claimed


def test_a_refused_claim_fails_construction_and_leaves_the_holder_alone(guard) -> None:
    holder = GuardedWorker(guard, 0)
    try:
        with pytest.raises(Exception, match=r"\(held\)"):
            GuardedWorker(guard, 0)
        assert guard.states()[0] == ("held", os.getpid())
    finally:
        holder.close()
    assert guard.states()[0] == ("idle", None)


class RefusesToAdopt(ZmqPeerControlChannel):
    def adopt_listener(self, listener_fd: int) -> None:
        raise RuntimeError("this channel refuses the listener")


def test_a_startup_failure_after_the_claim_gives_the_group_back(guard) -> None:
    channel = RefusesToAdopt("127.0.0.1", free_port(), "127.0.0.1")
    with pytest.raises(RuntimeError, match="refuses the listener"):
        GuardedWorker(guard, 0, channel=channel)
    assert guard.states()[0] == ("idle", None)
    assert "lease_ended group=0 lease=1 reason='released'" in guard.log()


# --- warm start from the group's journal ---------------------------------------------------------

HIT = (QueryStatus.HIT, CacheTier.LOCAL_G2)
MISS = (QueryStatus.MISS, None)


def test_a_replacement_for_a_sigkilled_worker_starts_warm(guard) -> None:
    port = free_port()
    dead = SourceWorker("a1", SIZES, port, guard=(guard.socket_path, 0, guard.digest))
    sums = dead("deposit", [(k, k, 700 + k) for k in range(8)])
    dead.kill()
    guard.wait_free(0)

    heir = GuardedWorker(guard, 0, port=port)
    try:
        keys = [key(k) for k in range(8)]
        assert heir.kv.query([*keys, key(99)]) == [HIT] * 8 + [MISS]
        assert 0 < heir.runtime.gauges()["journal_fill_percent"] < 100
        # The service follows the holder's journal: operators see it in `status`.
        wait_until(lambda: guard.client.status()[0].journal_blocks == 8, what="journal followed")
        assert not guard.client.status()[0].recovery_disabled
        assert sorted(heir.recorder.inventory_keys(removed=False)) == sorted(keys)
        assert heir.deliver_local([(k, 20 + k) for k in range(8)]) == dict.fromkeys(keys, "SUCCESS")
        for k in range(8):
            assert heir.engine.checksum(20 + k) == sums[k][1]
    finally:
        heir.close()


def test_the_heir_serves_recovered_blocks_to_peers_and_evicts_them_normally(guard) -> None:
    port = free_port()
    first = GuardedWorker(guard, 0, port=port)
    for k in range(4):
        first.engine.write(k, 900 + k)
    handle = first.kv.deposit({key(k): first.engine.refs(k) for k in range(4)})
    first.engine.wait(first.kv, handle, 4)
    sums = {k: first.engine.checksum(k) for k in range(4)}
    first.close()  # a clean release keeps the journal too

    heir = SourceWorker("a2", SIZES, port, guard=(guard.socket_path, 0, guard.digest))
    peer = GuardedWorker(guard, 1)
    try:
        result = peer.pull(heir, [(k, 10 + k) for k in range(4)], "req-warm")
        assert set(result.values()) == {"SUCCESS"}
        for k in range(4):
            assert peer.engine.checksum(10 + k) == sums[k]
        # 128 slots: 150 more blocks evict the recovered ones like any other.
        for batch in range(5):
            done = heir("deposit", [(100 + 30 * batch + k, k, k) for k in range(30)])
            assert {status for status, _ in done.values()} == {"SUCCESS"}
        result = peer.pull(heir, [(k, 10 + k) for k in range(4)], "req-after")
        assert set(result.values()) == {"FAILED"}  # evicted (least recently used)
    finally:
        peer.close()
        heir.stop()


# --- takeover: the service serves a dead worker's blocks until a replacement claims ---------------


def test_the_guard_serves_a_dead_workers_blocks_until_a_replacement_takes_them_back(guard) -> None:
    port = free_port()
    dead = SourceWorker("a1", SIZES, port, guard=(guard.socket_path, 0, guard.digest))
    sums = dead("deposit", [(k, k, 300 + k) for k in range(6)])
    peer = GuardedWorker(guard, 1)
    try:
        assert peer.pull(dead, [(0, 0)], "req-before") == {key(0): "SUCCESS"}
        dead.kill()
        wait_until(lambda: guard.states()[0] == ("serving", None), what="takeover")

        # The same endpoint, now served by the guard: every committed block, byte-exact,
        # and nothing else (key 7 was never deposited). The pull, aimed at the dead
        # worker's incarnation, is refused by the guard at once and asked again: it takes
        # a round trip or two, nowhere near the 2 s operation deadline.
        started = time.monotonic()
        result = peer.pull(dead, [(k, 10 + k) for k in (*range(6), 7)], "req-served")
        assert time.monotonic() - started < 1.0
        assert result == {**{key(k): "SUCCESS" for k in range(6)}, key(7): "FAILED"}
        for k in range(6):
            assert peer.engine.checksum(10 + k) == sums[k][1]
        served = scrape(metrics_url(guard))
        assert group_value(served, "kvcr_guard_served_blocks_total", 0) == 6
        assert group_value(served, "kvcr_guard_takeovers_total", 0) == 1

        heir = SourceWorker("a2", SIZES, port, guard=(guard.socket_path, 0, guard.digest))
        try:
            assert guard.states()[0] == ("held", heir.proc.pid)
            assert heir("query", [*range(6), 7]) == ["HIT"] * 6 + ["MISS"]
            result = peer.pull(heir, [(k, 20 + k) for k in range(6)], "req-heir")
            assert set(result.values()) == {"SUCCESS"}
            assert peer.engine.checksum(25) == sums[5][1]
        finally:
            heir.stop()
        # A clean release leaves the group idle (standby), not served.
        assert guard.states()[0] == ("idle", None)
        log = guard.log()
        assert "took_over" in log and "handed_back" in log
    finally:
        peer.close()
