"""G3 behind local G2, through the public API on real NIXL (UCX for G2, POSIX for G3):
blocks evicted from a full pool spill to the files by policy, `query` says they are
fetchable from G3, `deliver` and `fetch` bring them back byte-exact, and a damaged file
turns its keys into misses, never into wrong bytes."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from damage import damage as damage_file
from engine_sim import EngineSim, Recorder
from kvcr import KVCR
from kvcr.config import G3Options
from kvcr.policy import G3LRUPolicy
from kvcr.telemetry import (
    DURATION_METRIC,
    STATE_METRIC,
    TRANSFER_BLOCKS_METRIC,
    TRANSFER_BYTES_METRIC,
    InMemoryStats,
)
from kvcr.testing import open_kvcr
from kvcr.transport.base import TransportError, XferState
from kvcr.types import CacheTier, PlacementAction, QueryStatus, TransferError

pytestmark = pytest.mark.integration

BLOCK = 64 * 1024
HIT = (QueryStatus.HIT, CacheTier.LOCAL_G2)
IN_G3 = (QueryStatus.FETCHABLE, CacheTier.G3)


def key(i: int) -> bytes:
    return b"blk-%04d" % i


class Instance:
    def __init__(
        self,
        tmp_path: Path,
        name: str = "g3w",
        config: dict[str, object] | None = None,
        **bindings: object,
    ) -> None:
        self.engine = EngineSim(
            name=name,
            layouts=[("", BLOCK)],
            pool_blocks=4,
            region_blocks=32,
            enable_telemetry=True,
            **(config or {}),
        )
        self.recorder = Recorder()
        self.g3 = G3Options(
            paths=(tmp_path / "d0" / "g3.bin", tmp_path / "d1" / "g3.bin"),
            capacity_bytes_per_file=8 * BLOCK,
        )
        backends = dataclasses.replace(self.engine.backend_configs, g3=self.g3)
        bindings.setdefault("stats_factory", InMemoryStats)
        opened = open_kvcr(self.engine.config, self.recorder.bindings(**bindings), backends)
        self.kv, self.runtime = opened.kv, opened.runtime
        self.sums: dict[int, list[int]] = {}

    def deposit(self, ids: list[int]) -> dict:
        for i in ids:
            self.engine.write(i, seed=i)
            self.sums[i] = self.engine.checksum(i)
        handle = self.kv.deposit({key(i): self.engine.refs(i) for i in ids})
        return self.engine.statuses(self.engine.wait(self.kv, handle, len(ids)))

    def deliver(self, pairs: list[tuple[int, int]]) -> dict:
        handle = self.kv.deliver({key(i): self.engine.refs(e) for i, e in pairs})
        return self.engine.statuses(self.engine.wait(self.kv, handle, len(pairs)))

    def close(self) -> None:
        self.kv.close()


@pytest.fixture
def inst(tmp_path):
    instance = Instance(tmp_path)
    yield instance
    instance.close()


def test_evicted_blocks_spill_to_g3_and_come_back_byte_exact(inst) -> None:
    assert set(inst.deposit([0, 1, 2, 3]).values()) == {"SUCCESS"}
    # The pool holds 4: these evict 0..3, which the G3 policy moves to the files first.
    assert set(inst.deposit([4, 5, 6, 7]).values()) == {"SUCCESS"}

    assert inst.kv.query([key(i) for i in range(8)]) == [IN_G3] * 4 + [HIT] * 4
    assert sorted(inst.recorder.inventory_keys(removed=False)) == sorted(
        [key(i) for i in range(8)] + [key(i) for i in range(4)]  # G2 adds, then G3 adds
    )

    result = inst.deliver([(i, 20 + i) for i in range(4)])
    assert set(result.values()) == {"SUCCESS"}
    for i in range(4):
        assert inst.engine.checksum(20 + i) == inst.sums[i]


def test_fetch_brings_a_g3_block_back_into_g2_claimed(inst) -> None:
    inst.deposit([0, 1, 2, 3])
    inst.deposit([4, 5, 6, 7])

    handle = inst.kv.fetch([key(0)])
    (entry,) = inst.engine.wait(inst.kv, handle, 1).values()

    assert entry.success and entry.release_handle is not None
    assert inst.kv.query([key(0)]) == [HIT]
    slot = entry.descriptors[0].element_index
    pool = inst.engine.pools[0]
    import zlib

    assert [zlib.crc32(pool[slot * BLOCK : (slot + 1) * BLOCK].tobytes())] == inst.sums[0]
    inst.kv.release([entry.release_handle])


def test_least_recently_used_blocks_spill_first(inst) -> None:
    inst.deposit([0, 1, 2, 3])
    assert set(inst.deliver([(1, 20), (0, 21)]).values()) == {"SUCCESS"}  # 0, 1 are recent

    inst.deposit([4, 5])

    assert inst.kv.query([key(i) for i in range(6)]) == [HIT, HIT, IN_G3, IN_G3, HIT, HIT]


def test_g3_traffic_is_measured_in_its_own_scopes_with_state_gauges(inst) -> None:
    inst.deposit([0, 1, 2, 3])
    inst.deposit([4, 5, 6, 7])
    inst.deliver([(0, 20), (1, 21)])
    stats = inst.kv.get_stats()

    assert stats.counters[(TRANSFER_BLOCKS_METRIC, ("g3_store",))] == 4
    assert stats.counters[(TRANSFER_BYTES_METRIC, ("g3_store",))] == 4 * BLOCK
    assert stats.counters[(TRANSFER_BYTES_METRIC, ("g3_deliver",))] == 2 * BLOCK
    assert len(stats.histograms[(DURATION_METRIC, ("g3_store", "success"))]) == 1
    assert (TRANSFER_BYTES_METRIC, ("local_deliver",)) not in stats.counters
    assert stats.gauges[(STATE_METRIC, ("g3_blocks",))] == 4
    assert stats.gauges[(STATE_METRIC, ("g3_capacity_bytes",))] == 16 * BLOCK


class KeepOnFailedSpill(G3LRUPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.failures: list[str] = []

    def decide_recovery(self, meta, failure):
        self.failures.append(failure.reason)
        return (PlacementAction.KEEP, None)


def test_a_failed_store_goes_to_the_policy(tmp_path) -> None:
    policy = KeepOnFailedSpill()
    inst = Instance(tmp_path, policy=policy)
    try:
        inst.deposit([0, 1, 2, 3])
        g3 = inst.runtime.g3

        def refuse(*args: object) -> object:
            raise TransportError("injected: the file backend refuses")

        g3.transport.post = refuse  # fault injection on the real transport object
        result = inst.deposit([4])

        # The policy kept the block: it stays in G2, nothing was lost, and the new deposit
        # had no room.
        assert policy.failures == ["G3 store failed"]
        assert result == {key(4): "FAILED"}
        assert inst.kv.query([key(0)]) == [HIT]
    finally:
        inst.close()


class HeldFileTransfers:
    """Fault injection on the real file transport: while held, every poll says the transfer
    is still running (the real transfer does not progress: the POSIX backend works inside
    polls); once let go, polls reach NIXL again."""

    def __init__(self, transport: object) -> None:
        self.let_go = threading.Event()
        self._poll = transport.poll
        transport.poll = self.poll

    def poll(self, handle: object) -> XferState:
        return self._poll(handle) if self.let_go.is_set() else XferState.PROC


def test_a_g3_read_that_outlives_its_deliver_holds_its_blocks_until_it_ends(
    tmp_path, caplog
) -> None:
    inst = Instance(tmp_path, config={"operation_timeout_ms": 200, "abandon_timeout_ms": 400})
    try:
        inst.deposit([0, 1, 2, 3])
        inst.deposit([4, 5, 6, 7])  # 0..3 are in G3 now
        g3 = inst.runtime.g3
        held = HeldFileTransfers(g3.transport)

        with caplog.at_level(logging.WARNING, logger="kvcr"):
            result = inst.deliver([(0, 20), (1, 21)])
            # The deliver ends at its deadline, telling the engine that its memory may still
            # be written; the G3 blocks stay claimed (not evictable, not lost) meanwhile.
            assert result == {key(0): "FAILED", key(1): "FAILED"}
            (uncertain,) = inst.recorder.resilience
            assert isinstance(uncertain, TransferError) and uncertain.state == "uncertain"
            assert [g3.index.get(key(i)).claims for i in (0, 1)] == [1, 1]
            assert inst.kv.query([key(0), key(1)]) == [IN_G3, IN_G3]
            wait_for(inst, lambda: "transfer_abandoned" in caplog.text)

        held.let_go.set()  # the read ends: only now do the claims end and the engine hear
        wait_for(inst, lambda: len(inst.recorder.resilience) == 2)
        assert inst.recorder.resilience[1].state == "quiesced"
        assert [g3.index.get(key(i)).claims for i in (0, 1)] == [0, 0]
        assert set(inst.deliver([(0, 22), (1, 23)]).values()) == {"SUCCESS"}
        assert inst.engine.checksum(22) == inst.sums[0]
    finally:
        inst.close()


def test_a_spill_that_outlives_abandon_timeout_is_reported_and_keeps_its_slots(
    tmp_path, caplog
) -> None:
    inst = Instance(tmp_path, config={"operation_timeout_ms": 200, "abandon_timeout_ms": 400})
    try:
        inst.deposit([0, 1, 2, 3])
        held = HeldFileTransfers(inst.runtime.g3.transport)

        with caplog.at_level(logging.WARNING, logger="kvcr"):
            # The new key needs the slot that the spill of an older block would free: the
            # deposit waits for it until its deadline; the spill is reported at
            # abandon_timeout_ms, and the block it copies stays in G2 meanwhile.
            assert inst.deposit([4]) == {key(4): "FAILED"}
            wait_for(inst, lambda: "transfer_abandoned" in caplog.text)
        assert "what='spill'" in caplog.text
        assert inst.kv.query([key(i) for i in range(4)]).count(HIT) == 4  # nothing lost

        held.let_go.set()
        wait_for(inst, lambda: inst.kv.query([key(0)]) == [IN_G3])  # the spill ended: 0 moved
        assert set(inst.deposit([4]).values()) == {"SUCCESS"}
        assert set(inst.deliver([(0, 20)]).values()) == {"SUCCESS"}
        assert inst.engine.checksum(20) == inst.sums[0]
    finally:
        inst.close()


def wait_for(inst: Instance, condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll like an engine (events reach it inside its calls) until ``condition`` holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        inst.engine.absorb(inst.kv)
        time.sleep(0.005)


@pytest.mark.parametrize("damage", ["delete", "truncate", "zero"])
def test_a_damaged_g3_file_never_yields_wrong_bytes(inst, damage) -> None:
    inst.deposit([0, 1, 2, 3])
    inst.deposit([4, 5, 6, 7])
    path = inst.g3.paths[0]
    damage_file(path, damage)

    result = inst.deliver([(i, 20 + i) for i in range(4)])

    # Slots are striped: file 0 held half of the spilled blocks; those are now misses.
    assert sorted(result.values()) == ["FAILED", "FAILED", "SUCCESS", "SUCCESS"]
    for i in range(4):
        if result[key(i)] == "SUCCESS":
            assert inst.engine.checksum(20 + i) == inst.sums[i]
    assert inst.kv.query([key(i) for i in range(4)]).count(IN_G3) == 2


def test_a_second_process_on_the_same_g3_path_is_refused(inst, tmp_path) -> None:
    code = f"""
