"""Fencing benchmark: a holder that stops beating (SIGSTOP) under ``kvcr-guard
--heartbeat-timeout-ms 1000`` is fenced (SIGKILL through its pidfd) and its group taken over;
each figure beside the same holder SIGKILLed (a crash) in the same service, rounds alternating.

    uv run python benchmarks/fencing.py            # 1,000 and 1,000,000 blocks, ~2 min
    uv run python benchmarks/fencing.py --quick    # 1,000 blocks, ~10 s
    uv run python benchmarks/fencing.py --runs 3   # the figures for a note

Blocks are 4 KiB so that a million fit this machine (a 4 GiB group in /dev/shm): the
takeover's work is per block, not per byte. For each size, one service with one group;
a holder (``recovery_holder.py``) deposits N blocks (later holders claim the served group
back, start warm from its journal and deposit the same keys again: hits), and once the
service has followed its journal to N blocks and opened its standby transport (as it does
for every held group), the driver stops it:

- ``fence``: SIGSTOP. The driver polls ``status`` every 0.5 ms (every 10 ms for the first
  0.8 s: the fence is not due before ~0.95 s) and the holder's pidfd, and
  takes (a) stop -> the group's state says ``fencing`` (``holder_fenced``: the service's
  deadline passed; it then sends SIGKILL), (b) ``fencing`` -> the holder's exit (its pidfd
  readable), (c) exit -> ``serving`` (the journal's tail applied, the server started on the
  standby transport), (d) stop -> ``serving``; the key figure is fence -> serving, (b) + (c).
  (e): when the driver sees the exit, a peer (a kvcr instance in the driver, made before the
  stop) is hinted to the group's endpoint and ``deliver``s the holder's last key, retrying
  until it arrives; from the fence until the block is in the peer's memory, byte-exact
  (CRC). The connection waits in the listener's backlog until the service serves.
- ``crash``: SIGKILL from the driver, the same figures from the kill (the baseline of
  fence -> serving: SIGKILL, then the takeover, without the deadline).

Also the service's own ``took_over`` seconds (the takeover, from the lease's end) and the
``missed_ms`` it logs with ``holder_fenced`` (silence since the holder's last beat). The
first takeover of each service is a warm-up (not counted): at 1M blocks its holder also
fills the pool from scratch.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import time
import zlib

import attrs
import common
from common import Engine, GuardService, Row, free_port, log, make_instance, pool_service, run_main
from recovery import IntKeys

from kvcr.config import RemoteFWDramOptions
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.hints import fetch_hint
from kvcr.types import MemoryRef

BLOCK = 4 * common.KIB
ELEMENTS = 1000  # the holder's region: key k is element k % ELEMENTS
TIMEOUT_MS = 1000  # --heartbeat-timeout-ms (the least the service accepts)
POLL_S = 0.0005  # the driver's pause between looks at status and the pidfd
QUIET_S = 0.8 * TIMEOUT_MS / 1000  # after a SIGSTOP, the driver looks every 10 ms until then
READY_S = 300.0  # a holder, and the service's follower and standby, get this long to be ready


@attrs.define
class Takeover:
    """One stop's figures, seconds from the stop (None: not seen, or not this kind)."""

    fencing: float | None  # the state says fencing
    exited: float  # the pidfd is readable
    serving: float  # the state says serving
    block: float  # the peer has the block, byte-exact
    took_over: float  # the service's own figure
    missed_ms: float | None  # the service's holder_fenced figure
    tries: int  # the peer's delivers until the block came
    from_log: bool  # fencing not seen in status (it passed between two looks): from the log
    logged: dict[str, float]  # the service's log: seconds of each takeover event (ms ticks)


class Peer:
    """A kvcr instance in the driver that pulls one key from the group's endpoint."""

    def __init__(self, service: GuardService, serial: int) -> None:
        self.name = f"fence-peer-{os.getpid()}-{serial}"
        self.region = common.bench_pages(BLOCK, 0)
        self.channel = ZmqPeerControlChannel("127.0.0.1", free_port(), "127.0.0.1")
        self.kv = make_instance(
            self.name,
            BLOCK,
            self.region,
            common.bench_pages(2 * BLOCK, 0),  # unused: deliver writes the engine region
            common.null_bindings(framework_control=self.channel, key_adapter=IntKeys()),
            remote_fw_dram=RemoteFWDramOptions(eager_ctrl_connect=True),
        )
        self.engine = Engine(self.kv, self.name)
        self.endpoint = f"tcp://127.0.0.1:{service.port}"
        self.requests = itertools.count()
        self.handle: int | None = None
        self.request = ""

    def pull(self, key: int) -> None:
        """Hint the endpoint for ``key`` and deliver it into element 0 (polled by ``done``)."""
        self.request = f"pull-{next(self.requests)}"
        hint = fetch_hint(self.endpoint, [key], message_id=self.request)
        self.kv.submit_hint(hint, request_id=self.request)
        blocks = {key.to_bytes(8, "big"): [MemoryRef(end_point_name=self.name, element_index=0)]}
        self.handle = self.kv.deliver(blocks, request_id=self.request)

    def done(self, expected: int) -> bool | None:
        """None while the deliver is in flight; then whether the block came byte-exact (the
        hint is discarded either way)."""
        assert self.handle is not None
        for op, entries in self.kv.poll_completed():
            if op != self.handle:
                continue
            self.kv.discard_hint(self.request)
            self.handle = None
            ok = all(e.success for e in entries.values())
            return ok and zlib.crc32(self.region) == expected
        return None

    def close(self) -> None:
        self.kv.close()
        self.channel.close()


