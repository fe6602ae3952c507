"""One vLLM engine (``AsyncLLM``, one or more data-parallel ranks) driven over stdin.

``python engine_proc.py CONFIG_JSON`` starts vLLM's real engine with kvcr as a secondary
tier of its CPU tier (through ``copy_worker.CpuCopyTieringSpec``), then reads one JSON
command a line from stdin and answers each on stdout with one line that starts with
``KVCR-TEST `` (vLLM logs to stdout too; the prefix tells answers from logs):

- ``{"op": "generate", "tokens": [...], "max_tokens": N, "rank": R, "hint": H}``: one
  greedy request (``rank``/``hint`` optional; ``hint`` is ``{"endpoint", "hashes"}``);
  answers ``{"tokens": [...], "cached": num_cached_tokens, "elapsed_s": seconds}``;
- ``{"op": "hashes", "tokens": [...]}``: the router's block hashes of a prompt (vLLM's
  ``hash_block_tokens`` chain, sha256, the low 64 bits of each), as a router computes them;
- ``{"op": "stats"}``: every counter of the offloading connector's stats so far, summed
  per engine (data-parallel rank), and each histogram's count as ``NAME_count``:
  ``{rank: {metric: {"label,label": value}}}``;
- ``{"op": "pids"}``: the pids of the engine-core processes;
- ``{"op": "exit"}``: shut the engine down and exit 0.

Startup ends with ``{"ready": true, "start_s": seconds}``, or ``{"error": text}`` and
exit 1 when the engine fails to start.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
import traceback
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

PREFIX = "KVCR-TEST "


def answer(value: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(value) + "\n")
    sys.stdout.flush()


# Counters summed per engine index, filled by CountingLogger inside the frontend process.
COUNTERS: dict[int, dict[str, dict[str, float]]] = defaultdict(
    lambda: defaultdict(lambda: defaultdict(float))
)


def make_logger_class() -> type:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class CountingLogger(StatLoggerBase):
        """Sums the offloading connector's counters each engine reports per step."""

        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            stats = getattr(scheduler_stats, "kv_connector_stats", None)
            if not stats:
                return
            types = stats.get("types", {})
            for name, values in stats.get("data", {}).items():
                kind = types.get(name)
                for labels, value in values.items():
                    label = ",".join(labels)
                    if kind == "counter":
                        COUNTERS[engine_idx][name][label] += value
                    elif kind == "histogram":
                        COUNTERS[engine_idx][name + "_count"][label] += len(value)

        def log_engine_initialized(self) -> None:
            return None

    return CountingLogger


def engine_args(config: dict[str, Any]) -> Any:
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    extra = {
        "spec_name": "CpuCopyTieringSpec",
        "spec_module_path": "copy_worker",
        "cpu_bytes_to_use": config["cpu_chunks"] * config["chunk_bytes"],
        "self_describing_kv_events": True,
        "secondary_tiers": config["tiers"],
    }
    return AsyncEngineArgs(
        model=config["model"],
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype="bfloat16",
        seed=0,
        max_model_len=512,  # 16 blocks: a 24-block KV cache holds one request,
        block_size=32,
        gpu_memory_utilization=0.05,
        enable_prefix_caching=True,
        num_gpu_blocks_override=config["gpu_blocks"],
        max_num_seqs=4,
        max_num_batched_tokens=512,
        enforce_eager=True,
        data_parallel_size=config.get("dp", 1),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            # Names vLLM's offload-region files, /dev/shm/vllm_offload_{engine_id}*.mmap.
            engine_id=config["engine_id"],
        ),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )


def router_hashes(tokens: list[int], block_tokens: int) -> list[int]:
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)
    hashes: list[int] = []
    parent = None
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        parent = kv_cache_utils.hash_block_tokens(
            sha256, parent, tokens[start : start + block_tokens]
        )
        hashes.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return hashes


async def generate(engine: Any, command: dict[str, Any]) -> dict[str, Any]:
    from vllm.inputs import TokensPrompt
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    from vllm import SamplingParams

    hints = None
    if (hint := command.get("hint")) is not None:
        hints = KvHintsEnvelope(
            protocol_version="0.1",
            message_id=uuid.uuid4().hex,
            actions=[
                KvHintAction(
                    action_id=uuid.uuid4().hex,
                    action_type="kv.fetch",
                    action_version="1.0",
                    payload={
                        "source_control_endpoint": hint["endpoint"],
                        "block_hashes": hint["hashes"],
                    },
                )
            ],
        )
    params = SamplingParams(
        temperature=0.0, max_tokens=command.get("max_tokens", 8), detokenize=False
    )
    final = None
    async for output in engine.generate(
        TokensPrompt(prompt_token_ids=command["tokens"]),
        params,
        request_id=uuid.uuid4().hex,
        data_parallel_rank=command.get("rank"),
        kv_hints=hints,
    ):
        final = output
    assert final is not None
    return {
        "tokens": list(final.outputs[0].token_ids),
        "cached": int(final.num_cached_tokens or 0),
    }


def engine_pids() -> list[int]:
    import psutil

    return [
        child.pid
        for child in psutil.Process().children(recursive=True)
        if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name()
    ]


def read_stdin(loop: asyncio.AbstractEventLoop) -> asyncio.Queue[str]:
    """stdin's lines (then ``""``) from a thread of its own: not from the loop's default
    executor, whose threads vLLM's frontend may keep busy."""
    lines: asyncio.Queue[str] = asyncio.Queue()

    def read() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(lines.put_nowait, "")

    threading.Thread(target=read, name="engine-proc-stdin", daemon=True).start()
    return lines


async def serve(config: dict[str, Any]) -> int:
    from vllm.v1.engine.async_llm import AsyncLLM

    started = time.monotonic()
    try:
        engine = AsyncLLM.from_engine_args(engine_args(config), stat_loggers=[make_logger_class()])
    except Exception as error:  # the engine's own startup failure, reported whole
        answer({"error": "".join(traceback.format_exception(error))})
        return 1
    answer({"ready": True, "start_s": round(time.monotonic() - started, 2)})
    lines = read_stdin(asyncio.get_running_loop())
    try:
        while True:
            line = await lines.get()
            if not line:
                return 0
            command = json.loads(line)
            op = command["op"]
            if op == "generate":
                began = time.monotonic()
                result = await generate(engine, command)
                answer({**result, "elapsed_s": round(time.monotonic() - began, 3)})
            elif op == "hashes":
                answer({"hashes": router_hashes(command["tokens"], config["block_tokens"])})
            elif op == "stats":
                await asyncio.sleep(0)  # let a step's stats that arrived be recorded
                answer({str(k): v for k, v in COUNTERS.items()})
            elif op == "pids":
                answer({"pids": engine_pids()})
            elif op == "exit":
                return 0
            else:
                answer({"error": f"unknown op {op!r}"})
    finally:
        engine.shutdown()


def main() -> int:
    config = json.loads(sys.argv[1])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    os.environ.setdefault("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
