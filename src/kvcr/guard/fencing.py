"""Fencing a holder that stopped beating: past its heartbeat deadline it is sent SIGKILL
through its pidfd.

A pidfd names one process, never a later one that reuses the pid, so the signal cannot hit
a stranger. The lease is not ended here: the Guard's wait on the same pidfd ends it once the
process has exited, so no takeover ever reads pools a live holder could still write. A
process in uninterruptible I/O dies only when the I/O ends: the Guard waits for it, and the
log says so once :data:`UNKILLABLE_AFTER_S` has passed.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import trio

from kvcr.guard.heartbeat import Beats
from kvcr.guard.rules import Lease

UNKILLABLE_AFTER_S = 1.0  # a fenced holder still alive this long after SIGKILL is logged


async def fence_when_silent(
    beats: Beats, lease: Lease, pidfd: int, fence: Callable[[Lease], bool], log: Any
) -> None:
    """Sleep until ``beats`` says the holder of ``lease`` missed its deadline; then, if
    ``fence(lease)`` agrees (the lease is still held), SIGKILL the holder through ``pidfd``.
    Run it beside the wait on ``pidfd``, which ends the lease; cancelled with that wait."""
    while True:
        await trio.sleep_until(beats.deadline)
        missed = beats.missed(trio.current_time())
        if missed is not None:
            break
    if not fence(lease):
        return  # released meanwhile
    log.warning(
        "holder_fenced",
        lease=lease.number,
        pid=lease.pid,
        missed_ms=round(1000 * missed),
        timeout_ms=round(1000 * beats.timeout_s),
        reason="no heartbeat from the holder's runtime in time: SIGKILL, then take over",
    )
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        return  # exited already: the pidfd is (or is about to be) readable
    await trio.sleep(UNKILLABLE_AFTER_S)
    log.warning(
        "holder_unkillable",
        lease=lease.number,
        pid=lease.pid,
        seconds=UNKILLABLE_AFTER_S,
        reason="still alive after SIGKILL (uninterruptible I/O?); the lease ends when it exits",
    )
