"""Peers on two hosts: UCX over TCP between two network namespaces (two_hosts.py).

A worker on host a is the source, a worker on host b the destination; both are real
processes with real NIXL agents and ZMQ control channels, driven through the public API
(worker_proc.py). Their deadlines: operation 2 s, abandon 4 s; UCX's TCP user timeout is
kvcr's default, the operation timeout.

The faults are the kernel's: the veth link set down on both ends, or a queue on one end that
passes packets slowly or nearly never. Each test leaves the link up and both workers quiet.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from procs import free_port, wait_until
from two_hosts import Host, TwoHosts, two_hosts

MIB = 1 << 20
BLOCK = 2 * MIB
SIZES = (BLOCK, 64, 64)  # block bytes, pool blocks, engine region blocks
OPERATION_S, ABANDON_S = 2.0, 4.0  # worker_proc.py's deadlines
USER_TIMEOUT_S = OPERATION_S  # UCX's TCP user timeout, as kvcr sets it
SLOW = "100mbit"  # 16 blocks (32 MiB) take ~2.7 s: longer than an operation may


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The workers' stderr: their log events."""
    return tmp_path_factory.mktemp("two-hosts")


@pytest.fixture(scope="module")
def hosts(logs: Path) -> Iterator[TwoHosts]:
    with two_hosts() as made:
        # INFO: the transfer's events on both hosts (pull_partial, joined on its xfer id).
        made.worker(made.a, "host-a", SIZES, log=logs / "a.log", KVCR_LOG_LEVEL="INFO")
        made.worker(made.b, "host-b", SIZES, log=logs / "b.log", KVCR_LOG_LEVEL="INFO")
        yield made
        # Every test leaves both quiet: they close with nothing in flight, and every engine
        # callback of their lives came on the engine's thread.
        for worker in made.workers[:2]:
            worker.stop()


@pytest.fixture
def a(hosts: TwoHosts) -> Any:
    return hosts.workers[0]


@pytest.fixture
def b(hosts: TwoHosts) -> Any:
    return hosts.workers[1]


_keys = iter(range(1000, 10**6, 100))


def fresh_keys(count: int = 16) -> list[int]:
    first = next(_keys)
    return list(range(first, first + count))


def deposited(source: Any, keys: list[int]) -> dict[int, int]:
    """``keys`` computed and deposited at the source: their checksums."""
    result = source("deposit", [(k, i, k) for i, k in enumerate(keys)])
    assert {k: status for k, (status, _) in result.items()} == dict.fromkeys(keys, "SUCCESS")
    return {k: sums[0] for k, (_, sums) in result.items()}


def tail(log: Path, lines: int = 30) -> str:
    """The end of a worker's log (printed: pytest shows it when a test fails)."""
    return "\n".join(log.read_text().splitlines()[-lines:])


def statuses(result: dict[str, Any]) -> dict[int, str]:
    return {k: status for k, (status, _) in result["entries"].items()}


def test_workers_advertise_their_host_and_bind_every_address(a, b, hosts) -> None:
    assert a.endpoint.startswith(f"tcp://{hosts.a.addr}:")
    assert b.endpoint.startswith(f"tcp://{hosts.b.addr}:")


def test_kvcr_owned_blocks_reach_the_other_host_byte_exact(a, b) -> None:
    keys = fresh_keys()
    sums = deposited(a, keys)

    result = b("soak_deliver", keys, a.endpoint, timeout=30)

    assert statuses(result) == dict.fromkeys(keys, "SUCCESS")
    assert {k: crc for k, (_, crc) in result["entries"].items()} == sums
    assert result["query_after"] == ["FETCHABLE"] * len(keys)


def test_engine_pinned_blocks_reach_the_other_host_and_are_released(a, b) -> None:
    keys = fresh_keys()
    sums = a("engine_has", [(k, 16 + i, k) for i, k in enumerate(keys)])
    released = len(a("pin_state")["released"])

    result = b("soak_deliver", keys, a.endpoint, timeout=30)

    assert statuses(result) == dict.fromkeys(keys, "SUCCESS")
    assert {k: crc for k, (_, crc) in result["entries"].items()} == {
        k: s[0] for k, s in sums.items()
    }
    state = a("pin_state")
    assert state["pinned"] == [] and len(state["released"]) == released + 1


