"""Peer-to-peer reuse: worker B pulls the blocks worker A computed, sent there by a router hint.

    uv run python examples/two_workers.py

Two kvcr workers run in child processes, each with its own engine memory, kvcr pool, NIXL
agent and ZMQ control endpoint on 127.0.0.1. Worker A computes a 16-block prompt prefix
and deposits it into its pool. A request with the same prefix goes to worker B with the
router's hint "those blocks are at A's endpoint": B's query says they are fetchable from a
peer, and B's deliver pulls them into its engine memory in one NIXL transfer. The
checksums show that B got A's bytes; a request without the hint would have been a miss.
"""

from kvcr_workers import Worker

BLOCK_SIZE = 256 * 1024
PREFIX = list(range(1000, 1016))  # the prefix's block hashes, as the router knows them


def main() -> None:
    a = Worker("worker-a", block_size=BLOCK_SIZE, engine_blocks=32, pool_blocks=64)
    b = Worker("worker-b", block_size=BLOCK_SIZE, engine_blocks=32, pool_blocks=64)
    try:
        computed = a("compute_and_deposit", PREFIX)["crc"]
        print(f"A computed and deposited {len(PREFIX)} blocks; A's endpoint is {a.endpoint}")

        print("B without a hint:", set(b("query", PREFIX)))
        pulled = b("deliver", PREFIX, a.endpoint, "request-1")
        statuses = set(pulled["status"].values())
        same = pulled["crc"] == computed
        nbytes = len(PREFIX) * BLOCK_SIZE
        print(
            f"B with the router's hint to A: {statuses}, {nbytes >> 20} MiB in "
            f"{pulled['seconds'] * 1e3:.1f} ms"
        )
        print("B's blocks have A's checksums:", same)
        print("bytes moved:", {"A": a("bytes_moved"), "B": b("bytes_moved")})
        assert statuses == {"SUCCESS"} and same
    finally:
        a.stop()
        b.stop()


if __name__ == "__main__":
    main()