import dataclasses, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from pathlib import Path
from engine_sim import EngineSim, Recorder
from kvcr import KVCR
from kvcr.config import G3Options
from kvcr.policy import G3LRUPolicy
from kvcr.telemetry import (
    DURATION_METRIC,
    STATE_METRIC,
    TRANSFER_BLOCKS_METRIC,
    TRANSFER_BYTES_METRIC,
    InMemoryStats,
)
from kvcr.transport.base import TransportError
engine = EngineSim(name="other", layouts=[("", {BLOCK})], pool_blocks=4)
g3 = G3Options(paths=(Path({str(inst.g3.paths[0])!r}),), capacity_bytes_per_file={8 * BLOCK})
KVCR(engine.config, Recorder().bindings(), dataclasses.replace(engine.backend_configs, g3=g3))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode != 0
    assert "in use by another live KVCR instance" in out.stderr
    assert str(inst.g3.paths[0]) in out.stderr and "{agent}" in out.stderr


# --- G3 behind a guard: the next holder of the group reopens the files, keeps what is valid --


def guarded(tmp_path: Path, guard, name: str) -> tuple[KVCR, EngineSim, object]:
    from kvcr.config import KVCRGuardConfig
    from kvcr.control_channels import ZmqPeerControlChannel

    engine = EngineSim(name=name, layouts=[("", BLOCK)], pool_blocks=1, region_blocks=32)
    g3 = G3Options(
        paths=(tmp_path / "d0" / "g3.bin", tmp_path / "d1" / "g3.bin"),
        capacity_bytes_per_file=8 * BLOCK,
    )
    channel = ZmqPeerControlChannel("127.0.0.1", guard.port, "127.0.0.1")
    recorder = Recorder()
    kv = KVCR(
        engine.config,
        recorder.bindings(framework_control=channel),
        dataclasses.replace(engine.backend_configs, local_dram=None, g3=g3),
        KVCRGuardConfig(guard.socket_path, 0, guard.digest),
    )
    return kv, engine, recorder


