"""Commands from engine threads to the runtime, with coalesced wake-ups.

An engine call appends a command to a deque (~0.1 µs) and, only if the runtime is not
already due to wake, writes an eventfd (~1 µs). ``TrioToken.run_sync_soon`` would cost the
engine ~20 µs per call (nixl-on-cpu.md), the whole budget of an engine-facing call.

Ordering argument for the flag: the runtime clears ``_armed`` *before* draining, and the
engine appends *before* testing ``_armed``. So a command appended after the drain started
either is seen by that drain or finds ``_armed`` clear and writes the eventfd.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from typing import Any

import trio


class Inbox:
    def __init__(self) -> None:
        self._queue: deque[Any] = deque()
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._armed = False

    def put(self, command: Any) -> None:
        """Thread-safe and never blocks."""
        self._queue.append(command)
        if not self._armed:
            self._armed = True
            # A closed fd means the runtime is gone and will not read it anyway.
            with contextlib.suppress(OSError):
                os.eventfd_write(self._fd, 1)

    async def get_batch(self) -> list[Any]:
        """Wait until at least one command is queued; return all queued commands."""
        while True:
            self._armed = False
            batch = []
            while self._queue:
                batch.append(self._queue.popleft())
            if batch:
                return batch
            await trio.lowlevel.wait_readable(self._fd)
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._fd)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
