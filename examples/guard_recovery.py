"""Crash recovery: a worker dies, the guard service serves its blocks, its replacement starts warm.

    uv run python examples/guard_recovery.py

A guard service owns two pool groups in shared memory. Worker A runs over group 0 and
computes a prefix; worker B, over group 1, pulls it from A's endpoint, as a router hint
says. Then A is SIGKILLed. The guard notices at once (it holds A's pidfd) and starts
serving A's committed blocks on A's endpoint, so B's next request for the prefix still
succeeds. Finally A's replacement claims group 0: the guard hands the group back, and the
replacement starts warm, with every block of the prefix a local hit.
"""

import tempfile
from pathlib import Path

from kvcr_workers import Guard, Worker, hits

BLOCK_SIZE = 256 * 1024
PREFIX = list(range(2000, 2016))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        guard = Guard(Path(tmp), groups=2, size_gb=0.0625)  # 64 MiB pools per group
        workers: list[Worker] = []
        try:

            def worker(name: str, group: int, port: int | None = None) -> Worker:
                w = Worker(
                    name,
                    block_size=BLOCK_SIZE,
                    engine_blocks=32,
                    guard=(guard.socket_path, group),
                    port=port,
                )
                workers.append(w)
                return w

            a, b = worker("worker-a", 0), worker("worker-b", 1)
            computed = a("compute_and_deposit", PREFIX)["crc"]
            first = b("deliver", PREFIX, a.endpoint, "request-1")
            print("B pulled the prefix from A:", set(first["status"].values()))

            a.kill()
            recovery = guard.wait_for_state(0, "serving")
            print(f"A was SIGKILLed; the guard serves group 0 after {recovery * 1e3:.0f} ms")
            print(guard.status_table())
            second = b("deliver", PREFIX, a.endpoint, "request-2")
            print("B pulled the prefix again, from A's guard:", set(second["status"].values()))

            replacement = worker("worker-a2", 0, port=a.port)  # A's group and endpoint
            warm = hits(replacement("query", PREFIX))
            print(
                f"A's replacement started in {replacement('startup_seconds'):.2f} s, warm: "
                f"{warm} of {len(PREFIX)} prefix blocks are local hits"
            )
            print(guard.status_table())
            assert first["crc"] == second["crc"] == computed
            assert warm == len(PREFIX)
            print("every copy has A's checksums")
        finally:
            for w in workers:
                if w.proc.is_alive():
                    w.stop()
            guard.stop()


if __name__ == "__main__":
    main()
