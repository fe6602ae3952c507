"""Sub-millisecond sleeps for polling NIXL.

trio's timers wake in whole milliseconds (epoll's timeout), about 1.1 ms for any short
sleep. A peer transfer needs three progress calls in turn across two processes (the
destination calls into NIXL, the source sees DONE and sends the notification, the
destination reads it), so millisecond polling alone added ~2 ms to every pull. A timerfd
armed for the interval and awaited like any other fd wakes on time, and the thread still
sleeps in epoll (no spinning, the GIL released).

Only the real transport uses it: under trio's MockClock, sleeps must be trio sleeps.
"""

from __future__ import annotations

import ctypes
import os

import trio

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


# PyDLL: these calls are short and never block, and keeping the GIL across them avoids a
# hand-over to a busy engine thread (~15 µs each).
_libc = ctypes.PyDLL(None, use_errno=True)
_create = _libc.timerfd_create
_create.argtypes = [ctypes.c_int, ctypes.c_int]
_create.restype = ctypes.c_int
_settime = _libc.timerfd_settime
_settime.argtypes = [
    ctypes.c_int,
    ctypes.c_int,
    ctypes.POINTER(_Itimerspec),
    ctypes.POINTER(_Itimerspec),
]
_settime.restype = ctypes.c_int
_read = _libc.read
_read.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
_read.restype = ctypes.c_ssize_t


class FineTimer:
    """One task's sub-millisecond sleep (one timer per sleeping task)."""

    def __init__(self) -> None:
        fd = _create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self._fd = fd
        self._spec = _Itimerspec()
        self._buf = ctypes.c_uint64()

    async def sleep(self, seconds: float) -> None:
        nanos = max(int(seconds * 1e9), 1000)
        self._spec.it_value.tv_sec, self._spec.it_value.tv_nsec = divmod(nanos, 1_000_000_000)
        if _settime(self._fd, 0, ctypes.byref(self._spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")
        await trio.lowlevel.wait_readable(self._fd)
        _read(self._fd, ctypes.byref(self._buf), 8)

    def wake(self) -> None:
        """End the current sleep now (from the task's own trio thread). A wake while not
        sleeping is forgotten: the next sleep re-arms the timer, which clears it."""
        if self._fd < 0:
            return
        wake = _Itimerspec()
        wake.it_value.tv_nsec = 1  # zero would disarm it
        _settime(self._fd, 0, ctypes.byref(wake), None)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            trio.lowlevel.notify_closing(fd)
            os.close(fd)


class TrioSleep:
    """trio's own sleep (MockClock tests), ended early by ``wake`` as the timerfd's is."""

    def __init__(self) -> None:
        self._scope: trio.CancelScope | None = None

    async def sleep(self, seconds: float) -> None:
        with trio.CancelScope() as self._scope:
            await trio.sleep(seconds)
        self._scope = None

    def wake(self) -> None:
        if self._scope is not None:
            self._scope.cancel()

    def close(self) -> None:
        pass


def sleeper(fine: bool) -> FineTimer | TrioSleep:
    """A sleep for one task (``sleep``, ``wake``, ``close``): a timerfd for the real
    transport, trio's own sleep otherwise (MockClock tests)."""
    return FineTimer() if fine else TrioSleep()


# How often the runtime polls NIXL while something is in flight: tightly (every 50 µs) for
# the first 2 ms of a busy period, fast (every 0.2 ms) while it is young or its data is
# due, slowly (every millisecond) after. Transfers and the peer control plane's progress
# loop both poll at this cadence.
#
# Why the tight tier: a small pull ends with two NIXL calls in turn in two processes (the
# destination's, after which the source's write is DONE; the source's, which sends the
# notification; then the destination's, which reads it), and at 0.2 ms each waited ~0.2-0.5
# ms for its poll: traced, a 1 x 64 KiB pull spent 0.7 ms of its 1.6 ms over raw NIXL
# there; polling every 50 µs on both sides took 0.6 ms off, at no CPU measurable at that
# rate (each poll is one NIXL call). After 2 ms a pull is big, and 50 µs polls would only
# take the GIL from the engine.
TIGHT_POLL_S = 0.00005
TIGHT_WINDOW_S = 0.002
FAST_POLL_S = 0.0002
SLOW_POLL_S = 0.001
FAST_WINDOW_S = 0.01


def poll_interval(now: float, busy_since: float, due: float = 0.0) -> float:
    """The next poll's delay, ``busy_since`` being when the busy period began and ``due``
    when the data in flight should have landed (0: unknown)."""
    if now < busy_since + TIGHT_WINDOW_S:
        return TIGHT_POLL_S
    return FAST_POLL_S if now < max(busy_since + FAST_WINDOW_S, due) else SLOW_POLL_S
