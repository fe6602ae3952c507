"""kvcr's main job, end to end, on this machine, each step's speed beside raw NIXL's.

    uv run python examples/demo.py       # 4-6 s wall on 2 cores, --blocks 32 too

The story (blocks of 512 KiB, 16 per engine operation, a prefix of --blocks, 128 blocks by
default):

1. A guard service starts with two pool groups in /dev/shm, each pool one prefix big;
   workers A (group 0) and B (group 1) start beside it.
2. A's engine computes two earlier prompts, then the shared prefix, and deposits each into
   its kvcr pool. The first prompt lands in pool memory no process touched yet; the second
   and the prefix land in a full pool, every deposit evicting older blocks (steady state).
3. Requests with the prefix go to B with the router's hint "at A": B pulls the blocks from A
   (a control round trip, then A writes them into B's engine memory in one NIXL WRITE).
4. A is SIGKILLed. The guard notices (it holds A's pidfd) and serves A's committed blocks on
   A's endpoint: B pulls the prefix from A's guard.
5. A's replacement A2 claims group 0: the guard hands the pools back, A2 starts warm, and B
   pulls the prefix from A2.

How it is measured. Each engine polls kvcr once per 0.5 ms scheduler step, sleeping between;
an operation is timed from the engine's call until the poll that returned its last entry.
Each pull step sends two 1-block requests (the first sets up the peer), then pulls the
prefix three times, 16 blocks a request: the first pass meets memory fresh to the process
that copies it, the other two are the steady state (as are A's second prompt and prefix).
Right after every steady kvcr operation, two bare NIXL agents in this process, without kvcr
and without NIXL's progress thread (as kvcr runs its agent), move the same bytes in the same
batches, polled at the same 0.5 ms step: a copy within one agent from its "engine" into its
"pool" buffer for a deposit (a loopback WRITE), a WRITE with a notification from one agent's
"pool" into the other's "engine" buffer for a pull. Every buffer, kvcr's and raw NIXL's, is
a shared mapping with 4 KiB pages, as engines and the guard give kvcr host memory; the run
prints the page sizes it finds. Every block B receives is checked against the checksum of
what A computed; the raw transfers' bytes are checked once.

Columns of the table:

- blocks, MiB: what the steady-state figures are over (the two steady passes);
- kvcr GB/s: those bytes over the sum of those operations' times, as the engine saw them;
- raw NIXL GB/s: the same bytes over the raw transfers' times; ratio: kvcr / raw. A kvcr
  deposit is no NIXL transfer but a memmove on kvcr's copy threads: its ratio may pass 1;
- poll wait: per steady operation, the engine's time minus kvcr's runtime's own (from taking
  the command until queueing the results): the engine's wait for its next poll (its sleep,
  then the GIL), plus handing the call to kvcr's thread. It is part of the kvcr GB/s;
- first touch / setup: what the steady state leaves out. First touch: the first pass minus
  a steady one (page faults; near 0, either sign, where nothing is fresh). Setup: the first
  1-block request to a peer minus the second (ZMQ hello, NIXL metadata, UCX connection;
  after a takeover, also noticing that another process now serves the endpoint).

These machines are noisy: read the ratios (kvcr and raw measured side by side), not GB/s
across runs. A request here is 8 MiB: kvcr's fixed costs per operation (the control round
trip, wake-ups across threads and processes, the poll) weigh more than in the larger
operations of benchmarks/p2p.py and benchmarks/copies.py, which also measure kvcr beside raw
NIXL on 4 KiB pages.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from kvcr_workers import (
    ENGINE_STEP_S,
    Guard,
    Worker,
    block_bytes,
    hits,
    page_kib,
    shared_pages,
)

# kvcr's transport/nixl_agent.py is the one place that imports nixl (and picks nixl_cu13 or the
# meta package); the raw baseline takes the agent class from there.
from kvcr.transport.nixl_agent import nixl_agent, nixl_agent_config

BLOCK_SIZE = 512 * 1024
BATCH = 16  # blocks per engine operation
ENGINE_BLOCKS = 2 * BATCH
STEADY_PASSES = 2  # passes over the prefix (or prompts) that the GB/s are measured over
MIB = 1 << 20
GIB = 1 << 30


class Display:
    """One live line per phase on a terminal (plain lines otherwise), then the table."""

    def __init__(self) -> None:
        self.live = sys.stdout.isatty()
        self.started = time.monotonic()

    def progress(self, phase: str, done: int, total: int, unit: str = "ops") -> None:
        if not self.live and done < total:
            return
        width = 24
        bar = "#" * (width * done // max(total, 1))
        line = f"{self._clock()} {phase:<40} [{bar:<{width}}] {done}/{total} {unit}"
        print(("\r" + line) if self.live else line, end="" if done < total else "\n", flush=True)

    def note(self, text: str) -> None:
        print(f"{self._clock()} {text}", flush=True)

    def _clock(self) -> str:
        return f"[{time.monotonic() - self.started:5.1f}s]"


@dataclass
class Step:
    """What one data-moving step measured: its steady operations (kvcr as the engine saw
    them, kvcr's runtime's own time, the raw transfer beside each) and its one-time costs."""

    name: str
    blocks: int = 0
    kvcr_s: list[float] = field(default_factory=list)
    runtime_s: list[float] = field(default_factory=list)
    raw_s: list[float] = field(default_factory=list)
    setup_s: float | None = None
    first_touch_s: float | None = None
    verified: int = 0  # blocks whose checksum matched A's


def batches(keys: Sequence[int]) -> list[tuple[int, list[int]]]:
    """(position in the sequence, keys) of each engine operation over ``keys``."""
    return [(start, list(keys[start : start + BATCH])) for start in range(0, len(keys), BATCH)]


class RawNixl:
    """Two bare NIXL agents in this process, no kvcr, each without NIXL's progress thread
    (as kvcr runs its agent): ``a`` stands for worker A (an engine buffer, and a pool buffer
    one prefix big), ``b`` for worker B (an engine buffer)."""

    def __init__(self, blocks: int) -> None:
        self.a_name, self.b_name = f"demo-raw-a-{os.getpid()}", f"demo-raw-b-{os.getpid()}"
        self.a, self.b = self._agent(self.a_name), self._agent(self.b_name)
        self.a_pool = shared_pages(blocks * BLOCK_SIZE)
        self.a_engine = shared_pages(ENGINE_BLOCKS * BLOCK_SIZE)
        self.b_engine = shared_pages(ENGINE_BLOCKS * BLOCK_SIZE)
        self.a_pool[:] = np.resize(np.arange(1, 252, dtype=np.uint8), self.a_pool.size)
        self.regs = [
            (self.a, self.a.register_memory([self._whole(self.a_pool)], "DRAM")),
            (self.a, self.a.register_memory([self._whole(self.a_engine)], "DRAM")),
            (self.b, self.b.register_memory([self._whole(self.b_engine)], "DRAM")),
        ]
        loaded = self.a.add_remote_agent(self.b.get_agent_metadata())
        assert (loaded.decode() if isinstance(loaded, bytes) else loaded) == self.b_name
        self.lists = [
            self.a.prep_xfer_dlist("NIXL_INIT_AGENT", self._descs(self.a_pool), "DRAM"),
            self.a.prep_xfer_dlist("NIXL_INIT_AGENT", self._descs(self.a_engine), "DRAM"),
            # Named by the agent's own name: a copy within the agent, as a deposit is.
            self.a.prep_xfer_dlist(self.a_name, self._descs(self.a_pool), "DRAM"),
            self.a.prep_xfer_dlist(self.b_name, self._descs(self.b_engine), "DRAM"),
        ]
        self.pool_src, self.engine_src, self.pool_dst, self.b_engine_dst = self.lists
        self.notes = 0
        self.first_write_s = self._check()

    @staticmethod
    def _agent(name: str) -> Any:
        agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        agent.create_backend("UCX", {})
        return agent

    @staticmethod
    def _whole(buf: np.ndarray) -> tuple[int, int, int, str]:
        return (buf.ctypes.data, buf.nbytes, 0, "")

    @staticmethod
    def _descs(buf: np.ndarray) -> list[tuple[int, int, int]]:
        return [
            (buf.ctypes.data + i * BLOCK_SIZE, BLOCK_SIZE, 0) for i in range(buf.size // BLOCK_SIZE)
        ]

    def _check(self) -> float:
        """Both transfers once, their bytes compared (a no-op cannot pass for a transfer).
        Returns the first WRITE's seconds: UCX connects the two agents on it."""
        count = min(BATCH, self.a_pool.size // BLOCK_SIZE)
        nbytes = count * BLOCK_SIZE
        first = self.pull(0, count)
        if not np.array_equal(self.b_engine[:nbytes], self.a_pool[:nbytes]):
            raise SystemExit("raw NIXL: the WRITE's bytes differ from its source's")
        self.deposit(0, range(count))
        if not np.array_equal(self.a_pool[:nbytes], self.a_engine[:nbytes]):
            raise SystemExit("raw NIXL: the copy's bytes differ from its source's")
        return first

    def deposit(self, start: int, keys: Sequence[int]) -> float:
        """Copy the engine's blocks of ``keys`` into pool blocks ``start..``; seconds. The
        engine computes them right before, as A's does (the same work, the same cache
        state)."""
        for i, key in enumerate(keys):
            self.a_engine[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE] = block_bytes(key, BLOCK_SIZE)
        slots = list(range(start, start + len(keys)))
        handle = self.a.make_prepped_xfer(
            "WRITE", self.engine_src, list(range(len(keys))), self.pool_dst, slots, b""
        )
        return self._timed(handle, lambda: True)

    def pull(self, start: int, count: int) -> float:
        """WRITE pool blocks ``start..`` into B's engine buffer with a notification, until
        B has the notification; seconds. B's engine buffer is zeroed first, as B's engine
        is before every deliver (the same cache state)."""
        self.b_engine.fill(0)
        self.notes += 1
        tag = b"pull-%d" % self.notes
        seen: list[bytes] = []

        def landed() -> bool:
            seen.extend(self.b.get_new_notifs().get(self.a_name, []))
            return tag in seen

        slots = list(range(start, start + count))
        handle = self.a.make_prepped_xfer(
            "WRITE", self.pool_src, slots, self.b_engine_dst, list(range(count)), tag
        )
        return self._timed(handle, landed)

    def _timed(self, handle: Any, landed: Callable[[], bool]) -> float:
        """Post A's ``handle``, then poll once per engine step, sleeping between, until it
        is DONE and ``landed()``; seconds. A poll calls B's side, A's, then B's again: a
        WRITE ends, and its notification is sent, only once both sides called into NIXL."""
        started = time.perf_counter()
        state = self.a.transfer(handle)
        seen = False
        while True:
            seen = landed() or seen
            if state == "PROC":
                state = self.a.check_xfer_state(handle)
            seen = landed() or seen
            if state == "DONE" and seen:
                break
            if state == "ERR":
                raise SystemExit("raw NIXL: a transfer failed")
            time.sleep(ENGINE_STEP_S)
        seconds = time.perf_counter() - started
        self.a.release_xfer_handle(handle)
        return seconds

    def close(self) -> None:
        for dlist in self.lists:
            dlist.release()
        self.a.remove_remote_agent(self.b_name)
        for agent, reg in self.regs:
            agent.deregister_memory(reg)


def deposit_step(
    display: Display, a: Worker, raw: RawNixl, prompts: list[list[int]]
) -> tuple[Step, dict[int, int]]:
    """A computes and deposits ``prompts`` in turn (the last is the prefix); returns the step
    and the prefix's checksums."""
    step = Step("A: engine -> kvcr pool (deposit)")
    total = sum(len(batches(p)) for p in prompts)
    done, first_pass = 0, 0.0
    crcs: dict[int, int] = {}
    for number, prompt in enumerate(prompts):
        for start, keys in batches(prompt):
            result = a("compute_and_deposit", keys)
            crcs.update(result["crc"])
            if number == 0:  # into pool memory no process touched yet
                first_pass += result["seconds"]
            else:
                step.kvcr_s.append(result["seconds"])
                step.runtime_s.append(result["runtime_seconds"])
                step.raw_s.append(raw.deposit(start, keys))
                step.blocks += len(keys)
            done += 1
            display.progress(f"A computes and deposits {len(prompts)} prompts", done, total)
    step.first_touch_s = first_pass - sum(step.kvcr_s) / (len(prompts) - 1)
    return step, {h: crcs[h] for h in prompts[-1]}


def pull_step(
    display: Display,
    name: str,
    b: Worker,
    source: Worker,
    prefix: list[int],
    expected: dict[int, int],
    raw: RawNixl,
) -> Step:
    """B's requests for the prefix, sent by the router's hint to ``source``'s endpoint
    (whoever serves it now: A, A's guard, A2): two 1-block requests (the first sets up the
    peer), one first pass, then the steady passes; every block checked."""
    step = Step(name)
    requests = itertools.count()

    def request(keys: list[int]) -> dict[str, Any]:
        result: dict[str, Any] = b("deliver", keys, source.endpoint, f"{name}-{next(requests)}")
        for h in keys:
            if result["status"][h] != "SUCCESS":
                raise SystemExit(f"{name}: block {h} was {result['status'][h]}")
            if result["crc"][h] != expected[h]:
                raise SystemExit(f"{name}: block {h} differs from what A computed")
        step.verified += len(keys)
        return result

    ops = batches(prefix)
    total = 2 + (1 + STEADY_PASSES) * len(ops)
    display.progress(name, 0, total)
    first = request(prefix[:1])["seconds"]
    step.setup_s = first - request(prefix[:1])["seconds"]
    first_pass = sum(request(keys)["seconds"] for _, keys in ops)
    display.progress(name, 2 + len(ops), total)
    for number in range(STEADY_PASSES):
        for done, (start, keys) in enumerate(ops, 1):
            result = request(keys)
            step.kvcr_s.append(result["seconds"])
            step.runtime_s.append(result["runtime_seconds"])
            step.raw_s.append(raw.pull(start, len(keys)))
            step.blocks += len(keys)
            display.progress(name, 2 + (1 + number) * len(ops) + done, total)
    step.first_touch_s = first_pass - sum(step.kvcr_s) / STEADY_PASSES
    return step


def table(steps: list[Step]) -> list[str]:
    """The summary table's lines: one row per data-moving step."""

    def ms(seconds: float | None) -> str:
        # + 0.0: a difference that rounds to zero from below shows as 0.0, not -0.0
        return "-" if seconds is None else f"{round(seconds * 1e3, 1) + 0.0:.1f} ms"

    rows = [
        (
            "step",
            "blocks",
            "MiB",
            "kvcr GB/s",
            "raw NIXL GB/s",
            "ratio",
            "poll wait",
            "first touch / setup",
        )
    ]
    for s in steps:
        nbytes = s.blocks * BLOCK_SIZE
        kvcr, raw = nbytes / sum(s.kvcr_s) / 1e9, nbytes / sum(s.raw_s) / 1e9
        wait = sum(s.kvcr_s) - sum(s.runtime_s)
        rows.append(
            (
                s.name,
                str(s.blocks),
                f"{nbytes / MIB:.0f}",
                f"{kvcr:.2f}",
                f"{raw:.2f}",
                f"{kvcr / raw:.2f}",
                f"{wait / len(s.kvcr_s) * 1e3:.2f} ms ({100 * wait / sum(s.kvcr_s):.0f} %)",
                f"{ms(s.first_touch_s)} / {ms(s.setup_s)}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths))
        )

    return [line(rows[0]), line(["-" * width for width in widths]), *map(line, rows[1:])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=128, help="prefix blocks (512 KiB each)")
    args = parser.parse_args(argv)
    if args.blocks < 1:
        parser.error("--blocks: at least 1")
    n = args.blocks
    prefix = list(range(10_000, 10_000 + n))
    # Earlier prompts fill the pool first: the first touches every slot, the later ones and
    # the prefix find the pool full (the steady state: every deposit evicts).
    prompts = [list(range(k << 20, (k << 20) + n)) for k in range(1, 1 + STEADY_PASSES)]
    prompts.append(prefix)
    display = Display()
    steps: list[Step] = []

    # The guard's pools in /dev/shm, as in production (kvcr-guard's --pool-dir): on a disk
    # filesystem every pool page would be page cache that the kernel writes back.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=shm, prefix="kvcr-demo-") as tmp:
        display.note(f"starting kvcr-guard (2 pool groups of {n} blocks), workers A and B")
        guard = Guard(Path(tmp), groups=2, size_gb=n * BLOCK_SIZE / GIB, wait=False)
        workers: list[Worker] = []
        raw: RawNixl | None = None

        def worker(name: str, group: int, port: int | None = None) -> Worker:
            w = Worker(
                name,
                block_size=BLOCK_SIZE,
                engine_blocks=ENGINE_BLOCKS,
                guard=(guard.socket_path, group),
                port=port,
                wait=False,  # they start side by side, then wait for the guard
            )
            workers.append(w)
            return w

        try:
            a, b = worker("worker-a", 0), worker("worker-b", 1)
            raw = RawNixl(n)
            guard.ready(), a.ready(), b.ready()
            display.note(f"A serves peers at {a.endpoint}; B at {b.endpoint}")
            a_pages, b_pages = a("pages"), b("pages")
            raw_pages = {
                page_kib(buf.ctypes.data) for buf in (raw.a_pool, raw.a_engine, raw.b_engine)
            }
            display.note(
                f"KiB per page: A's pool {a_pages['pool']}, A's engine {a_pages['engine']}, "
                f"B's engine {b_pages['engine']}, raw NIXL's buffers "
                + "/".join(map(str, sorted(raw_pages)))
            )

            step, expected = deposit_step(display, a, raw, prompts)
            steps.append(step)
            steps.append(pull_step(display, "B <- A (peer to peer)", b, a, prefix, expected, raw))

            a.kill()
            display.note("A is SIGKILLed")
            recovery = guard.wait_for_state(0, "serving")
            display.note(f"the guard serves A's group {recovery * 1e3:.0f} ms after the kill")
            steps.append(pull_step(display, "B <- A's guard (A dead)", b, a, prefix, expected, raw))

            a2 = worker("worker-a2", 0, port=a.port).ready()  # A's group and endpoint
            handback = a2("startup_seconds")  # KVCR(...): claim, handback, warm start
            warm = hits(a2("query", prefix))
            display.note(f"A's replacement A2 is up in {handback:.2f} s, warm: {warm}/{n}")
            steps.append(
                pull_step(display, "B <- A2 (A's replacement)", b, a, prefix, expected, raw)
            )
            moved = b("bytes_moved").get("remote_deliver", 0)
            raw_first = raw.first_write_s
        finally:
            for w in workers:
                if w.proc.is_alive():
                    w.stop()
            if raw is not None:
                raw.close()
            guard.stop()

    print()
    print("\n".join(table(steps)))
    verified = sum(s.verified for s in steps[1:])
    pulled = len(steps[1:]) * (2 + (1 + STEADY_PASSES) * n)
    print(
        f"\nraw NIXL's first WRITE to a new peer took {raw_first * 1e3:.1f} ms (UCX connects)."
        f"\nThe guard served A's group {recovery * 1e3:.0f} ms after the SIGKILL; A2 claimed it"
        f" back in {handback * 1e3:.0f} ms: A2 started warm with {warm} of {n} blocks."
        f"\nB received {moved / MIB:.0f} MiB from peers; {verified} of {pulled} blocks verified"
        f" against A's checksums; {time.monotonic() - display.started:.1f} s since the first"
        " line."
    )
    ok = verified == pulled and warm == n
    print("demo: OK" if ok else "demo: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
