"""The transfer poller (runtime/transfers.py) under MockClock: local copies whose transport
says when they end are completed on that word, without polling for them every 0.2 ms, and a
peer transfer tracked meanwhile is polled at once, not after the poller's long sleep."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

import pytest
import trio
import trio.testing

from kvcr.logs import get_logger
from kvcr.runtime.transfers import NOTIFIED_POLL_S, Transfers, Xfer
from kvcr.transport.base import XferState


class NotifyingTransport:
    """Local copies end when the test says so, and say so on an eventfd (as the copy
    pool's threads do)."""

    def __init__(self) -> None:
        self.states: dict[str, XferState] = {}
        self.polls: list[tuple[float, str]] = []
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def post_local_read(self, dst: Sequence[int], src: Sequence[int], what: str) -> str:
        self.states[what] = XferState.PROC
        return what

    def local_done_fd(self) -> int:
        return self.fd

    def drain_local_done(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)

    def poll(self, handle: str) -> XferState:
        self.polls.append((trio.current_time(), handle))
        return self.states[handle]

    def release(self, handle: str) -> None:
        pass

    def finish(self, handle: str) -> None:
        self.states[handle] = XferState.DONE
        os.eventfd_write(self.fd, 1)  # what the copy thread does


@pytest.fixture
async def world(autojump_clock: trio.testing.MockClock):  # type: ignore[no-untyped-def]
    transport = NotifyingTransport()
    transfers = Transfers(transport, get_logger("kvcr.test"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(transfers.run)
        await trio.sleep(0.001)  # the poller waits on the eventfd
        yield transport, transfers
        nursery.cancel_scope.cancel()
    os.close(transport.fd)


def copy(transfers: Transfers, what: str, ended: list[Xfer]) -> Xfer:  # type: ignore[type-arg]
    return transfers.start([0], [1], what, 4096, ended.append)


async def test_a_local_copy_ends_on_its_word_and_is_not_polled_meanwhile(world) -> None:
    transport, transfers = world
    ended: list[Xfer] = []
    xfer = copy(transfers, "deposit op 1", ended)

    await trio.sleep(0.005)
    assert [h for _, h in transport.polls] == ["deposit op 1"]  # the check at post only
    started = trio.current_time()
    transport.finish("deposit op 1")
    await xfer.done.wait()

    # The word had it checked (one poll, in the loop's thread), long before a fallback poll.
    assert [h for _, h in transport.polls] == ["deposit op 1"] * 2
    assert trio.current_time() - started < NOTIFIED_POLL_S / 10
    assert ended == [xfer] and xfer.ok


async def test_a_peer_transfer_tracked_during_a_copy_is_polled_at_once(world) -> None:
    transport, transfers = world
    ended: list[Xfer] = []
    copy(transfers, "deposit op 2", ended)
    await trio.sleep(0.002)  # the poller sleeps long: only a copy is in flight

    transport.states["write"] = XferState.PROC
    started = trio.current_time()
    peer = transfers.track("write", "source write", 4096, ended.append)
    transport.states["write"] = XferState.DONE
    await peer.done.wait()

    # Polled at the fast cadence from now on, not after the rest of a 10 ms sleep.
    assert trio.current_time() - started < NOTIFIED_POLL_S / 10
