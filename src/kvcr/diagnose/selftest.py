"""The self-test: one NIXL agent with the UCX backend copies N MiB between two of its own
registered buffers (one loopback WRITE), and the bytes are compared.

The buffers are shared anonymous mappings, 4 KiB pages, as engines hand kvcr its memory
(see nixl-on-cpu.md: huge pages would measure a faster copy than kvcr ever gets). The first
transfer lands on untouched pages, so it is reported apart from the steady state.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import statistics
import time
from typing import Any

import numpy as np

from kvcr.diagnose import nixl_loader
from kvcr.diagnose.backends import UCX_FIX
from kvcr.diagnose.result import CheckResult

NAME = "self_test"
MIB = 1 << 20
TRANSFER_TIMEOUT_S = 10.0
STEADY_RUNS = (3, 10)  # at least, at most
STEADY_BUDGET_S = 0.5
# Below this a loopback copy is not using CMA (TCP on lo runs ~1.1 GB/s) or the host is
# starved; CMA on 4 KiB pages runs ~4-5.5 GB/s on the 2-core reference machine.
SLOW_GBPS = 1.5

FAILED_FIX = (
    "a local NIXL transfer over UCX fails: see the ucx and ucx_lo checks (CMA, TCP on lo), "
    "unset UCX_TLS, and rerun with UCX_LOG_LEVEL=info for UCX's view"
)

# Memory a transfer may still write to after a timeout: never unmapped, so that a late
# write lands in memory this process still owns.
_abandoned: list[Any] = []


class _Failed(Exception):
    def __init__(self, summary: str, fix: str) -> None:
        super().__init__(summary)
        self.summary = summary
        self.fix = fix


class _Abandon(_Failed):
    """A transfer did not end: its memory and agent must outlive this check."""


def _buffer(nbytes: int) -> np.ndarray:
    # The array keeps its mapping alive: it is unmapped when the last view goes.
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


def _run(agent: Any, handle: Any, what: str) -> float:
    """Post the prepared transfer and poll it to DONE; returns its duration in seconds."""
    start = time.perf_counter()
    state = agent.transfer(handle)
    deadline = start + TRANSFER_TIMEOUT_S
    while state == "PROC":
        if time.perf_counter() > deadline:
            raise _Abandon(f"{what}: not done after {TRANSFER_TIMEOUT_S:.0f} s", FAILED_FIX)
        state = agent.check_xfer_state(handle)
    elapsed = time.perf_counter() - start
    if state != "DONE":
        raise _Failed(f"{what}: NIXL reports {state}", FAILED_FIX)
    return elapsed


def _verify(src: np.ndarray, dst: np.ndarray, what: str) -> None:
    if not np.array_equal(src.view(np.uint64), dst.view(np.uint64)):
        first = int(np.flatnonzero(src != dst)[0])
        raise _Failed(
            f"{what}: DONE, but the destination differs from the source at byte {first}",
            "NIXL reported a copy that did not happen: report this with the --json output "
            "(NIXL, UCX and kernel versions are in it)",
        )


def _transfer(nixl: nixl_loader.Nixl, src: np.ndarray, dst: np.ndarray) -> dict[str, Any]:
    nbytes = src.nbytes
    name = f"kvcr-diagnose-selftest-{os.getpid()}"
    setup = time.perf_counter()
    agent = nixl.agent(name, nixl.config(enable_prog_thread=False, backends=[]))
    try:
        agent.create_backend("UCX", {})
    except Exception as exc:
        raise _Failed(f"UCX backend: {type(exc).__name__}: {exc}", UCX_FIX) from exc
    with contextlib.ExitStack() as cleanup:
        for buf, label in ((src, "src"), (dst, "dst")):
            registration = agent.register_memory([(buf.ctypes.data, nbytes, 0, label)], "DRAM")
            cleanup.callback(agent.deregister_memory, registration)
        # A loopback WRITE: the local list is src, the "remote" one dst under the agent's
        # own name.
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(src.ctypes.data, nbytes, 0)], "DRAM")
        cleanup.callback(local.release)
        remote = agent.prep_xfer_dlist(name, [(dst.ctypes.data, nbytes, 0)], "DRAM")
        cleanup.callback(remote.release)
        handle = agent.make_prepped_xfer("WRITE", local, [0], remote, [0])
        cleanup.callback(agent.release_xfer_handle, handle)
        setup_s = time.perf_counter() - setup
        try:
            first = _run(agent, handle, "first transfer")
            _verify(src, dst, "first transfer")
            dst.fill(0)  # so that the steady runs are checked too, not the first one again
            durations: list[float] = []
            began = time.perf_counter()
            while len(durations) < STEADY_RUNS[0] or (
                len(durations) < STEADY_RUNS[1] and time.perf_counter() - began < STEADY_BUDGET_S
            ):
                durations.append(_run(agent, handle, f"transfer {len(durations) + 2}"))
            _verify(src, dst, "steady transfers")
        except _Abandon:
            _abandoned.append((agent, src, dst, cleanup.pop_all()))
            raise
    gbps = [nbytes / d / 1e9 for d in durations]
    return {
        "first_touch_gb_per_s": round(nbytes / first / 1e9, 2),
        "steady_gb_per_s": round(statistics.median(gbps), 2),
        "best_gb_per_s": round(max(gbps), 2),
        "steady_runs": len(gbps),
        "setup_s": round(setup_s, 3),
    }


def check(mib: int | None) -> CheckResult:
    """``mib``: the size of each buffer; None skips the test."""
    if mib is None:
        return CheckResult.skipped(NAME, "--skip-self-test")
    try:
        nixl = nixl_loader.load()
    except nixl_loader.NixlUnavailable as exc:
        return CheckResult.fail(NAME, f"NIXL does not import: {exc}", nixl_loader.REINSTALL)
    details: dict[str, Any] = {
        "mib": mib,
        "bytes": mib * MIB,
        "operation": "WRITE",
        "backend": "UCX",
        "memory": "shared anonymous mmap, 4 KiB pages",
        "bytes_verified": False,
    }
    try:
        src, dst = _buffer(mib * MIB), _buffer(mib * MIB)
        # Unique 8-byte words: a misplaced piece of the copy shows as a difference.
        src.view(np.uint64)[:] = np.arange(src.nbytes // 8, dtype=np.uint64)
        details |= _transfer(nixl, src, dst)
        details["bytes_verified"] = True
    except _Failed as exc:
        return CheckResult.fail(NAME, exc.summary, exc.fix, details)
    except Exception as exc:
        return CheckResult.fail(NAME, f"{type(exc).__name__}: {exc}", FAILED_FIX, details)
    summary = (
        f"{mib} MiB WRITE: {details['steady_gb_per_s']} GB/s steady "
        f"(median of {details['steady_runs']}, best {details['best_gb_per_s']}), first touch "
        f"{details['first_touch_gb_per_s']} GB/s; bytes verified"
    )
    if details["steady_gb_per_s"] < SLOW_GBPS:
        return CheckResult.warn(
            NAME,
            summary,
            f"under {SLOW_GBPS} GB/s: the copy is probably going over TCP instead of CMA "
            "(see the ucx check), or the machine is overloaded; rerun when it is idle",
            details,
        )
    return CheckResult.ok(NAME, summary, details)
