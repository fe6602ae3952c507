"""Starting and stopping a KVCR instance: threads, failures, policies and logs."""

from __future__ import annotations

import threading

import pytest

from engine_sim import EngineSim, Recorder, key
from kvcr import KVCR
from kvcr.config import KVCRBackendConfigs, LocalDramOptions
from kvcr.policy import G3FIFOPolicy, G3LRUPolicy, LRUPolicy
from kvcr.transport.base import TransportError
from kvcr.transport.copier import copy_threads
from procs import native_threads

pytestmark = pytest.mark.integration


def kvcr_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvcr-")]


def test_one_runtime_thread_and_its_copy_threads_per_instance_gone_after_close() -> None:
    # The copy threads are the compiled core's pthreads: only /proc names them.
    copiers_before = len(native_threads("kvcr-copy-"))
    engine = EngineSim(name="lifecycle-threads")
    kv = KVCR(engine.config, Recorder().bindings(), engine.backend_configs)
    assert kvcr_threads() == ["kvcr-lifecycle-threads"]
    assert len(native_threads("kvcr-copy-")) == copiers_before + copy_threads()
    kv.close()
    assert kvcr_threads() == []
    assert len(native_threads("kvcr-copy-")) == copiers_before


def test_a_failed_start_cleans_up_and_reraises() -> None:
    engine = EngineSim(name="lifecycle-bad-backend")
    pools = engine.backend_configs.local_dram.pools
    backends = KVCRBackendConfigs(
        framework_regions=engine.backend_configs.framework_regions,
        local_dram=LocalDramOptions(pools, backend="NOPE"),
    )
    with pytest.raises(TransportError, match="backend 'NOPE'"):
        KVCR(engine.config, Recorder().bindings(), backends)
    assert kvcr_threads() == []


@pytest.mark.parametrize("policy", [G3LRUPolicy, G3FIFOPolicy])
def test_a_policy_that_needs_g3_is_refused_without_g3(policy) -> None:
    engine = EngineSim(name="lifecycle-policy")
    with pytest.raises(ValueError, match=r"policy G3\w+Policy requires tier\(s\) \['G3'\]"):
        KVCR(engine.config, Recorder().bindings(policy=policy()), engine.backend_configs)
    assert kvcr_threads() == []


def test_policy_hooks_see_ingest_and_removal() -> None:
    class Watching(LRUPolicy):
        def __init__(self) -> None:
            self.ingested: list[bytes] = []
            self.removed: list[bytes] = []
            self.aligned: list[list[bytes]] = []

        def on_ingest(self, meta, source):
            self.ingested.append(meta.block_key)

        def on_remove(self, meta):
            assert meta.resident_tiers == frozenset()
            self.removed.append(meta.block_key)

        def on_align_sequence(self, blocks, use_current_time):
            self.aligned.append([(b.block_key, b.position) for b in blocks])

    engine = EngineSim(name="lifecycle-hooks", pool_blocks=2)
    policy = Watching()
    kv = KVCR(engine.config, Recorder().bindings(policy=policy), engine.backend_configs)
    try:
        for i in range(3):
            handle = kv.deposit(engine.blocks([(key(i), i)]))
            engine.wait(kv, handle, 1)
        kv.align_sequence([key(9), key(2), key(1)], use_current_time=True)
        kv.fetch([])  # a round trip through the runtime: the alignment was applied
        engine.wait(kv, kv.fetch([key(2)]), 1)
    finally:
        kv.close()
    assert policy.ingested == [key(0), key(1), key(2)]
    assert policy.removed == [key(0)]
    assert policy.aligned == [[(key(2), 1), (key(1), 2)]]


def test_a_policy_hook_that_raises_is_logged_and_defaults_apply() -> None:
    class Broken(LRUPolicy):
        def decide_ingest(self, *args, **kwargs):
            raise RuntimeError("policy bug")

    engine = EngineSim(name="lifecycle-broken-policy")
    kv = KVCR(engine.config, Recorder().bindings(policy=Broken()), engine.backend_configs)
    try:
        handle = kv.deposit(engine.blocks([(key(0), 0)]))
        assert engine.statuses(engine.wait(kv, handle, 1)) == {key(0): "SUCCESS"}
    finally:
        kv.close()


def test_without_local_dram_deposits_fail_and_nothing_is_stored() -> None:
    engine = EngineSim(name="lifecycle-no-pools")
    backends = KVCRBackendConfigs(framework_regions=engine.backend_configs.framework_regions)
    kv = KVCR(engine.config, Recorder().bindings(), backends)
    try:
        handle = kv.deposit(engine.blocks([(key(0), 0), (key(1), 1)]))
        assert engine.statuses(engine.wait(kv, handle, 2)) == {
            key(0): "FAILED",
            key(1): "FAILED",
        }
        assert [status.value for status, _ in kv.query([key(0)])] == ["MISS"]
        handle = kv.fetch([key(0)])
        assert engine.statuses(engine.wait(kv, handle, 1)) == {key(0): "FAILED"}
    finally:
        kv.close()


def test_a_failure_inside_the_runtime_at_start_is_reraised_as_itself() -> None:
    class BrokenChannel:
        def initialize(self) -> None:
            raise OSError("control port in use")

        def send(self, endpoint: str, message: bytes) -> bool:
            return False

        def recv(self) -> list[bytes]:
            return []

    engine = EngineSim(name="lifecycle-broken-channel")
    with pytest.raises(OSError, match="control port in use"):
        KVCR(
            engine.config,
            Recorder().bindings(framework_control=BrokenChannel()),
            engine.backend_configs,
        )
    assert kvcr_threads() == []
