"""One rank, kvcr-owned G2 (``secondary_g2_slots``): a prompt that vLLM's KV cache and its
CPU tier have both evicted is served again from kvcr, byte-exact (the same greedy output),
and kvcr's telemetry agrees with the tiering manager's byte counts."""

from __future__ import annotations

import pytest
from tiny_model import BLOCK_BYTES, BLOCK_TOKENS
from vllm_harness import BLOCKS, BYTES, TIER_READ, TIER_WRITE, counter, kvcr_tier, prompt

from procs import free_port

pytestmark = pytest.mark.vllm


def test_an_evicted_prompt_comes_back_from_kvcr_g2(engines) -> None:
    # 24 KV blocks and 12 CPU chunks hold about two and one 10-block prompts; kvcr's 64
    # slots hold all five prompts this test sends.
    engine = engines(kvcr_tier([free_port()], secondary_g2_slots=64), gpu_blocks=24, cpu_chunks=12)
    engine.wait_ready()
    first = engine.generate(prompt(0))
    assert first["cached"] == 0
    for seed in (1, 2, 3):  # push prompt 0 out of the KV cache and the CPU tier
        assert engine.generate(prompt(seed))["cached"] == 0

    again = engine.generate(prompt(0))

    assert again["cached"] > 0 and again["cached"] % BLOCK_TOKENS == 0
    assert again["tokens"] == first["tokens"]

    def settled(stats: dict) -> bool:
        return counter(stats, 0, TIER_READ, "1:kvcr") == counter(
            stats, 0, BYTES, "local_deliver"
        ) > 0 and counter(stats, 0, TIER_WRITE, "1:kvcr") == counter(stats, 0, BYTES, "local_fill")

    stats = engine.wait_stats(settled, "kvcr's bytes equal to the tier's")
    delivered = counter(stats, 0, BLOCKS, "local_deliver")
    # Every cached block of the second run came out of kvcr: neither vLLM tier had any.
    assert delivered == again["cached"] // BLOCK_TOKENS
    assert counter(stats, 0, BYTES, "local_deliver") == delivered * BLOCK_BYTES
    filled = counter(stats, 0, BLOCKS, "local_fill")
    assert filled >= 40 and counter(stats, 0, BYTES, "local_fill") == filled * BLOCK_BYTES
