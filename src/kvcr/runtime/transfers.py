"""Transfers in flight, and the one task that polls them.

A transfer's lifetime is independent of the operation that posted it: an operation can time
out or be aborted, but the memory its transfer touches stays held until the transport
reports the transfer terminal. So completion work (freeing slots, dropping claims) hangs
off the transfer as ``on_terminal`` callbacks, which the poller runs on the runtime thread
exactly once, whatever happened to the operation.

Polling: NIXL runs without its spinning progress thread, so the poller calls into it every
0.2 ms for the first 10 ms of a busy period (a timerfd: trio's own timers wake in whole
milliseconds), then every millisecond, and not at all when nothing is in flight (idle
costs no CPU). A peer write becomes DONE, and its
notification leaves, only when the source polls it after the destination called into
NIXL, so a slower poll here is latency added to every peer transfer. Local copies run on
copy threads (``transport/copier.py``): the one that ends a copy says so on an eventfd,
which a task here waits on, so the copy is checked at once in the loop's thread; while only
copies are in flight the poller barely wakes (every 10 ms), not to take a core from them.

NIXL's file backends do their work inside polls (64 descriptors a poll: ~0.5 ms for 64 KiB
blocks), so the G3 tier's poller is ``busy``: it polls back to back while something is in
flight (a 1 ms cadence would triple the time of a 16 MiB batch) and lets the other tasks
run once per millisecond (a scheduler pass costs tens of µs, more when the GIL changes
hands).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import attrs
import trio

from kvcr.runtime.timer import FineTimer, TrioSleep, poll_interval, sleeper
from kvcr.transport.base import LocalDoneWord, Transport, XferPoller, XferState

BUSY_YIELD_S = 0.001  # the longest a busy poller polls without letting other tasks run
# ... and then how long it sleeps. A checkpoint alone releases the GIL only for the instant
# of a zero-timeout epoll; retaking it every millisecond defeats CPython's forced switch
# (each retake counts as a switch), so an engine thread waiting for the GIL could wait for
# seconds. A real sleep this short lets it in.
BUSY_PAUSE_S = 0.0001
# A peer write of a few blocks is DONE within ~0.1-0.2 ms of its post, once the
# destination called into NIXL; the poller's first look came only after the handler that
# posted it and a trio batch (~0.2 ms) and then its timer. Traced on a 1 x 64 KiB pull,
# polling the write back to back this long right after its post saw DONE 0.3 ms sooner
# (with the destination's 50 µs progress polls: timer.py). The runtime keeps the GIL for at
# most this long per write; a longer write is left to the poller.
WRITE_SETTLE_S = 0.0002
# With only local copies in flight, on a transport that says when they end, the poller
# waits for that word; this is the poll it still makes, in case a word was lost.
NOTIFIED_POLL_S = 0.01


@attrs.define(eq=False)
class Xfer:
    handle: object
    what: str
    nbytes: int
    done: trio.Event = attrs.field(factory=trio.Event)
    state: XferState = XferState.PROC
    on_terminal: list[Callable[[Xfer], None]] = attrs.field(factory=list)
    error: str = ""  # why it ended in ERR: the transport's words
    local: bool = False  # a copy inside the process (start), not a transfer followed (track)

    @property
    def ok(self) -> bool:
        return self.state is XferState.DONE


_T = TypeVar("_T", bound=XferPoller)


class Transfers(Generic[_T]):
    """Generic in the transport: local copies (``start``) need a full :class:`Transport`;
    following transfers posted elsewhere (``track``) only an :class:`XferPoller`."""

    def __init__(self, transport: _T, log: Any, fine: bool = False, busy: bool = False) -> None:
        self.transport = transport
        self._fine = fine
        self._busy = busy
        self._log = log
        self._in_flight: set[Xfer] = set()
        self._work = trio.Event()
        self._idle = trio.Event()
        self._idle.set()
        self._timer: FineTimer | TrioSleep | None = None  # the poller's, while it runs

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def start(
        self: Transfers[Transport],
        dst: Sequence[int],
        src: Sequence[int],
        what: str,
        nbytes: int,
        on_terminal: Callable[[Xfer], None],
    ) -> Xfer:
        """Post a local copy. Raises TransportError if it could not be posted (then nothing
        is in flight and ``on_terminal`` is not called)."""
        handle = self.transport.post_local_read(dst, src, what)
        return self.track(handle, what, nbytes, on_terminal, local=True)

    def track(
        self,
        handle: object,
        what: str,
        nbytes: int,
        on_terminal: Callable[[Xfer], None],
        local: bool = False,
        settle_s: float = 0.0,
    ) -> Xfer:
        """Follow a posted transfer until it is terminal, then run ``on_terminal``.
        ``settle_s``: poll it back to back for up to that long first (real time, the GIL
        kept: see :data:`WRITE_SETTLE_S`)."""
        xfer = Xfer(handle, what, nbytes, on_terminal=[on_terminal], local=local)
        self._in_flight.add(xfer)
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._check(xfer)  # small copies are done by the time post returns
        if settle_s and xfer in self._in_flight:
            until = time.perf_counter() + settle_s
            while xfer in self._in_flight and time.perf_counter() < until:
                self._check(xfer)
        if xfer in self._in_flight:
            self._work.set()
            if not local and self._timer is not None:
                self._timer.wake()  # the poller may be in a long sleep over copies alone
        return xfer

    def _check(self, xfer: Xfer) -> None:
        try:
            state = self.transport.poll(xfer.handle)
        except Exception as exc:
            self._log.error("transfer_poll_failed", what=xfer.what, error=str(exc))
            state = XferState.ERR
            xfer.error = str(exc)
        if state is XferState.ERR and not xfer.error:
            xfer.error = "the transport reported ERR"
        if state.terminal:
            self._finish(xfer, state)

    def cancel(self, xfer: Xfer) -> bool:
        """Abort a transfer that will not end by itself (a hung peer). True if the transport
        cancelled it: then nothing can touch its memory any more and it ends as ERR."""
        if xfer not in self._in_flight:
            return True
        try:
            self.transport.release(xfer.handle)
        except Exception as exc:
            self._log.warning("transfer_cancel_failed", what=xfer.what, error=str(exc))
            return False
        xfer.error = "cancelled: still running at abandon_timeout_ms"
        self._finish(xfer, XferState.ERR, released=True)
        return True

    def _finish(self, xfer: Xfer, state: XferState, released: bool = False) -> None:
        self._in_flight.discard(xfer)
        xfer.state = state
        try:
            if not released:
                self.transport.release(xfer.handle)
        except Exception as exc:
            self._log.warning("transfer_release_failed", what=xfer.what, error=str(exc))
        for callback in xfer.on_terminal:
            callback(xfer)
        xfer.done.set()
        if not self._in_flight:
            self._idle.set()

    async def _poll_back_to_back(self) -> None:
        # Real time, not trio's clock: this bounds how long the thread is held.
        turn = time.perf_counter() + BUSY_YIELD_S
        while self._in_flight and time.perf_counter() < turn:
            for xfer in list(self._in_flight):
                self._check(xfer)
        if self._timer is not None:
            await self._timer.sleep(BUSY_PAUSE_S)
        else:
            await trio.lowlevel.checkpoint()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    async def run(self) -> None:
        timer = self._timer = sleeper(self._fine)
        # Local copies end on copy threads, which say so on an eventfd (no GIL taken on
        # their side): its task has this poller check them at once, in the loop's thread,
        # instead of at its next poll.
        word = self.transport if isinstance(self.transport, LocalDoneWord) else None
        done_fd = None if word is None else word.local_done_fd()
        try:
            async with trio.open_nursery() as nursery:
                if word is not None and done_fd is not None:
                    nursery.start_soon(self._wait_local_done, word, done_fd)
                await self._poll(timer, notified=done_fd is not None)
        finally:
            self._timer = None
            timer.close()

    async def _poll(self, timer: FineTimer | TrioSleep, notified: bool) -> None:
        while True:
            if not self._in_flight:
                self._work = trio.Event()
                await self._work.wait()
            busy_since = trio.current_time()
            while self._in_flight:
                if self._busy:
                    await self._poll_back_to_back()
                    continue
                if notified and all(x.local for x in self._in_flight):
                    # Nothing to poll for: a wake-up now would only take a core from the
                    # copy threads.
                    interval = NOTIFIED_POLL_S
                else:
                    interval = poll_interval(trio.current_time(), busy_since)
                await timer.sleep(interval)
                for xfer in list(self._in_flight):
                    self._check(xfer)

    async def _wait_local_done(self, word: LocalDoneWord, fd: int) -> None:
        while True:
            await trio.lowlevel.wait_readable(fd)
            word.drain_local_done()
            self._local_done()

    def _local_done(self) -> None:
        """A local copy ended (a copy thread's word on the eventfd): check them now."""
        try:
            for xfer in [x for x in self._in_flight if x.local]:
                self._check(xfer)
        except Exception as exc:  # a completion callback failed: log it, keep polling
            self._log.exception("transfer_completion_failed", error=repr(exc))
