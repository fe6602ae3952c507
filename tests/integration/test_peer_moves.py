"""Router hints with ``mode="move"`` and ``no_retain`` (contract section 6), between real
processes over real NIXL and ZMQ.

``move``: the source may drop its copies once the destination confirmed the keys, which it
does when its engine has taken every result of the operation (``poll_completed``). Until
then, and for good if the source dies first, the source's copies stay.
``no_retain``: a fetch's blocks leave the destination's local G2 when the engine releases
them (a deliver from a peer writes straight into engine memory and keeps nothing).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_guard_workers import SIZES
from test_peer_reuse import HIT, Destination
from test_peer_reuse import SourceWorker as PlainSource

from engine_sim import router_hint
from guard_world import GuardedWorker
from kvcr.types import QueryStatus
from peer_world import key
from procs import GuardProcess, SourceWorker, free_port, wait_until

pytestmark = pytest.mark.integration

KEYS = list(range(4))


def hint(source_endpoint: str, keys: list[int], **payload: object) -> dict:
    envelope = router_hint(source_endpoint, keys)
    envelope["actions"][0]["payload"].update(payload)
    return envelope


@pytest.fixture
def source() -> Iterator[PlainSource]:
    worker = PlainSource("src")
    yield worker
    worker.stop()


@pytest.fixture
def destination() -> Iterator[Destination]:
    dst = Destination()
    yield dst
    dst.close()


def fetched_but_not_polled(destination: Destination, source_endpoint: str, **payload) -> int:
    """A fetch under a hint, left unpolled until its blocks are committed here."""
    kv = destination.kv
    kv.submit_hint(hint(source_endpoint, KEYS, **payload), request_id="req")
    handle = kv.fetch([key(k) for k in KEYS], request_id="req")
    wait_until(lambda: kv.query([key(k) for k in KEYS]) == [HIT] * 4, what="the fetch committed")
    return handle


def test_a_move_drops_the_sources_copies_only_after_the_engine_polled(source, destination):
    source("deposit", [(k, k, 100 + k) for k in KEYS])
    handle = fetched_but_not_polled(destination, source.endpoint, mode="move")

    assert source("query", KEYS) == ["HIT"] * 4  # written, not yet confirmed

    entries = destination.engine.wait(destination.kv, handle, 4)
    assert all(entry.success for entry in entries.values())
    wait_until(lambda: source("query", KEYS) == ["MISS"] * 4, what="the source dropping")
    destination.kv.release([entry.release_handle for entry in entries.values()])


def test_a_copy_keeps_the_sources_copies(source, destination):
    source("deposit", [(k, k, 200 + k) for k in KEYS])
    handle = fetched_but_not_polled(destination, source.endpoint)  # mode absent: copy

    destination.engine.wait(destination.kv, handle, 4)
    wait_until(lambda: source("claims", 0) == 0, what="the write's claims dropped")
    assert source("query", KEYS) == ["HIT"] * 4


def test_a_move_deliver_drops_the_sources_copies_once_polled(source, destination):
    sums = source("deposit", [(k, k, 300 + k) for k in KEYS])
    destination.kv.submit_hint(hint(source.endpoint, KEYS, mode="move"), request_id="req-d")

    result = destination.deliver([(k, 10 + k) for k in KEYS], "req-d")

    assert set(result.values()) == {"SUCCESS"}
    assert [destination.engine.checksum(10 + k) for k in KEYS] == [sums[k][1] for k in KEYS]
    wait_until(lambda: source("query", KEYS) == ["MISS"] * 4, what="the source dropping")


def test_no_retain_fetched_blocks_leave_local_g2_at_their_release(source, destination):
    source("deposit", [(k, k, 400 + k) for k in KEYS])
    kv = destination.kv
    handle = fetched_but_not_polled(destination, source.endpoint, no_retain=True)
    entries = destination.engine.wait(kv, handle, 4)

    assert kv.query([key(k) for k in KEYS]) == [HIT] * 4  # held for the engine's read
    kv.release([entry.release_handle for entry in list(entries.values())[:2]])
    kv.poll_completed()

    wait_until(
        lambda: kv.query([key(k) for k in KEYS]) == [(QueryStatus.MISS, None)] * 2 + [HIT] * 2,
        what="the released blocks dropped",
    )
    assert source("query", KEYS) == ["HIT"] * 4  # no_retain is not move


def test_without_no_retain_fetched_blocks_stay_cached_after_release(source, destination):
    source("deposit", [(k, k, 500 + k) for k in KEYS])
    kv = destination.kv
    handle = fetched_but_not_polled(destination, source.endpoint)
    entries = destination.engine.wait(kv, handle, 4)

    kv.release([entry.release_handle for entry in entries.values()])
    kv.poll_completed()

    assert kv.query([key(k) for k in KEYS]) == [HIT] * 4


def test_a_source_killed_between_the_write_and_the_confirmation_keeps_its_copies(tmp_path: Path):
    guard = GuardProcess(tmp_path, pool_sizes_gb="0.0078125")
    port = free_port()
    source = SourceWorker("mover", SIZES, port, guard=(guard.socket_path, 0, guard.digest))
    destination = GuardedWorker(guard, 1)
    try:
        source("deposit", [(k, k, 600 + k) for k in KEYS])
        kv = destination.kv
        kv.submit_hint(hint(source.endpoint, KEYS, mode="move"), request_id="req-m")
        handle = kv.fetch([key(k) for k in KEYS], request_id="req-m")
        wait_until(lambda: kv.query([key(k) for k in KEYS]) == [HIT] * 4, what="committed")

        source.kill()  # written, committed here, not yet confirmed: the engine has not polled
        wait_until(lambda: guard.states()[0] == ("serving", None), what="takeover")
        entries = destination.engine.wait(kv, handle, 4)  # confirms to whoever is there now
        assert all(entry.success for entry in entries.values())
        wait_until(lambda: "unknown_confirm" in guard.log(), what="the guard's server refusing")

        heir = SourceWorker("heir", SIZES, port, guard=(guard.socket_path, 0, guard.digest))
        try:
            assert heir("query", KEYS) == ["HIT"] * 4  # the dead source's copies stayed
        finally:
            heir.stop()
        kv.release([entry.release_handle for entry in entries.values()])
    finally:
        destination.close()
        source.stop()
        assert guard.stop() == 0, guard.log()
