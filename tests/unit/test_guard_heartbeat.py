"""Heartbeats and fencing without a service: the pure book of one lease's beats
(``heartbeat.Beats``), and the fence itself (``fencing.fence_when_silent``) under trio's
MockClock, against a real child process and its real pidfd (SIGKILL is real)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import trio
import trio.testing

from kvcr.guard.fencing import UNKILLABLE_AFTER_S, fence_when_silent
from kvcr.guard.guard import Guard
from kvcr.guard.heartbeat import MIN_GAP_S, Beats, Verdict
from kvcr.guard.pools import create_group_file, plan_group
from kvcr.guard.protocol import ClaimRequest
from kvcr.guard.rules import Groups, GroupState, Lease
from kvcr.logs import capture_events, get_logger

TIMEOUT_S = 1.0


def test_an_accepted_beat_moves_the_deadline() -> None:
    beats = Beats(TIMEOUT_S, last=10.0)
    assert beats.deadline == 11.0
    assert beats.beat(0, 10.05) is Verdict.ACCEPTED
    assert beats.deadline == pytest.approx(11.05)
    assert beats.missed(11.0) is None
    assert beats.missed(11.05) == pytest.approx(1.0)


def test_duplicates_and_floods_never_keep_a_holder_alive() -> None:
    beats = Beats(TIMEOUT_S, last=0.0)
    assert beats.beat(5, 0.05) is Verdict.ACCEPTED
    # The same number again, or an older one, however late: no sign of life.
    assert beats.beat(5, 0.5) is Verdict.DUPLICATE
    assert beats.beat(4, 0.9) is Verdict.DUPLICATE
    # A new number sooner than any holder beats: a flood, not a sign of life.
    assert beats.beat(6, 0.05 + MIN_GAP_S / 2) is Verdict.EARLY
    assert beats.deadline == pytest.approx(1.05)  # unchanged by all of them
    # The next real beat (a number above the flood's) counts again.
    assert beats.beat(7, 0.1) is Verdict.ACCEPTED and beats.deadline == pytest.approx(1.1)


def test_the_grant_counts_as_the_first_beat() -> None:
    beats = Beats(TIMEOUT_S, last=3.0)
    assert beats.missed(3.999) is None and beats.missed(4.0) == pytest.approx(1.0)
    assert beats.beat(0, 3.0 + MIN_GAP_S / 2) is Verdict.EARLY  # right on the grant's heels


@pytest.fixture
def child() -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def lease_of(proc: subprocess.Popen[bytes]) -> Lease:
    return Lease(7, proc.pid)


async def test_a_silent_holder_is_killed_at_its_deadline_not_before(child, autojump_clock) -> None:
    pidfd = os.pidfd_open(child.pid)
    beats = Beats(TIMEOUT_S, last=trio.current_time())
    fenced_at: list[float] = []

    def fence(lease: Lease) -> bool:
        fenced_at.append(trio.current_time())
        return True

    try:
        with capture_events() as events:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    fence_when_silent, beats, lease_of(child), pidfd, fence, get_logger("t")
                )
                # Beats come for a while, then stop: the deadline follows the last one.
                for _ in range(5):
                    await trio.sleep(0.05)
                    assert beats.beat(beats.seq + 1, trio.current_time()) is Verdict.ACCEPTED
                last = beats.last
                await trio.sleep(TIMEOUT_S + UNKILLABLE_AFTER_S + 0.5)
        assert fenced_at == [pytest.approx(last + TIMEOUT_S)]
        assert child.wait(10) == -signal.SIGKILL
        fenced = [e for e in events if e["event"] == "holder_fenced"]
        assert len(fenced) == 1
        assert fenced[0]["pid"] == child.pid and fenced[0]["timeout_ms"] == 1000
        assert fenced[0]["missed_ms"] >= 1000
        # Nobody cancelled it (the Guard's wait on the pidfd does, at the exit): it says the
        # holder outlived its SIGKILL, which is what an uninterruptible holder does.
        assert [e["event"] for e in events][-1] == "holder_unkillable"
    finally:
        os.close(pidfd)


async def test_a_lease_that_ended_meanwhile_is_not_fenced(child, autojump_clock) -> None:
    pidfd = os.pidfd_open(child.pid)
    try:
        beats = Beats(TIMEOUT_S, last=trio.current_time())
        with capture_events() as events:
            await fence_when_silent(
                beats, lease_of(child), pidfd, lambda lease: False, get_logger("t")
            )
        assert events == [] and child.poll() is None  # untouched
    finally:
        os.close(pidfd)


async def test_a_lease_granted_right_after_a_release_is_still_fenced(
    tmp_path, autojump_clock
) -> None:
    """The release ends the old lease's watch, but the Guard's task only finishes ending it
    at its next turn: a claim granted before that turn must not lose its beats' deadline
    (a holder that then stopped was never fenced)."""
    page = os.sysconf("SC_PAGE_SIZE")
    groups = Groups(1, [page], "d")
    guard = Guard(
        0, create_group_file(tmp_path, 0, plan_group([page])), groups, get_logger("t"), None, 1.0
    )
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    second = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(guard.run)
            one = groups.grant(claim(first.pid), 5000)
            guard.watch(one, os.pidfd_open(first.pid))
            await trio.sleep(0.5)
            guard.released(one.number)
            two = groups.grant(claim(second.pid), 5000)  # in the same turn as the release
            guard.watch(two, os.pidfd_open(second.pid))
            # The second holder never beats: fenced one timeout after its grant.
            await trio.sleep(1.2)
            assert groups[0].state is GroupState.FENCING
            assert second.wait(10) == -signal.SIGKILL
            nursery.cancel_scope.cancel()
        assert first.poll() is None  # released, never signalled
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait()
        guard.close()


def claim(pid: int) -> ClaimRequest:
    return ClaimRequest(
        guard_index=0,
        pool_layouts=[("", 4096)],
        compatibility_digest="d",
        control_host="127.0.0.1",
        control_port=0,
        g3=None,
        remote_fw_dram_backend="UCX",
        pid=pid,
    )
