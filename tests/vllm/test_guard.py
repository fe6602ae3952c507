"""Guard-owned pools through a crash: two engines in processes of their own (one rank each,
``VLLM_DP_RANK_LOCAL`` 0 and 1, as an operator starts one engine per rank), their pools lent
by one ``kvcr-guard --guard-count 2``. Rank 0's engine is SIGKILLed after computing a prefix;
the guard serves that prefix to rank 1's hinted request on rank 0's endpoint; rank 0 starts
again, claims its group back and serves the prefix warm."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator

import pytest
from tiny_model import BLOCK_BYTES, BLOCK_TOKENS
from vllm_harness import BLOCKS, SHM, counter, kvcr_tier, prompt

from procs import GuardProcess, free_port, wait_until

pytestmark = pytest.mark.vllm

POOL_BLOCKS = 64


@pytest.fixture
def guard() -> Iterator[GuardProcess]:
    """A guard service with two groups of one pool (vLLM's adapter uses one pool), its
    files in /dev/shm as in production; stopped and removed after the engines ended."""
    directory = SHM / f"kvcr-test-guard-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    service = GuardProcess(
        directory,
        guard_count=2,
        pool_sizes_gb=repr(POOL_BLOCKS * BLOCK_BYTES / 2**30),
        digest="vllm-0.32-tiny-qwen3",
        extra=(),
    )
    try:
        yield service
    finally:
        try:
            assert service.stop() == 0, service.log()
        finally:
            shutil.rmtree(directory)


def test_a_killed_engines_prefix_is_served_by_the_guard_then_comes_back_warm(
    guard: GuardProcess, engines
) -> None:
    ports = [free_port(), free_port()]
    tier = kvcr_tier(
        ports, kvcr_service_socket_path=guard.socket_path, compatibility_digest=guard.digest
    )
    sizes = {"gpu_blocks": 24, "cpu_chunks": 12}
    rank_0 = engines(tier, name="rank0", rank_local=0, **sizes)
    rank_1 = engines(tier, name="rank1", rank_local=1, **sizes)
    rank_0.wait_ready()
    rank_1.wait_ready()
    assert [state for state, _ in guard.states()] == ["held", "held"]
    assert guard.states()[0][1] in rank_0.engine_pids()  # the engine core holds group 0

    p = prompt(20)
    first = rank_0.generate(p)
    assert first["cached"] == 0
    blocks = len(p) // BLOCK_TOKENS
    rank_0.wait_stats(
        lambda s: counter(s, 0, BLOCKS, "local_fill") >= blocks, "the prefix deposited in G2"
    )

    rank_0.kill_engine()
    wait_until(lambda: guard.states()[0] == ("serving", None), 30, "the guard serving group 0")

    source = f"tcp://127.0.0.1:{ports[0]}"
    served = rank_1.generate(p, hint={"endpoint": source, "hashes": rank_1.hashes(p)})

    assert served["cached"] == blocks * BLOCK_TOKENS
    assert served["tokens"] == first["tokens"]
    rank_1.wait_stats(
        lambda s: counter(s, 0, BLOCKS, "remote_deliver") == blocks, "the guard's write"
    )

    # Rank 1 is done: ended before rank 0 starts again, since an idle engine with vLLM
    # 0.32's kvcr adapter keeps stepping (about 1.4 cores here; see docs/dev-guide.md).
    rank_1.end()
    again = engines(tier, name="rank0-again", rank_local=0, **sizes)
    again.wait_ready()
    assert guard.states()[0][0] == "held"
    warm = again.generate(p)

    assert warm["cached"] == blocks * BLOCK_TOKENS  # nothing of the prefix recomputed
    assert warm["tokens"] == first["tokens"]
    again.wait_stats(
        lambda s: counter(s, 0, BLOCKS, "local_deliver") == blocks, "G2 delivered the prefix"
    )
