"""kvcr's main job, end to end, on this machine: reuse across workers, and survival of a crash.

    uv run python examples/demo.py            # about 20 s; --blocks N for a bigger prefix

1. A guard service starts, owning two pool groups in shared memory.
2. Worker A (group 0) computes a prompt prefix and deposits it into its kvcr pool.
3. Requests with that prefix go to worker B (group 1) with the router's hint "at A": B pulls
   the blocks from A peer to peer over NIXL, a batch per request.
4. A is SIGKILLed. The guard notices (it holds A's pidfd) and serves A's committed blocks
   on A's endpoint: B's next requests are served by A's guard.
5. A's replacement claims group 0: the guard hands the pools back and it starts warm.

Every block B receives is checked against the checksum of what A computed. The summary
table shows what moved, how fast, and how long recovery and handback took.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from kvcr_workers import Guard, Worker, hits

BLOCK_SIZE = 512 * 1024
BATCH = 16  # blocks per request
MIB = 1 << 20


class Display:
    """One live line per phase on a terminal (plain lines otherwise), then the table."""

    def __init__(self) -> None:
        self.live = sys.stdout.isatty()
        self.started = time.monotonic()

    def progress(self, phase: str, done: int, total: int, unit: str = "blocks") -> None:
        if not self.live and done < total:
            return
        width = 24
        bar = "#" * (width * done // max(total, 1))
        line = f"{self._clock()} {phase:<44} [{bar:<{width}}] {done}/{total} {unit}"
        print(("\r" + line) if self.live else line, end="" if done < total else "\n", flush=True)

    def note(self, text: str) -> None:
        print(f"{self._clock()} {text}", flush=True)

    def _clock(self) -> str:
        return f"[{time.monotonic() - self.started:5.1f}s]"


def pull_in_requests(
    display: Display, phase: str, b: Worker, endpoint: str, prefix: list[int], expected: dict
) -> tuple[int, float, int]:
    """B serves requests for the prefix, a batch each, pulling from ``endpoint``.
    Returns (blocks received, seconds inside deliver, checksums verified)."""
    received, seconds, verified = 0, 0.0, 0
    display.progress(phase, 0, len(prefix))
    for start in range(0, len(prefix), BATCH):
        batch = prefix[start : start + BATCH]
        result = b("deliver", batch, endpoint, f"{phase}-{start}")
        ok = [h for h in batch if result["status"][h] == "SUCCESS"]
        bad = [h for h in ok if result["crc"][h] != expected[h]]
        if bad:
            raise SystemExit(f"{phase}: blocks {bad} differ from what A computed")
        received += len(ok)
        verified += len(ok)
        seconds += result["seconds"]
        display.progress(phase, start + len(batch), len(prefix))
    return received, seconds, verified


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=128, help="prefix blocks (512 KiB each)")
    args = parser.parse_args(argv)
    prefix = list(range(10_000, 10_000 + args.blocks))
    nbytes = args.blocks * BLOCK_SIZE
    pool_gb = max(2 * nbytes, 64 * MIB) / (1 << 30)
    display = Display()
    rows: list[tuple[str, str, str, str, str]] = []

    def row(what: str, blocks: int, seconds: float, checked: str = "") -> None:
        rate = f"{blocks * BLOCK_SIZE / seconds / 1e9:.2f}" if blocks and seconds else "-"
        size = f"{blocks * BLOCK_SIZE / MIB:.0f}" if blocks else "-"
        rows.append((what, size, f"{seconds * 1e3:.1f}", rate, checked))

    with tempfile.TemporaryDirectory() as tmp:
        display.note("starting kvcr-guard with 2 pool groups and workers A and B")
        guard = Guard(Path(tmp), groups=2, size_gb=pool_gb)
        workers: list[Worker] = []

        def worker(name: str, group: int, port: int | None = None) -> Worker:
            spec = dict(block_size=BLOCK_SIZE, engine_blocks=BATCH * 2)
            w = Worker(name, **spec, guard=(guard.socket_path, group), port=port)
            workers.append(w)
            return w

        try:
            a, b = worker("worker-a", 0), worker("worker-b", 1)
            display.note(f"A serves peers at {a.endpoint}; B at {b.endpoint}")

            expected: dict[int, int] = {}
            deposit_s = 0.0
            for start in range(0, len(prefix), BATCH):
                done = a("compute_and_deposit", prefix[start : start + BATCH])
                expected.update(done["crc"])
                deposit_s += done["seconds"]
                display.progress("A computes and deposits the prefix", start + BATCH, len(prefix))
            row("A: engine -> kvcr pool (deposit)", len(prefix), deposit_s)

            got, seconds, verified = pull_in_requests(
                display, "B pulls the prefix from A (router hint)", b, a.endpoint, prefix, expected
            )
            row("B <- A, peer to peer over NIXL", got, seconds, f"{verified}/{len(prefix)}")

            a.kill()
            display.note("A is SIGKILLed")
            recovery = guard.wait_for_state(0, "serving")
            display.note(f"the guard serves A's group {recovery * 1e3:.0f} ms after the kill")
            rows.append(("guard takes over A's group", "-", f"{recovery * 1e3:.1f}", "-", ""))

            got2, seconds2, verified2 = pull_in_requests(
                display, "B pulls the prefix from A's guard", b, a.endpoint, prefix, expected
            )
            row("B <- A's guard (A is dead)", got2, seconds2, f"{verified2}/{len(prefix)}")

            a2 = worker("worker-a2", 0, port=a.port)
            handback = a2("startup_seconds")  # KVCR(...): claim, handback, warm start
            warm = hits(a2("query", prefix))
            display.note(f"A's replacement is up in {handback:.2f} s, warm: {warm}/{len(prefix)}")
            hits_text = f"{warm}/{len(prefix)} hits"
            rows.append(
                ("A2 claims A's group: warm start", "-", f"{handback * 1e3:.0f}", "-", hits_text)
            )

            got3, seconds3, verified3 = pull_in_requests(
                display, "B pulls the prefix from A's replacement", b, a.endpoint, prefix, expected
            )
            row("B <- A2 (warm replacement)", got3, seconds3, f"{verified3}/{len(prefix)}")
            moved = b("bytes_moved").get("remote_deliver", 0)
        finally:
            for w in workers:
                if w.proc.is_alive():
                    w.stop()
            guard.stop()

    headers = ("step", "MiB", "ms", "GB/s", "checksums")
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    print()
    for line in [headers, tuple("-" * w for w in widths), *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)))
    verified_all = verified + verified2 + verified3
    print(
        f"\nB received {moved / MIB:.0f} MiB from peers; {verified_all} of "
        f"{3 * len(prefix)} blocks verified against A's checksums; A2 started warm with "
        f"{warm} of {len(prefix)} blocks. Total {time.monotonic() - display.started:.1f} s."
    )
    ok = verified_all == 3 * len(prefix) and warm == len(prefix)
    print("demo: OK" if ok else "demo: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