@pytest.mark.parametrize("owner", ["kvcr", "engine"])
def test_a_fetch_lands_in_the_other_hosts_pool(a, b, owner) -> None:
    keys = fresh_keys(8)
    if owner == "kvcr":
        sums = deposited(a, keys)
    else:
        held = a("engine_has", [(k, 16 + i, k) for i, k in enumerate(keys)])
        sums = {k: s[0] for k, s in held.items()}

    result = b("soak_fetch", keys, a.endpoint, timeout=30)

    assert result == {k: ("SUCCESS", sums[k]) for k in keys}
    b("soak_release", len(keys))


def test_telemetry_counts_the_moves_on_both_hosts(a, b) -> None:
    before_a, before_b = a("counters"), b("counters")
    keys = fresh_keys(4)
    deposited(a, keys)

    b("soak_deliver", keys, a.endpoint, timeout=30)

    after_a, after_b = a("counters"), b("counters")
    grew = {
        name: after.get(name, 0) - before.get(name, 0)
        for before, after in ((before_a, after_a), (before_b, after_b))
        for name in after
    }
    assert grew["kvcr_transfer_blocks{source_write}"] == 4
    assert grew["kvcr_transfer_bytes{source_write}"] == 4 * BLOCK
    assert grew["kvcr_transfer_blocks{remote_deliver}"] == 4
    assert grew["kvcr_transfer_bytes{remote_deliver}"] == 4 * BLOCK


def signals(worker: Any) -> dict[str, float]:
    """A worker's counters, and how many samples each duration ("scope,result") has."""
    samples = worker("durations")
    return worker("counters") | {label: len(values) for label, values in samples.items()}


def grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def test_the_funnel_splits_a_partial_pull_across_hosts(a, b, logs) -> None:
    """Of four keys, the source holds two in its pool, its engine one, and nobody the
    fourth: each side's stages say where the fourth went, and the destination's one
    pull_partial names the pull."""
    keys = fresh_keys(4)
    deposited(a, keys[:2])
    a("engine_has", [(keys[2], 16, keys[2])])
    before = signals(a), signals(b)

    result = b("soak_deliver", keys, a.endpoint, timeout=30)

    assert statuses(result) == {**dict.fromkeys(keys[:3], "SUCCESS"), keys[3]: "FAILED"}
    source, destination = (grown(was, signals(w)) for was, w in zip(before, (a, b), strict=True))
    stages = ("peer_resident", "peer_held", "peer_submitted")
    assert [source[f"kvcr_transfer_blocks{{{s}}}"] for s in stages] == [3, 3, 3]
    stages = ("peer_planned", "peer_completed", "peer_published")
    assert [destination[f"kvcr_transfer_blocks{{{s}}}"] for s in stages] == [4, 3, 3]
    assert source["framework_pin_wait,success"] == source["transfer,success"] == 1
    assert destination["notification,success"] == destination["remote_deliver,partial"] == 1
    partial = [ln for ln in (logs / "b.log").read_text().splitlines() if " pull_partial " in ln]
    assert " planned=4 completed=3 published=3" in partial[-1]


@attrs.define
class Direction:
    """Who pulls from whom: the source, the destination, and the hosts they run on."""

    src: Any
    dst: Any
    src_host: Host
    dst_host: Host
    logs: tuple[Path, Path]  # the source's, the destination's


@pytest.fixture(params=["a to b", "b to a"])
def direction(request: pytest.FixtureRequest, hosts: TwoHosts, a, b, logs) -> Direction:
    there = Direction(a, b, hosts.a, hosts.b, (logs / "a.log", logs / "b.log"))
    if request.param == "a to b":
        return there
    return Direction(b, a, hosts.b, hosts.a, (logs / "b.log", logs / "a.log"))


def warm(src: Any, dst: Any, keys: list[int]) -> int:
    """Pull ``keys`` once so that the connection this direction uses is up before a fault
    is applied mid-write; how many attempts that took.

    Right after a fault in the other direction, the first write this way can be refused at
    post (NIXL: "remote agent ... was disconnected after transfer request creation", even
    on a fresh connection) for a few seconds: the pull fails at once, truthfully, and a
    later one succeeds. Not what these tests are about, so it happens here, on record."""
    for attempt in range(1, 11):
        if set(statuses(dst("soak_deliver", keys, src.endpoint, timeout=30)).values()) == {
            "SUCCESS"
        }:
            return attempt
        time.sleep(1.0)
    raise AssertionError("the link did not carry a pull in 10 attempts")