def holder_ready(service: GuardService, nblocks: int, holds: int) -> subprocess.Popen[str]:
    """A holder of ``nblocks`` blocks, once the service follows its journal to them and has
    opened the standby transport of its hold (the ``holds``-th of this service)."""
    holder = service.start_holder(nblocks)
    deadline = time.monotonic() + READY_S
    while True:
        group = service.client.status()[0]
        standbys = service.log_lines("standby_opened")
        if group.journal_blocks == nblocks and len(standbys) >= holds:
            return holder
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready: {group}, {len(standbys)} standbys of {holds}")
        time.sleep(0.01)


def stop_once(
    service: GuardService, nblocks: int, holds: int, fence: bool, serial: int
) -> Takeover:
    """Start a holder, stop it (SIGSTOP: fenced; else SIGKILL), and time the takeover."""
    holder = holder_ready(service, nblocks, holds)
    peer = Peer(service, serial)
    key = nblocks - 1  # the last key the holder committed
    element = common.randomized(BLOCK * ELEMENTS, seed=BLOCK)[key % ELEMENTS * BLOCK :]
    expected = zlib.crc32(element[:BLOCK])
    pidfd = os.pidfd_open(holder.pid)
    exit_poll = select.poll()
    exit_poll.register(pidfd, select.POLLIN)
    seen: dict[str, float] = {}
    tries = 0
    clock = time.perf_counter
    fenced = service.client.status()[0].fenced
    kind = f"{'fence' if fence else 'crash'} of holder {holder.pid}"
    try:
        t0, wall0 = clock(), time.time()
        os.kill(holder.pid, signal.SIGSTOP if fence else signal.SIGKILL)
        deadline = t0 + 10 * TIMEOUT_MS / 1000 + 60
        while "block" not in seen or "serving" not in seen:
            state = service.state(0)
            now = clock() - t0
            if state in ("fencing", "serving"):
                seen.setdefault(state, now)
            if "exited" not in seen and exit_poll.poll(0):
                seen["exited"] = now
            if "exited" in seen and "block" not in seen:
                if peer.handle is None:
                    peer.pull(key)
                    tries += 1
                elif (arrived := peer.done(expected)) is not None and arrived:
                    seen["block"] = clock() - t0
            if clock() > deadline:
                raise RuntimeError(f"{nblocks} blocks, {kind}: no takeover in time: {seen}")
            # Until the deadline nears, look every 10 ms: 2,000 status requests a second for
            # the whole stop would load the service that is about to take over.
            time.sleep(POLL_S if not fence or now > QUIET_S else 0.01)
    finally:
        os.close(pidfd)
        holder.kill()
        holder.wait()
        peer.close()
    if service.client.status()[0].fenced != fenced + fence:
        raise RuntimeError(f"{'not fenced' if fence else 'a killed holder was fenced'}: {seen}")
    if fence and "fencing" not in seen:
        # The state passed between two looks (the driver was not scheduled for the few ms
        # from the fence to the exit): the service's log says when, to the ms.
        seen["fencing"] = logged_at(service, "holder_fenced") - wall0
        seen["fencing_from_log"] = 1.0
    missed = [re.search(r"missed_ms=(\d+)", line) for line in service.log_lines("holder_fenced")]
    return Takeover(
        seen.get("fencing"),
        seen["exited"],
        seen["serving"],
        seen["block"],
        service.log_seconds("took_over")[-1],
        float(missed[-1].group(1)) if fence and missed[-1] else None,
        tries,
        "fencing_from_log" in seen,
        {event: logged_at(service, event) for event in LOGGED},
    )


LOGGED = ("holder_fenced", "lease_ended", "recovered", "took_over")  # a takeover's log events


def logged_at(service: GuardService, event: str) -> float:
    """The wall-clock seconds of the last ``event`` line of the service (its log lines start
    with an ISO 8601 UTC time with microseconds); NaN if there is none."""
    lines = service.log_lines(event)
    if not lines:
        return float("nan")
    stamp = datetime.datetime.strptime(lines[-1].split()[0], "%Y-%m-%dT%H:%M:%S.%fZ")
    return stamp.replace(tzinfo=datetime.timezone.utc).timestamp()


