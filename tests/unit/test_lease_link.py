"""A hold's tie to its service (``guard/lease_link.py``) over a real socketpair standing in
for the lease's link: the hold's thread beats until a runtime keeps the link, the runtime's
loop beats instead, the link's end is the service's death (``lost``), and re-attaching is
retried until granted (``back``), a refusal logged once per reason."""

from __future__ import annotations

import socket
import threading

import pytest
import trio

from kvcr.errors import KVCRGuardProtocolError, KVCRSocketError
from kvcr.guard import lease_link
from kvcr.guard import protocol as wire
from kvcr.guard.lease_link import THREAD_NAME, Grant, Tie
from kvcr.logs import capture_events, get_logger

BEAT_S = 0.01
LOG = get_logger("kvcr.test")


def beats_from(service: socket.socket, count: int) -> list[wire.Heartbeat]:
    """Read ``count`` beats off the service's end (blocking, bounded)."""
    service.settimeout(5)
    reader, got = wire.FrameReader(), []
    while len(got) < count:
        data = service.recv(4096)
        assert data, "the link ended"
        got += reader.feed(data)
    assert all(isinstance(b, wire.Heartbeat) for b in got)
    return got  # type: ignore[return-value]


def beat_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == THREAD_NAME]


@pytest.fixture
def link() -> tuple[socket.socket, socket.socket]:
    hold_end, service_end = socket.socketpair()
    yield hold_end, service_end
    hold_end.close()
    service_end.close()


def no_reattach() -> Grant:
    raise KVCRSocketError("nobody listens")


def test_the_holds_thread_beats_with_growing_numbers_until_the_tie_closes(link) -> None:
    hold_end, service_end = link
    tie = Tie(3, Grant(41, hold_end, BEAT_S), no_reattach, LOG)
    try:
        got = beats_from(service_end, 3)
        assert [(b.guard_index, b.lease) for b in got] == [(3, 41)] * 3
        assert [b.seq for b in got][:3] == [0, 1, 2]
        assert beat_threads() == [THREAD_NAME]
    finally:
        tie.close()
    assert beat_threads() == [] and hold_end.fileno() == -1


def test_without_beats_required_the_tie_only_watches_for_the_end(link) -> None:
    hold_end, service_end = link
    with capture_events() as events:
        tie = Tie(0, Grant(1, hold_end, 0.0), no_reattach, LOG)
        service_end.setblocking(False)
        with pytest.raises(BlockingIOError):
            service_end.recv(1)  # nothing was sent
        service_end.close()  # the service died
        for _ in range(200):
            if tie.lost:
                break
            threading.Event().wait(0.01)
        tie.close()
    assert tie.lost and [e["event"] for e in events] == ["guard_lost"]


async def test_a_runtime_keeps_the_link_then_reattaches_after_the_service_died(
    link, monkeypatch
) -> None:
    monkeypatch.setattr(lease_link, "REATTACH_FIRST_S", 0.001)
    hold_end, service_end = link
    new_hold, new_service = socket.socketpair()
    answers: list[object] = [
        KVCRGuardProtocolError("refused (digest_mismatch): use the old digest"),
        KVCRGuardProtocolError("refused (digest_mismatch): use the old digest"),
        KVCRSocketError("cannot connect"),
        Grant(42, new_hold, BEAT_S),
    ]

    def reattach() -> Grant:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        assert isinstance(answer, Grant)
        return answer

    tie = Tie(5, Grant(41, hold_end, BEAT_S), reattach, LOG)
    calls: list[str] = []
    back = trio.Event()
    try:
        with capture_events() as events, trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(tie.keep, lambda: calls.append("lost"), back.set)
                while beat_threads():  # the runtime's loop beats from now on
                    await trio.sleep(0.001)
                got = await trio.to_thread.run_sync(beats_from, service_end, 2)
                assert all(b.lease == 41 for b in got)
                service_end.close()  # the service dies
                await back.wait()
                assert tie.lease == 42 and not tie.lost
                again = await trio.to_thread.run_sync(beats_from, new_service, 2)
                assert [(b.lease, b.seq) for b in again][:2] == [(42, 0), (42, 1)]
                nursery.cancel_scope.cancel()
        assert calls == ["lost"] and answers == []
        names = [e["event"] for e in events]
        assert names.count("guard_lost") == 1 and names.count("guard_reattached") == 1
        # The same refusal twice is said once; a service not listening yet is no news.
        assert names.count("reattach_refused") == 1
        assert beat_threads() == [THREAD_NAME]  # cancelled: the hold's thread beats again
    finally:
        tie.close()
        new_service.close()
    assert beat_threads() == []