def _cut_mid_write(hosts: TwoHosts, way: Direction, fault: str) -> dict[str, Any]:
    """Start a slow 32 MiB pull, let 0.5 s of it pass, then apply ``fault``; the answers
    and timings of everything that follows, with the link healed at the end."""
    src, dst = way.src, way.dst
    keys = fresh_keys()
    sums = deposited(src, keys)
    out: dict[str, Any] = {"keys": keys, "sums": sums, "warm_attempts": warm(src, dst, keys)}
    hosts.shape(way.src_host, SLOW)
    events_before = len(dst("events"))
    before = signals(src), signals(dst)
    handle, request = dst("soak_deliver_start", keys, src.endpoint)
    time.sleep(0.5)
    started = time.monotonic()
    if fault == "link down":
        hosts.link(False)
    elif fault == "source drops":
        hosts.drop_leaving(way.src_host)
    elif fault == "destination drops":
        hosts.drop_leaving(way.dst_host)
    out["handle"] = handle
    out["result"] = dst("soak_deliver_finish", handle, request, keys, 10, timeout=30)
    out["answered_s"] = time.monotonic() - started
    out["source_quiet_s"] = src("soak_quiet", 10, timeout=30) + (time.monotonic() - started)
    out["source_grew"], out["destination_grew"] = (
        grown(was, signals(worker)) for was, worker in zip(before, (src, dst), strict=True)
    )
    if fault != "destination drops":
        # Nothing from the source gets through: the destination cannot know that the write
        # is over, so its memory stays held until the source's word arrives.
        with pytest.raises(RuntimeError, match="'pulls': 1"):
            dst("soak_quiet", 0.5, timeout=30)
    out["events_down"] = dst("events")[events_before:]
    hosts.link(True)
    hosts.unshape(hosts.a)
    hosts.unshape(hosts.b)
    out["destination_quiet_s"] = dst("soak_quiet", 20, timeout=30)
    out["events"] = dst("events")[events_before:]
    return out


@pytest.mark.parametrize("fault", ["link down", "source drops", "destination drops"])
def test_a_fault_mid_write_ends_every_operation_truthfully_and_the_link_heals(
    hosts, direction, fault
) -> None:
    way = direction
    cut = _cut_mid_write(hosts, way, fault)
    print(cut, "\n--- source:\n", tail(way.logs[0]), "\n--- destination:\n", tail(way.logs[1]))

    # The engine hears at its operation deadline: nothing arrived for sure.
    assert statuses(cut["result"]) == dict.fromkeys(cut["keys"], "FAILED")
    assert cut["answered_s"] < OPERATION_S + 0.1
    # The source's write ends by itself at UCX's TCP user timeout (kvcr's default: the
    # operation timeout), which TCP checks when its retransmission timer fires: one to two
    # timeouts after the last acknowledged data (measured: 1.6-3.0 s). Then it releases
    # what it held.
    assert cut["source_quiet_s"] < 2 * USER_TIMEOUT_S + 0.5
    # The destination's engine memory was reported uncertain, and quiesced only once the
    # source said its write is over (after the link came back).
    handle = cut["handle"]
    held = [(handle, "uncertain"), (handle, "quiesced")]
    if fault == "destination drops":
        # Only the destination's packets are lost, so the source's word reaches it, before
        # or after the operation's deadline (TCP's retransmission timing decides); both are
        # truthful: the memory is held and reported until that word, or never past it.
        assert cut["events"] in ([], held)
    else:
        assert cut["events_down"] == [(handle, "uncertain")]
        assert cut["events"] == held
        _the_failed_write_shows_in_the_funnel_and_both_logs(way, cut)

    # Without a restart, the next pull over the healed link moves every byte.
    again = way.dst("soak_deliver", cut["keys"], way.src.endpoint, timeout=30)
    assert statuses(again) == dict.fromkeys(cut["keys"], "SUCCESS")
    assert {k: crc for k, (_, crc) in again["entries"].items()} == cut["sums"]