def bench(rows: list[Row], nblocks: int, pairs: int, quiet: bool) -> None:
    """``pairs`` fences and as many crashes, alternating, after a warm-up crash."""
    service = pool_service(BLOCK * nblocks, options=("--heartbeat-timeout-ms", str(TIMEOUT_MS)))
    runs: dict[bool, list[Takeover]] = {True: [], False: []}
    serial = itertools.count()
    try:
        log(f"{nblocks} blocks: warm-up (the first holder fills the pool)", quiet)
        stop_once(service, nblocks, 1, False, next(serial))
        for i in range(2 * pairs):
            fence = i % 2 == 0
            log(f"{nblocks} blocks: {'fence' if fence else 'crash'} {i // 2 + 1}/{pairs}", quiet)
            runs[fence].append(stop_once(service, nblocks, i + 2, fence, next(serial)))
        fenced = service.client.status()[0].fenced
        if fenced != pairs:
            raise RuntimeError(f"the service fenced {fenced} holders, not {pairs}")
    except BaseException:
        tail = (service.dir / "service.log").read_text().splitlines()[-30:]
        sys.stderr.write("the service's log, last lines:\n" + "\n".join(tail) + "\n")
        raise
    finally:
        service.stop()
    add_rows(rows, f"{nblocks:,} blocks", runs[True], runs[False])


def ms(values: list[float | None]) -> float:
    """The median of ``values`` (seconds), in ms."""
    return statistics.median(v for v in values if v is not None) * 1e3


def add_rows(rows: list[Row], size: str, fences: list[Takeover], crashes: list[Takeover]) -> None:
    def row(what: str, value: float, baseline: float | None = None, unit: str = "ms") -> None:
        rows.append(Row("fence", f"{size}: {what}", value, unit, baseline))

    def since_fence(t: Takeover, at: float) -> float:
        assert t.fencing is not None
        return at - t.fencing

    row(
        "fence -> serving (crash: SIGKILL -> serving), median",
        ms([since_fence(t, t.serving) for t in fences]),
        ms([t.serving for t in crashes]),
    )
    row(
        "(a) SIGSTOP -> fencing (baseline: the timeout)",
        ms([t.fencing for t in fences]),
        float(TIMEOUT_MS),
    )
    row(
        "(b) fencing -> holder exit (crash: SIGKILL -> exit)",
        ms([since_fence(t, t.exited) for t in fences]),
        ms([t.exited for t in crashes]),
    )
    row(
        "(c) holder exit -> serving (crash: the same)",
        ms([t.serving - t.exited for t in fences]),
        ms([t.serving - t.exited for t in crashes]),
    )
    row("(d) SIGSTOP -> serving", ms([t.serving for t in fences]))
    row(
        "(e) fence -> block at a peer (crash: SIGKILL -> block)",
        ms([since_fence(t, t.block) for t in fences]),
        ms([t.block for t in crashes]),
    )
    row(
        "took_over, the service's own (crash: the same)",
        ms([t.took_over for t in fences]),
        ms([t.took_over for t in crashes]),
    )

    def logged(t: Takeover, first: str, then: str) -> float:
        return t.logged[then] - t.logged[first]

    for first, then, what in (
        ("holder_fenced", "lease_ended", "holder exit seen"),
        ("lease_ended", "recovered", "journal tail applied, index handed over"),
        ("recovered", "took_over", "server started on the standby transport"),
    ):
        stage = f"diag: log {first} -> {then} ({what})"
        if first == "holder_fenced":
            row(stage, ms([logged(t, first, then) for t in fences]))
        else:
            row(
                stage + " (crash: the same)",
                ms([logged(t, first, then) for t in fences]),
                ms([logged(t, first, then) for t in crashes]),
            )
    row(
        "diag: holder_fenced missed_ms (since the last beat)",
        statistics.median(t.missed_ms for t in fences if t.missed_ms is not None),
    )
    row(
        "diag: the peer's delivers until the block came (crash: the same)",
        statistics.median(t.tries for t in fences),
        statistics.median(t.tries for t in crashes),
        "tries",
    )
    row(
        "diag: fences whose time is the log's (fencing passed between two looks)",
        sum(t.from_log for t in fences),
        len(fences),
        "fences",
    )


def measure(args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    quiet = args.json_only
    rows: list[Row] = []
    bench(rows, 1000, 3 if args.quick else 10, quiet)
    if not args.quick:
        bench(rows, 1_000_000, 5, quiet)
    notes = [
        f"--heartbeat-timeout-ms {TIMEOUT_MS}; holders beat every 50 ms; 4 KiB blocks",
        "baseline column: the same holder SIGKILLed by the driver (a crash), rounds "
        "alternating in the same service; (a): the timeout itself",
        f"the driver looks at status and the pidfd every {POLL_S * 1e3:g} ms (+ a status round "
        f"trip; every 10 ms for the first {QUIET_S:g} s of a SIGSTOP): figures from the driver are good to ~1 ms; diag: log rows are the service's "
        "log timestamps (UTC, µs)",
        "the peer is hinted and delivers from the moment the driver sees the holder's exit, "
        "in fences and crashes alike: it shares the cores with the takeover",
    ]
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    return run_main(
        measure,
        argv,
        "kvcr fencing benchmark",
        "1,000 blocks only (~10 s)",
        load=("this run", "the service, the holder and the peer share the two cores"),
        children=True,
    )


if __name__ == "__main__":
    sys.exit(main())
