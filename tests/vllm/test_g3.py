"""G3 per rank: two ranks share one ``g3`` config whose path holds ``{agent}``, so each rank
gets a file of its own; kvcr's G2 is small, so blocks spill to the files, and prompts that
vLLM's KV cache, its CPU tier and kvcr's G2 have all evicted come back from G3 through vLLM,
byte-exact."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_model import BLOCK_BYTES, BLOCK_TOKENS
from vllm_harness import BLOCKS, BYTES, TIER_READ, counter, kvcr_tier, prompt

from procs import free_port

pytestmark = pytest.mark.vllm


def test_blocks_spill_to_each_ranks_g3_file_and_come_back(engines, tmp_path: Path) -> None:
    files = tmp_path / "g3"
    files.mkdir()
    g3 = {
        "paths": [str(files / "{agent}.g3")],
        "capacity_bytes_per_file": 128 * BLOCK_BYTES,
        "backend": "POSIX",
    }
    ports = [free_port(), free_port()]
    engine = engines(
        kvcr_tier(ports, secondary_g2_slots=12, g3=g3), ranks=2, gpu_blocks=24, cpu_chunks=12
    )
    engine.wait_ready()
    firsts = {rank: engine.generate(prompt(30 + rank), rank=rank) for rank in (0, 1)}
    for seed in (40, 41, 42):  # push both prompts out of the KV caches, CPU tiers and G2
        for rank in (0, 1):
            assert engine.generate(prompt(seed + 10 * rank), rank=rank)["cached"] == 0

    agains = {rank: engine.generate(prompt(30 + rank), rank=rank) for rank in (0, 1)}

    blocks = 327 // BLOCK_TOKENS
    for rank in (0, 1):
        assert agains[rank]["cached"] == blocks * BLOCK_TOKENS
        assert agains[rank]["tokens"] == firsts[rank]["tokens"]

    def served_from_g3(stats: dict) -> bool:
        return all(
            counter(stats, rank, BLOCKS, "g3_deliver")
            + counter(stats, rank, BLOCKS, "local_deliver")
            == blocks
            for rank in (0, 1)
        )

    stats = engine.wait_stats(served_from_g3, "each rank's prompt delivered by kvcr")
    for rank in (0, 1):
        assert counter(stats, rank, BLOCKS, "g3_store") > 0
        assert counter(stats, rank, BLOCKS, "g3_deliver") > 0
        delivered = counter(stats, rank, BYTES, "g3_deliver") + counter(
            stats, rank, BYTES, "local_deliver"
        )
        assert delivered == blocks * BLOCK_BYTES == counter(stats, rank, TIER_READ, "1:kvcr")
    # One file per rank: {agent} expanded to each rank's NIXL agent name.
    assert len(list(files.glob("KVCR-*.g3"))) == 2, sorted(p.name for p in files.iterdir())