@pytest.fixture
def guard(tmp_path):
    from procs import GuardProcess, free_port

    (tmp_path / "svc").mkdir()
    service = GuardProcess(tmp_path / "svc", guard_count=1, pool_sizes_gb=str(4 * BLOCK / 2**30))
    service.port = free_port()
    yield service
    assert service.stop() == 0, service.log()


@pytest.mark.parametrize("damaged", [False, True], ids=["intact", "one-file-zeroed"])
def test_the_next_holder_of_a_group_keeps_its_valid_g3_blocks(tmp_path, guard, damaged) -> None:
    kv, engine, _ = guarded(tmp_path, guard, "first")
    sums = {}
    try:
        for i in range(8):
            engine.write(i, seed=50 + i)
            sums[i] = engine.checksum(i)
        for batch in (range(4), range(4, 8)):  # the pool holds 4: the second batch spills
            handle = kv.deposit({key(i): engine.refs(i) for i in batch})
            assert set(engine.statuses(engine.wait(kv, handle, 4)).values()) == {"SUCCESS"}
        assert kv.query([key(i) for i in range(8)]) == [IN_G3] * 4 + [HIT] * 4
    finally:
        kv.close()
    if damaged:
        damage_file(tmp_path / "d0" / "g3.bin", "zero")

    heir, engine2, recorder = guarded(tmp_path, guard, "heir")
    try:
        answers = heir.query([key(i) for i in range(8)])
        in_g3 = [i for i in range(8) if answers[i] == IN_G3]
        assert len(in_g3) == (2 if damaged else 4)
        assert [answers[i] for i in range(4, 8)] == [HIT] * 4
        assert sorted(recorder.inventory_keys(removed=False)) == sorted(
            [key(i) for i in range(4, 8)] + [key(i) for i in in_g3]
        )
        handle = heir.deliver({key(i): engine2.refs(10 + i) for i in range(8)})
        result = engine2.statuses(engine2.wait(heir, handle, 8))
        for i in range(8):
            if i in in_g3 or i >= 4:
                assert result[key(i)] == "SUCCESS" and engine2.checksum(10 + i) == sums[i]
            else:
                assert result[key(i)] == "FAILED"  # a miss, never wrong bytes
    finally:
        heir.close()
