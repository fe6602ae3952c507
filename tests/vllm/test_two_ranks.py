"""Two data-parallel ranks in one engine, peer to peer (the quick start's shape, one control
port per rank): a prefix computed on rank 0 is reused on rank 1 through kvcr's peer path
when a router-style hint names rank 0, and only then.

Rank 0's CPU tier holds 25 chunks. It computes Q, P and P1 (10 blocks each) in that order,
so it evicts five blocks of Q, the least recently used: vLLM frees a request's blocks tail
first, so Q's first five blocks stay. That gives the "source evicted half the prefix" case
without reaching into vLLM.
"""

from __future__ import annotations

import pytest
from tiny_model import BLOCK_BYTES, BLOCK_TOKENS
from vllm_harness import BLOCKS, BYTES, DURATIONS, TIER_READ, counter, kvcr_tier, prompt

from procs import free_port

pytestmark = pytest.mark.vllm


def test_rank_1_reuses_rank_0s_prefix_through_a_hint(engines) -> None:
    ports = [free_port(), free_port()]
    engine = engines(kvcr_tier(ports), ranks=2, gpu_blocks=24, cpu_chunks=25)
    start_s = engine.wait_ready()
    p, p1, q = prompt(10), prompt(11), prompt(12)
    on_rank_0 = {}
    for name, tokens in (("q", q), ("p", p), ("p1", p1)):
        on_rank_0[name] = engine.generate(tokens, rank=0)
        assert on_rank_0[name]["cached"] == 0

    # The control: rank 0 holds P1, but without a hint rank 1 computes it all.
    control = engine.generate(p1, rank=1)
    assert control["cached"] == 0
    assert control["tokens"] == on_rank_0["p1"]["tokens"]

    source = f"tcp://127.0.0.1:{ports[0]}"
    hinted = engine.generate(p, rank=1, hint={"endpoint": source, "hashes": engine.hashes(p)})

    assert hinted["cached"] == (len(p) // BLOCK_TOKENS) * BLOCK_TOKENS
    assert hinted["tokens"] == on_rank_0["p"]["tokens"]

    def agree(stats: dict) -> bool:
        written = counter(stats, 0, BYTES, "source_write")
        return written > 0 and written == counter(stats, 1, BYTES, "remote_deliver") == counter(
            stats, 1, TIER_READ, "1:kvcr"
        )

    stats = engine.wait_stats(agree, "source_write == remote_deliver == the tier's reads")
    assert counter(stats, 1, BLOCKS, "remote_deliver") == hinted["cached"] // BLOCK_TOKENS
    assert (
        counter(stats, 1, BYTES, "remote_deliver") == hinted["cached"] // BLOCK_TOKENS * BLOCK_BYTES
    )
    for result in ("partial", "failed"):
        assert counter(stats, 1, DURATIONS, f"remote_deliver,{result}") == 0
    assert counter(stats, 1, DURATIONS, "remote_deliver,success") >= 1
    print(f"\nFIGURE two_ranks start_s={start_s} telemetry={stats}")

    # The source holds only Q's first half: that prefix is pulled, the rest recomputed.
    half = engine.generate(q, rank=1, hint={"endpoint": source, "hashes": engine.hashes(q)})

    assert half["cached"] == 5 * BLOCK_TOKENS
    assert half["tokens"] == on_rank_0["q"]["tokens"]
