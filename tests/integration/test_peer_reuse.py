"""Peer-to-peer reuse between two processes, with real NIXL and real ZMQ on 127.0.0.1.

The source worker runs in a child process (``worker_proc.py``); the destination is a
KVCR instance in the test process, driven the way an engine adapter drives it: a router
hint names the source, ``query`` says the keys are fetchable from a peer, and ``deliver``
or ``fetch`` pulls them.
"""

from __future__ import annotations

import os
import subprocess
import time
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

import procs
from engine_sim import EngineSim, Recorder, router_hint
from kvcr import KVCR
from kvcr.config import KVCRBackendConfigs, RemoteFWDramOptions
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.transport.auth import KEY_ENV
from kvcr.types import CacheTier, QueryStatus
from peer_world import EnginePins, IntKeys, key
from procs import free_port, wait_until

pytestmark = pytest.mark.integration

BLOCK = 64 * 1024
SIZES = (str(BLOCK), "64", "64")  # block bytes, pool blocks, engine region blocks
REMOTE = (QueryStatus.FETCHABLE, CacheTier.REMOTE_G2)
HIT = (QueryStatus.HIT, CacheTier.LOCAL_G2)


class SourceWorker(procs.SourceWorker):
    def __init__(self, name: str, port: int | None = None, env: dict | None = None) -> None:
        super().__init__(name, SIZES, port, env=env)


class Destination:
    """The worker in this process that a router sends to the source."""

    def __init__(self, eager: bool = True, **config: Any) -> None:
        config.setdefault("operation_timeout_ms", 2000)
        config.setdefault("abandon_timeout_ms", 4000)
        self.engine = EngineSim(
            name=f"dst-{os.getpid()}",
            layouts=[("", BLOCK)],
            pool_blocks=64,
            region_blocks=64,
            **config,
        )
        self.recorder = Recorder()
        self.pins = EnginePins(self.engine)
        self.channel = ZmqPeerControlChannel("127.0.0.1", free_port(), "127.0.0.1")
        self.kv = KVCR(
            self.engine.config,
            self.recorder.bindings(
                framework_control=self.channel,
                key_adapter=IntKeys(),
                request_pin=self.pins.request_pin,
                poll_pin_results=self.pins.poll_pin_results,
                release_pin=self.pins.release_pin,
            ),
            KVCRBackendConfigs(
                framework_regions=self.engine.backend_configs.framework_regions,
                local_dram=self.engine.backend_configs.local_dram,
                remote_fw_dram=RemoteFWDramOptions(eager_ctrl_connect=eager),
            ),
        )

    def close(self) -> None:
        self.kv.close()
        self.channel.close()  # the adapter owns its channel

    def hint(self, source: SourceWorker, keys: list[int], request_id: str) -> None:
        self.kv.submit_hint(router_hint(source.endpoint, keys), request_id=request_id)

    def deliver(self, pairs: list[tuple[int, int]], request_id: str, timeout: float = 10) -> dict:
        handle = self.kv.deliver(
            {key(k): self.engine.refs(e) for k, e in pairs}, request_id=request_id
        )
        return self.engine.statuses(self.engine.wait(self.kv, handle, len(pairs), timeout))


@pytest.fixture
def source() -> Iterator[SourceWorker]:
    worker = SourceWorker("src")
    yield worker
    worker.stop()


@pytest.fixture
def destination() -> Iterator[Destination]:
    dst = Destination()
    yield dst
    dst.close()


def test_kvcr_owned_blocks_reach_the_destination_byte_exact(source, destination) -> None:
    sums = source("deposit", [(k, k, 100 + k) for k in range(8)])
    assert {status for status, _ in sums.values()} == {"SUCCESS"}

    destination.hint(source, list(range(8)), "req-1")
    assert destination.kv.query([key(k) for k in range(8)], "req-1") == [REMOTE] * 8
    result = destination.deliver([(k, 20 + k) for k in range(8)], "req-1")

    assert set(result.values()) == {"SUCCESS"}
    for k in range(8):
        assert destination.engine.checksum(20 + k) == sums[k][1]
    assert source("claims", 0) == 0  # claims dropped once the write was over


def test_engine_owned_blocks_are_pinned_written_and_released(source, destination) -> None:
    sums = source("engine_has", [(k, 30 + k, 200 + k) for k in range(4)])
    destination.hint(source, list(range(4)), "req-2")

    handle = destination.kv.fetch([key(k) for k in range(4)], request_id="req-2")
    entries = destination.engine.wait(destination.kv, handle, 4, timeout=10)

    assert all(entry.success for entry in entries.values())
    assert destination.kv.query([key(k) for k in range(4)]) == [HIT] * 4
    pool = destination.engine.pools[0]
    for k in range(4):
        slot = entries[key(k)].descriptors[0].element_index
        assert [zlib.crc32(pool[slot * BLOCK : (slot + 1) * BLOCK].tobytes())] == sums[k]
    # The pin goes back once the write is over, at the source engine's next poll.
    wait_until(lambda: source("pin_state")["pinned"] == [], what="the pin's release")
    assert len(source("pin_state")["released"]) == 1


