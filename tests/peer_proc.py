"""Child program for the two-process NIXL tests: one NixlTransport with one pool.

Run as ``python peer_proc.py FD NAME COUNT SIZE FILL``: FD is this end of a socketpair,
the pool is COUNT slots of SIZE bytes filled with FILL. The parent sends pickled
``(command, *args)`` tuples and gets one reply each (an exception is sent back as
``("error", text)``). While "loud" (the default) the child calls ``notifications()`` every
~0.5 ms and records each one with a digest of the pool taken when it arrived; "silent"
makes it stop calling into NIXL until the next command.
"""

from __future__ import annotations

import hashlib
import sys
import time
from multiprocessing.connection import Connection

import numpy as np

from kvcr.transport.base import Segment, TransportError
from kvcr.transport.nixl import NixlTransport

POLL_S = 0.0005


def main() -> None:
    fd, name, count, size, fill = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    conn = Connection(int(fd))
    pool = np.full(count * size, fill, dtype=np.uint8)
    transport = NixlTransport(name)
    transport.open_local([Segment("pool", pool.ctypes.data, size, count)])
    notes: list[tuple[str, bytes, str]] = []
    loud = True

    def drain() -> None:
        for sender, message in transport.notifications():
            notes.append((sender, message, hashlib.sha256(pool).hexdigest()))

    def write(src: list[int], dst: list[tuple[int, int]], peer: str, notif: bytes) -> str:
        xfer = transport.post_write(src, dst, peer, notif, "child write")
        deadline = time.monotonic() + 5
        try:
            while time.monotonic() < deadline:
                state = transport.poll(xfer)
                if state.terminal:
                    return state.value
                time.sleep(POLL_S)
            return "PROC"
        finally:
            transport.release(xfer)

    def wait_notes(timeout: float) -> list[tuple[str, bytes, str]]:
        deadline = time.monotonic() + timeout
        while not notes and time.monotonic() < deadline:
            drain()
            time.sleep(POLL_S)
        out = list(notes)
        notes.clear()
        return out

    conn.send(("ready", transport.metadata(), pool.ctypes.data))
    while True:
        if not conn.poll(POLL_S if loud else None):
            drain()
            continue
        command, *args = conn.recv()
        try:
            if command == "exit":
                transport.close()
                conn.send(None)
                return
            if command == "silent":
                loud = False
                reply: object = None
            elif command == "loud":
                loud = True
                reply = None
            elif command == "add_peer":
                reply = transport.add_peer(args[0])
            elif command == "notes":
                reply = wait_notes(args[0])
            elif command == "pool":
                reply = pool.tobytes()
            elif command == "write":
                reply = write(*args)
            else:
                reply = ("error", f"unknown command {command!r}")
        except TransportError as exc:
            reply = ("error", str(exc))
        conn.send(reply)
        if loud:
            drain()


if __name__ == "__main__":
    main()
