"""Peer writes on real NIXL between two processes: this one (the source, mostly) and a child
running tests/peer_proc.py (the destination), joined by a socketpair for control."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import pytest

from kvcr.transport.base import Segment, TransportError, XferState
from kvcr.transport.nixl import NixlTransport
from kvcr.transport.nixl_agent import metadata_agent_name

pytestmark = pytest.mark.integration

CHILD = Path(__file__).resolve().parent.parent / "peer_proc.py"
SMALL = 64 << 10  # parent descriptors 0..63: 64 KiB slots
BIG = 1 << 20  # parent descriptors 64..104: 1 MiB slots
N_SMALL, N_BIG = 64, 41
FILL = 0xAB  # the child's pool before any write


class Child:
    """A destination process: one NixlTransport with ``count`` slots of ``size`` bytes."""

    def __init__(self, name: str, count: int, size: int) -> None:
        self.name, self.count, self.size = name, count, size
        ours, theirs = socket.socketpair()
        argv = [str(CHILD), str(theirs.fileno()), name, str(count), str(size), str(FILL)]
        self.proc = subprocess.Popen(
            [sys.executable, *argv],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        if not self.conn.poll(20):
            raise AssertionError(f"child {name!r} did not start")
        tag, self.metadata, self.addr = self.conn.recv()
        assert tag == "ready"

    def __call__(self, *command: object, timeout: float = 10) -> object:
        self.conn.send(command)
        if not self.conn.poll(timeout):
            raise AssertionError(f"child {self.name!r}: no answer to {command[0]!r}")
        reply = self.conn.recv()
        if isinstance(reply, tuple) and reply and reply[0] == "error":
            raise TransportError(reply[1])
        return reply

    def slot(self, i: int) -> tuple[int, int]:
        return self.addr + i * self.size, self.size

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self("exit", timeout=5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.kill()
        self.conn.close()


@pytest.fixture(scope="module")
def parent() -> Iterator[tuple[NixlTransport, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    small = rng.integers(0, 256, N_SMALL * SMALL, dtype=np.uint8)
    big = rng.integers(0, 256, N_BIG * BIG, dtype=np.uint8)
    transport = NixlTransport("peer-test-parent")
    transport.open_local(
        [
            Segment("small", small.ctypes.data, SMALL, N_SMALL),
            Segment("big", big.ctypes.data, BIG, N_BIG),
        ]
    )
    yield transport, small, big
    transport.close()


@contextlib.contextmanager
def child(name: str, count: int = 48, size: int = SMALL) -> Iterator[Child]:
    c = Child(name, count, size)
    try:
        yield c
    finally:
        c.stop()


def wait_terminal(transport: NixlTransport, xfer: object, timeout: float = 5) -> XferState:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = transport.poll(xfer)
        if state.terminal:
            return state
        time.sleep(0.0002)
    return XferState.PROC


def test_metadata_exchange_both_ways(parent) -> None:
    transport, small, _ = parent
    with child("peer-test-both") as c:
        assert metadata_agent_name(c.metadata) == "peer-test-both"
        assert transport.add_peer(c.metadata) == "peer-test-both"
        assert transport.add_peer(c.metadata) == "peer-test-both"  # idempotent
        assert c("add_peer", transport.metadata()) == "peer-test-parent"

        # The child writes its slots 3 and 4 into our slots 10 and 11; its write completes
        # only while we call into NIXL, so keep reading notifications until it answers.
        c.conn.send(
            (
                "write",
                [3, 4],
                [(small.ctypes.data + i * SMALL, SMALL) for i in (10, 11)],
                "peer-test-parent",
                b"hi parent",
            )
        )
        notes: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + 5
        while not c.conn.poll(0.0005) and time.monotonic() < deadline:
            notes += transport.notifications()
        assert c.conn.recv() == "DONE"
        for _ in range(20):
            notes += transport.notifications()
            if notes:
                break
            time.sleep(0.001)
        assert notes == [("peer-test-both", b"hi parent")]
        assert (small[10 * SMALL : 12 * SMALL] == FILL).all()
        transport.remove_peer("peer-test-both")


def test_a_batch_of_41_blocks_arrives_byte_exact_and_the_notification_after_the_data(
    parent,
) -> None:
    transport, small, _ = parent
    with child("peer-test-batch") as c:
        peer = transport.add_peer(c.metadata)
        rng = np.random.default_rng(3)
        src = [int(i) for i in rng.choice(N_SMALL, 41, replace=False)]
        slots = [int(i) for i in rng.permutation(c.count)[:41]]
        expected = np.full(c.count * SMALL, FILL, dtype=np.uint8)
        for s, d in zip(src, slots):
            expected[d * SMALL : (d + 1) * SMALL] = small[s * SMALL : (s + 1) * SMALL]

        xfer = transport.post_write(src, [c.slot(d) for d in slots], peer, b"batch 1", "test write")
        assert wait_terminal(transport, xfer) is XferState.DONE
        transport.release(xfer)

        notes = c("notes", 5.0)
        assert [(sender, message) for sender, message, _ in notes] == [
            ("peer-test-parent", b"batch 1")
        ]
        # the digest the child took when the notification arrived: all the data was there
        assert notes[0][2] == hashlib.sha256(expected).hexdigest()
        assert c("pool") == expected.tobytes()
        transport.remove_peer(peer)


def test_destinations_outside_the_peers_registered_memory_are_refused(parent) -> None:
    transport, _, _ = parent
    with child("peer-test-refuse", count=8) as c:
        peer = transport.add_peer(c.metadata)
        end = c.addr + c.count * SMALL
        for label, addr in [("before", c.addr - SMALL), ("straddling", end - 100), ("after", end)]:
            with pytest.raises(
                TransportError, match=rf"write {label}.*'peer-test-refuse'.*registered"
            ):
                transport.post_write([0], [(addr, SMALL)], peer, b"x", f"write {label}")
        with pytest.raises(TransportError, match=r"short write: destination 1 .* 4096 bytes"):
            transport.post_write([0, 1], [c.slot(0), (c.addr, 4096)], peer, b"x", "short write")
        with pytest.raises(TransportError, match=r"stray write: peer 'nobody' is not known"):
            transport.post_write([0], [c.slot(0)], "nobody", b"x", "stray write")
        with pytest.raises(TransportError, match=r"far write: source descriptor 999 out of range"):
            transport.post_write([999], [c.slot(0)], peer, b"x", "far write")
        assert c("notes", 0.05) == []
        assert c("pool") == bytes([FILL]) * (c.count * SMALL)
        transport.remove_peer(peer)


def test_a_restarted_destination_is_written_to_after_its_new_metadata_is_added(parent) -> None:
    transport, small, _ = parent
    name = "peer-test-restart"
    with child(name) as first:
        assert transport.add_peer(first.metadata) == name
        xfer = transport.post_write([0], [first.slot(0)], name, b"one", "first write")
        assert wait_terminal(transport, xfer) is XferState.DONE
        transport.release(xfer)
        first.kill()
    with child(name) as second:
        assert second.metadata != first.metadata
        assert transport.add_peer(second.metadata) == name  # replaces the dead process's
        xfer = transport.post_write([5, 6], [second.slot(1), second.slot(2)], name, b"two", "w2")
        assert wait_terminal(transport, xfer) is XferState.DONE
        transport.release(xfer)
        assert [(s, m) for s, m, _ in second("notes", 5.0)] == [("peer-test-parent", b"two")]
        pool = np.frombuffer(second("pool"), dtype=np.uint8)
        assert (pool[SMALL : 3 * SMALL] == small[5 * SMALL : 7 * SMALL]).all()
        transport.remove_peer(name)


def test_a_silent_destination_holds_the_write_in_proc_and_release_refuses_it(parent) -> None:
    transport, _, _ = parent
    with child("peer-test-silent") as c:
        peer = transport.add_peer(c.metadata)
        xfer = transport.post_write([1], [c.slot(0)], peer, b"warm", "warm-up")
        assert wait_terminal(transport, xfer) is XferState.DONE
        transport.release(xfer)
        assert [m for _, m, _ in c("notes", 5.0)] == [b"warm"]

        c("silent")  # no NIXL calls in the child until its next command
        xfer = transport.post_write([2], [c.slot(1)], peer, b"held", "held write")
        assert wait_terminal(transport, xfer, timeout=0.2) is XferState.PROC
        # Over TCP a released write is resumed, not cancelled: a write in flight is kept.
        with pytest.raises(TransportError, match=r"held write .*never cancelled"):
            transport.release(xfer)
        c("loud")
        assert wait_terminal(transport, xfer) is XferState.DONE
        transport.release(xfer)
        assert [m for _, m, _ in c("notes", 5.0)] == [b"held"]
        xfer = transport.post_write([3], [c.slot(2)], peer, b"next", "next write")
        assert wait_terminal(transport, xfer) is XferState.DONE
        transport.release(xfer)
        assert [m for _, m, _ in c("notes", 5.0)] == [b"next"]
        transport.remove_peer(peer)


def test_sigkill_of_the_destination_ends_the_write_with_a_transport_error(parent) -> None:
    transport, _, _ = parent
    with child("peer-test-kill", count=N_BIG, size=BIG) as c:
        peer = transport.add_peer(c.metadata)
        src = list(range(N_SMALL, N_SMALL + N_BIG))
        dst = [c.slot(i) for i in range(N_BIG)]
        xfer = transport.post_write(src, dst, peer, b"warm", "warm-up")
        assert wait_terminal(transport, xfer) is XferState.DONE
        transport.release(xfer)

        # The data moves inside post_write (CMA); the write then waits for the destination
        # to call into NIXL, which a silent child does not: PROC until the child dies.
        c("silent")
        xfer = transport.post_write(src, dst, peer, b"doomed", "doomed write")
        assert wait_terminal(transport, xfer, timeout=0.05) is XferState.PROC
        c.kill()
        killed = time.monotonic()
        with pytest.raises(
            TransportError, match=r"doomed write to peer 'peer-test-kill'.*disconnected"
        ):
            wait_terminal(transport, xfer, timeout=5)
        assert time.monotonic() - killed < 2
        transport.release(xfer)
        # a later write to the dead peer is refused when posted: it cannot be loaded again
        with pytest.raises(TransportError, match=r"late write: peer 'peer-test-kill' is disc"):
            transport.post_write(src, dst, peer, b"late", "late write")
        transport.remove_peer(peer)