def test_a_partial_prefix_delivers_what_the_source_has(source, destination) -> None:
    sums = source("deposit", [(k, k, 300 + k) for k in range(3)])
    destination.hint(source, list(range(6)), "req-3")

    result = destination.deliver([(k, 10 + k) for k in range(6)], "req-3")

    assert result == {key(k): "SUCCESS" if k < 3 else "FAILED" for k in range(6)}
    for k in range(3):
        assert destination.engine.checksum(10 + k) == sums[k][1]


@pytest.mark.parametrize("eager", [True, False], ids=["eager-setup", "lazy-setup"])
def test_setup_is_eager_at_submit_hint_or_lazy_at_first_use(source, eager) -> None:
    destination = Destination(eager=eager)
    try:
        sums = source("deposit", [(0, 0, 7)])
        destination.hint(source, [0], "req-4")
        result = destination.deliver([(0, 5)], "req-4")
        assert result == {key(0): "SUCCESS"}
        assert destination.engine.checksum(5) == sums[0][1]
    finally:
        destination.close()


def test_a_source_killed_mid_pull_fails_the_operation_and_the_instance_goes_on(
    destination,
) -> None:
    source = SourceWorker("victim")
    try:
        source("engine_has", [(0, 0, 1)])
        source("hold_pins", True)  # the source is mid-pull: waiting for its engine's pin
        destination.hint(source, [0], "req-5")
        handle = destination.kv.deliver({key(0): destination.engine.refs(3)}, request_id="req-5")
        time.sleep(0.3)
        source.kill()
        started = time.monotonic()

        entries = destination.engine.wait(destination.kv, handle, 1, timeout=10)

        elapsed = time.monotonic() - started
        assert destination.engine.statuses(entries) == {key(0): "FAILED"}
        assert elapsed < (4000 + 100) / 1000  # within abandon_timeout_ms + 100 ms
        # The engine was told not to reuse the destination memory.
        (event,) = destination.recorder.resilience
        assert event.state == "uncertain"
    finally:
        source.stop()

    # The instance keeps working: the next request, to a healthy source, succeeds.
    healthy = SourceWorker("healthy")
    try:
        sums = healthy("deposit", [(1, 1, 11)])
        destination.hint(healthy, [1], "req-6")
        assert destination.deliver([(1, 6)], "req-6") == {key(1): "SUCCESS"}
        assert destination.engine.checksum(6) == sums[1][1]
    finally:
        healthy.stop()


def test_a_restarted_source_at_the_same_endpoint_is_served_again(destination) -> None:
    first = SourceWorker("phoenix")
    port = first.port
    try:
        first("deposit", [(0, 0, 1)])
        destination.hint(first, [0], "req-7")
        assert destination.deliver([(0, 1)], "req-7") == {key(0): "SUCCESS"}
    finally:
        first.stop()
    second = SourceWorker("phoenix", port=port)
    try:
        sums = second("deposit", [(0, 0, 2)])
        destination.hint(second, [0], "req-8")
        # The first pull aimed at the old incarnation fails at once; the next one works.
        started = time.monotonic()
        first_try = destination.deliver([(0, 2)], "req-8")
        assert time.monotonic() - started < 1.0
        destination.hint(second, [0], "req-9")
        result = (
            first_try
            if first_try == {key(0): "SUCCESS"}
            else destination.deliver([(0, 2)], "req-9")
        )
        assert result == {key(0): "SUCCESS"}
        assert destination.engine.checksum(2) == sums[0][1]
    finally:
        second.stop()


def test_no_stray_processes() -> None:
    out = subprocess.run(
        ["pgrep", "-f", str(procs.WORKER)], check=False, capture_output=True, text=True
    )
    assert out.stdout.strip() == ""


# -- with a cluster key ------------------------------------------------------------------------

CLUSTER_KEY = "cluster-key-for-tests-0123456789"


def test_workers_sharing_a_cluster_key_pull_over_real_nixl(monkeypatch) -> None:
    source = SourceWorker("keyed", env={KEY_ENV: CLUSTER_KEY})
    monkeypatch.setenv(KEY_ENV, CLUSTER_KEY)
    destination = Destination()
    try:
        sums = source("deposit", [(k, k, 500 + k) for k in range(4)])
        destination.hint(source, list(range(4)), "req-k")
        assert set(destination.deliver([(k, 10 + k) for k in range(4)], "req-k").values()) == {
            "SUCCESS"
        }
        for k in range(4):
            assert destination.engine.checksum(10 + k) == sums[k][1]
        assert source("dropped") == {}
    finally:
        destination.close()
        source.stop()


@pytest.mark.parametrize(
    "dest_key", ["another-cluster-key-9876543210", None], ids=["wrong", "none"]
)
def test_a_peer_without_the_cluster_key_gets_nothing(monkeypatch, dest_key) -> None:
    source = SourceWorker("guarded", env={KEY_ENV: CLUSTER_KEY})
    if dest_key is None:
        monkeypatch.delenv(KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(KEY_ENV, dest_key)
    destination = Destination(operation_timeout_ms=500, abandon_timeout_ms=1000)
    try:
        source("deposit", [(0, 0, 9)])
        before = destination.engine.checksum(10)
        destination.hint(source, [0], "req-x")
        assert destination.deliver([(0, 10)], "req-x") == {key(0): "FAILED"}
        assert destination.engine.checksum(10) == before  # not a byte written
        assert source("dropped")["unauthenticated"] >= 1
        assert source("claims", 0) == 0
    finally:
        destination.close()
        source.stop()