def _the_failed_write_shows_in_the_funnel_and_both_logs(way: Direction, cut: dict) -> None:
    """The source's write failed (UCX's TCP user timeout): its funnel got as far as
    submitted, the destination's planned and published nothing; both sides' timers say
    ``failed``; the destination's pull_partial and the source's source_write_failed carry
    one transfer id."""
    count = len(cut["keys"])
    src, dst = cut["source_grew"], cut["destination_grew"]
    stages = ("peer_resident", "peer_held", "peer_submitted")
    assert [src.get(f"kvcr_transfer_blocks{{{s}}}") for s in stages] == [count] * 3
    assert dst.get("kvcr_transfer_blocks{peer_planned}") == count
    assert "kvcr_transfer_blocks{peer_completed}" not in dst
    assert "kvcr_transfer_blocks{peer_published}" not in dst
    assert (src.get("transfer,failed"), src.get("source_write,failed")) == (1, 1)
    assert (dst.get("notification,failed"), dst.get("remote_deliver,failed")) == (1, 1)
    partial = [ln for ln in way.logs[1].read_text().splitlines() if " pull_partial " in ln][-1]
    xfer = re.search(r" xfer='?([0-9a-f]{16}\.\d+)", partial)
    assert xfer is not None and f" planned={count} completed=0 published=0" in partial
    [failed] = [
        ln
        for ln in way.logs[0].read_text().splitlines()
        if " source_write_failed " in ln and xfer.group(1) in ln
    ]
    assert f" keys={count} " in failed


def test_a_link_back_within_the_user_timeout_lets_the_write_finish_late(hosts, b, tmp_path) -> None:
    # The operator's own user timeout (10 s) stands: with TCP's retransmission backoff, an
    # outage of 0.5 s may leave data unacknowledged for ~2 s, kvcr's default here.
    log = tmp_path / "patient.log"
    src = hosts.worker(
        hosts.a, "host-a-patient", SIZES, log=log, UCX_TCP_USER_TIMEOUT="10s", KVCR_LOG_LEVEL="INFO"
    )
    # Logged on the runtime's thread just after the constructor it unblocked returned.
    said = "ucx_tcp_user_timeout='10s'"
    wait_until(lambda: said in log.read_text(), 10, "runtime_started in the log")
    keys = fresh_keys()
    deposited(src, keys)
    warm(src, b, keys)
    hosts.shape(hosts.a, SLOW)
    handle, request = b("soak_deliver_start", keys, src.endpoint)
    time.sleep(0.3)
    hosts.link(False)
    time.sleep(0.5)
    hosts.link(True)

    result = b("soak_deliver_finish", handle, request, keys, 10, timeout=30)

    # Too late for the operation, which failed at its deadline; the write itself went on
    # and ended well, and only then was the destination memory quiesced.
    assert statuses(result) == dict.fromkeys(keys, "FAILED")
    src("soak_quiet", 20, timeout=30)
    hosts.unshape(hosts.a)
    b("soak_quiet", 10, timeout=30)
    assert src("counters")["kvcr_transfer_blocks{source_write}"] == 2 * len(keys)  # warm too
    assert b("events")[-2:] == [(handle, "uncertain"), (handle, "quiesced")]
    src.stop()


def test_the_guard_serves_a_dead_workers_blocks_to_the_other_host(hosts, b, tmp_path) -> None:
    guard = hosts.guard(hosts.a, tmp_path, guard_count=1, pool_sizes_gb="0.0625")  # 32 blocks
    dead = hosts.worker(
        hosts.a,
        "host-a-guarded",
        SIZES,
        log=tmp_path / "guarded.log",
        guard=(guard.socket_path, 0, guard.digest),
    )
    keys = fresh_keys(6)
    sums = deposited(dead, keys)
    assert statuses(b("soak_deliver", keys[:1], dead.endpoint, timeout=30)) == {keys[0]: "SUCCESS"}
    dead.kill()
    wait_until(lambda: guard.states()[0] == ("serving", None), what="takeover")

    # The same endpoint, served by the guard on host a now, over TCP to host b.
    result = b("soak_deliver", keys, dead.endpoint, timeout=30)

    assert statuses(result) == dict.fromkeys(keys, "SUCCESS")
    assert {k: crc for k, (_, crc) in result["entries"].items()} == sums
    assert guard.stop() == 0, guard.log()


def test_hints_naming_endpoints_nobody_answers_fail_at_the_deadline(a, b, logs) -> None:
    endpoints = [
        "tcp://198.18.0.99:5555",  # on the link, but no host has the address
        f"tcp://198.18.0.1:{free_port()}",  # the source's host, a port nobody listens on
        "tcp://203.0.113.7:5555",  # no route at all
    ]
    keys = fresh_keys(4)
    deposited(a, keys)
    started = time.monotonic()

    pulls = [b("soak_deliver_start", keys, endpoint) for endpoint in endpoints]
    results = [b("soak_deliver_finish", *pull, keys, 10, timeout=30) for pull in pulls]

    for result in results:
        assert statuses(result) == dict.fromkeys(keys, "FAILED")
    assert time.monotonic() - started < OPERATION_S + 0.5
    # Each is greeted for abandon_timeout_ms, then reported by its endpoint.
    for endpoint in endpoints:
        said = f"peer_unreachable agent='host-b' endpoint='{endpoint}'"
        wait_until(lambda s=said: s in (logs / "b.log").read_text(), ABANDON_S + 1, said)
    assert b("soak_quiet", 5, timeout=30) < 1


