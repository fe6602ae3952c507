"""Heartbeat fencing (``kvcr-guard --heartbeat-timeout-ms``), with real processes and real
signals: a holder stopped by SIGSTOP misses its deadline, is SIGKILLed through its pidfd and
its committed blocks are served to a peer as after a crash; a holder paused for less than
the timeout keeps its claim; beats that are duplicated, out of turn or on the wrong
connection never keep a silent holder alive, and are refused or counted.

The workers are ``worker_proc.py`` children (their KVCR runtime beats from its own loop);
the peer is a KVCR in this process, over another group of the same service (it beats too).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from guard_metrics import group_value, metrics_url, scrape
from guard_world import BLOCK, GuardedWorker
from kvcr.guard import fdpass
from kvcr.guard import protocol as wire
from peer_world import key
from procs import GuardProcess, SourceWorker, wait_until

pytestmark = pytest.mark.integration

TIMEOUT_MS = 1000
SIZES = (BLOCK, 16, 32)  # block bytes, (unused) own pool blocks, engine region blocks


@pytest.fixture
def guard(tmp_path) -> Iterator[GuardProcess]:
    service = GuardProcess(
        tmp_path,
        pool_sizes_gb="0.03125",  # 512 blocks of 64 KiB
        extra=(
            *("--idle-timeout-s", "0.5", "--heartbeat-timeout-ms", str(TIMEOUT_MS)),
            *("--metrics-port", "0"),
        ),
    )
    try:
        yield service
    finally:
        assert service.stop() == 0, service.log()


def group_status(guard: GuardProcess, index: int) -> wire.GroupStatus:
    return guard.client.status()[index]


def deposited(worker: SourceWorker, base: int, count: int) -> dict[int, list[int]]:
    sums = worker("deposit", [(base + i, i, 7919 * (base + i)) for i in range(count)])
    assert {status for status, _ in sums.values()} == {"SUCCESS"}
    return {k: checksum for k, (_, checksum) in sums.items()}


def pulled(peer: GuardedWorker, source: SourceWorker, sums: dict[int, list[int]], tag: str):
    pairs = [(k, i) for i, k in enumerate(sums)]
    result = peer.pull(source, pairs, tag)
    return {k: peer.engine.checksum(i) for k, i in pairs if result[key(k)] == "SUCCESS"}


def test_a_stopped_holder_is_fenced_and_its_blocks_served_within_the_timeout(guard) -> None:
    peer = GuardedWorker(guard, 1)
    worker = SourceWorker("stopped", SIZES, guard=(guard.socket_path, 0, guard.digest))
    try:
        sums = deposited(worker, 100, 8)
        assert group_status(guard, 0).last_beat_ms is not None  # it beats
        stopped = time.monotonic()
        os.kill(worker.proc.pid, signal.SIGSTOP)
        wait_until(lambda: guard.states()[0] == ("serving", None), 10, "fence and takeover")
        got = pulled(peer, worker, sums, "after-fence")
        elapsed = time.monotonic() - stopped
        assert got == sums  # every committed block, byte-exact, from the guard
        assert elapsed <= TIMEOUT_MS / 1000 + 0.2, f"served {elapsed:.3f} s after the stop"
        assert worker.proc.wait(10) == -signal.SIGKILL
        assert group_status(guard, 0).fenced == 1
        samples = scrape(metrics_url(guard))
        assert group_value(samples, "kvcr_guard_fenced_total", 0) == 1
        assert group_value(samples, "kvcr_guard_fenced_total", 1) == 0
        log = guard.log()
        assert "holder_fenced" in log and f"pid={worker.proc.pid}" in log
        assert f"timeout_ms={TIMEOUT_MS}" in log
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT) if worker.proc.poll() is None else None
        worker.stop()
        peer.close()


def test_a_holder_paused_for_less_than_the_timeout_keeps_its_claim(guard) -> None:
    peer = GuardedWorker(guard, 1)
    worker = SourceWorker("paused", SIZES, guard=(guard.socket_path, 0, guard.digest))
    try:
        sums = deposited(worker, 200, 4)
        os.kill(worker.proc.pid, signal.SIGSTOP)
        time.sleep(TIMEOUT_MS / 2000)
        os.kill(worker.proc.pid, signal.SIGCONT)
        # Past the moment a fence would have come had the beats not resumed.
        time.sleep(TIMEOUT_MS / 1000)
        assert guard.states()[0] == ("held", worker.proc.pid)
        assert group_status(guard, 0).fenced == 0
        assert pulled(peer, worker, sums, "after-pause") == sums  # from the worker itself
        assert "holder_fenced" not in guard.log()
    finally:
        worker.stop()
        peer.close()


# A holder that claims with the real client, then stops its hold's beat thread and sends its
# own frames on the lease's link: argv[2] says which ("duplicate": seq 0 for ever).
ROGUE = textwrap.dedent(
    """
    import os, sys, time
    from kvcr import KVCRClient
    from kvcr.guard import protocol as wire
    hold = KVCRClient(sys.argv[1]).claim(0, [("", 4096)], sys.argv[3], ("127.0.0.1", 0))
    tie = hold.tie
    tie.stop_thread()
    link = tie._grant.link
    print("claimed", flush=True)
    seq = 0
    while True:
        beat = wire.Heartbeat(guard_index=0, lease=hold.lease, seq=seq)
        link.send(wire.encode_frame(beat))
        time.sleep(0.05)
    """
)


def test_duplicate_beats_do_not_keep_a_holder_alive(guard) -> None:
    rogue = subprocess.Popen(
        [sys.executable, "-c", ROGUE, guard.socket_path, "duplicate", guard.digest],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert rogue.stdout is not None and rogue.stdout.readline().strip() == "claimed"
        claimed = time.monotonic()
        # Only its first beat counts: fenced one timeout later, as if it were silent.
        assert rogue.wait(10) == -signal.SIGKILL
        assert time.monotonic() - claimed < TIMEOUT_MS / 1000 + 1
        wait_until(lambda: guard.states()[0][1] is None, what="lease ended")
        samples = scrape(metrics_url(guard))
        refused = ("kvcr_guard_heartbeats_refused_total", (("reason", "duplicate"),))
        assert samples[refused] >= 1
        log = guard.log()
        assert "heartbeat_ignored" in log and "kind='duplicate'" in log
        assert log.count("kind='duplicate'") == 1  # once per kind and link, not per beat
    finally:
        rogue.kill()
        rogue.wait()


def test_a_beat_from_a_connection_that_holds_no_claim_is_refused(guard) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(guard.socket_path)
        fdpass.send_frame_with_fds(sock, wire.Heartbeat(guard_index=0, lease=1, seq=1), [])
        reply, _ = fdpass.recv_message_with_fds(sock, wire.FrameReader(), 0)
        assert isinstance(reply, wire.ClaimRefused) and reply.code == "bad_request"
        assert "this connection holds no lease" in reply.message
        assert sock.recv(1) == b""  # and the connection is closed
    # A malformed beat is a framing error like any other.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(guard.socket_path)
        body = wire.encode(wire.Heartbeat(guard_index=0, lease=1, seq=1)).replace(b"seq", b"sez")
        sock.sendall(len(body).to_bytes(4, "big") + body)
        reply, _ = fdpass.recv_message_with_fds(sock, wire.FrameReader(), 0)
        assert isinstance(reply, wire.ClaimRefused) and reply.code == "bad_request"
        assert "guard frame 'beat': bad field" in reply.message
    assert guard.states()[0] == ("idle", None)  # the service goes on


def test_a_timeout_below_one_second_is_refused_with_the_reason(tmp_path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcr.kvcr_service",
            "--socket-path",
            str(tmp_path / "s"),
            "--pool-dir",
            str(tmp_path),
            "--guard-count",
            "1",
            "--pool-sizes-gb",
            "0.001",
            "--compatibility-digest",
            "d",
            "--heartbeat-timeout-ms",
            "999",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 2
    assert "--heartbeat-timeout-ms must be at least 1000" in out.stderr
