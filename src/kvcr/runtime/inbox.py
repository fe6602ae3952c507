"""Commands from engine threads to the runtime, with coalesced wake-ups.

An engine call appends a command to a deque (~0.1 µs) and, only if the runtime is not
already due to wake, writes an eventfd (~1 µs). ``TrioToken.run_sync_soon`` would cost the
engine ~20 µs per call (nixl-on-cpu.md), the whole budget of an engine-facing call.

The eventfd is written through ``ctypes.PyDLL``, which keeps the GIL across the syscall.
``os.eventfd_write`` releases it, and the runtime thread it just woke could take the GIL
there and then: the engine's call would return only after the runtime's work (up to a
whole switch interval, 5 ms), which is what the engine-call p99 showed before this.

Ordering argument for the flag: the runtime clears ``_armed`` *before* draining, and the
engine appends *before* testing ``_armed``. So a command appended after the drain started
either is seen by that drain or finds ``_armed`` clear and writes the eventfd.
"""

from __future__ import annotations

import ctypes
import os
from collections import deque
from typing import Any

import trio

_libc = ctypes.PyDLL(None, use_errno=True)
_eventfd_write = _libc.eventfd_write
_eventfd_write.argtypes = [ctypes.c_int, ctypes.c_uint64]
_eventfd_write.restype = ctypes.c_int
# Reading keeps the GIL too: the fd is non-blocking, and each GIL hand-over costs the
# runtime ~15 µs while an engine thread is busy.
_eventfd_read = _libc.eventfd_read
_eventfd_read.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]
_eventfd_read.restype = ctypes.c_int


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
            # A failure means the fd is closed: the runtime is gone and will not read it.
            _eventfd_write(self._fd, 1)

    def take_now(self) -> list[Any]:
        """Everything queued right now, without waiting (a reader outside a trio loop)."""
        batch = []
        while self._queue:
            batch.append(self._queue.popleft())
        return batch

    async def get_batch(self) -> list[Any]:
        """Wait until at least one command is queued; return all queued commands."""
        while True:
            self._armed = False
            batch = self.take_now()
            if batch:
                return batch
            await trio.lowlevel.wait_readable(self._fd)
            _eventfd_read(self._fd, ctypes.byref(ctypes.c_uint64()))

    def close(self) -> None:
        """Close the eventfd now. Only for an owner that knows no thread can call put()
        any more (the guard's own server, which has no engine threads)."""
        self.__del__()

    def __del__(self) -> None:
        # Closed only when nothing can call put() any more: an fd closed earlier could be
        # reused by another file, which a late put() would then write into.
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