def test_a_destination_whose_metadata_names_no_reachable_address(hosts, a, logs) -> None:
    # Its UCX advertises only its loopback, which the source cannot reach.
    lonely = hosts.worker(hosts.b, "host-b-lo", SIZES, log=logs / "lo.log", UCX_NET_DEVICES="lo")
    keys = fresh_keys(4)
    deposited(a, keys)

    result = lonely("soak_deliver", keys, a.endpoint, timeout=30)

    assert statuses(result) == dict.fromkeys(keys, "FAILED")
    assert result["seconds"] < OPERATION_S + 0.3
    said = (logs / "a.log").read_text()
    assert "kind='bad_metadata'" in said and "peer 'host-b-lo'" in said
    assert "check UCX_NET_DEVICES and UCX_TLS on both hosts" in said
    assert lonely("soak_quiet", 5, timeout=30) < 1
    assert a("soak_quiet", 5, timeout=30) < 1
    lonely.stop()


def test_a_ucx_device_that_does_not_exist_fails_the_start_and_says_so(hosts, tmp_path) -> None:
    log = tmp_path / "nodev.log"
    with pytest.raises((EOFError, OSError)):
        hosts.worker(hosts.b, "host-b-nodev", SIZES, log=log, UCX_NET_DEVICES="nosuchdev")
    said = log.read_text()
    assert "NIXL agent 'host-b-nodev': backend 'UCX' failed to start" in said
    assert "UCX_NET_DEVICES='nosuchdev'" in said


def test_a_destination_killed_while_the_link_is_down(hosts, a, tmp_path) -> None:
    doomed = hosts.worker(hosts.b, "host-b-doomed", SIZES, log=tmp_path / "doomed.log")
    keys = fresh_keys()
    deposited(a, keys)
    hosts.shape(hosts.a, SLOW)
    doomed("soak_deliver_start", keys, a.endpoint)
    time.sleep(0.5)
    hosts.link(False)
    doomed.kill()
    started = time.monotonic()

    # The source's write ends at the TCP user timeout (one to two of them after the last
    # acknowledged data), and lets go of what it held.
    a("soak_quiet", 10, timeout=30)
    assert time.monotonic() - started < 2 * USER_TIMEOUT_S + 0.5
    hosts.link(True)
    hosts.unshape(hosts.a)
    assert a("soak_audit")["claims"] == {}


def test_a_source_killed_while_the_link_is_down_is_let_go_when_it_restarts(
    hosts, b, tmp_path
) -> None:
    source = hosts.worker(hosts.a, "host-a-doomed", SIZES, log=tmp_path / "doomed.log")
    keys = fresh_keys()
    deposited(source, keys)
    hosts.shape(hosts.a, SLOW)
    handle, request = b("soak_deliver_start", keys, source.endpoint)
    time.sleep(0.5)
    hosts.link(False)
    source.kill()
    started = time.monotonic()

    result = b("soak_deliver_finish", handle, request, keys, 10, timeout=30)

    assert statuses(result) == dict.fromkeys(keys, "FAILED")
    assert time.monotonic() - started < OPERATION_S
    hosts.link(True)
    hosts.unshape(hosts.a)
    # Nobody can say that the dead source's write is over: the memory stays held...
    with pytest.raises(RuntimeError, match="'pulls': 1"):
        b("soak_quiet", 1.0, timeout=30)
    assert b("events")[-1] == (handle, "uncertain")

    # ... until a new process answers at its endpoint: the old one is gone for sure.
    again = hosts.worker(
        hosts.a, "host-a-again", SIZES, log=tmp_path / "again.log", port=source.port
    )
    sums = deposited(again, keys)
    result = b("soak_deliver", keys, again.endpoint, timeout=30)
    assert statuses(result) == dict.fromkeys(keys, "SUCCESS")
    assert {k: crc for k, (_, crc) in result["entries"].items()} == sums
    b("soak_quiet", 10, timeout=30)
    assert (handle, "quiesced") in b("events")
