"""Peer authentication with a shared cluster key: sealing, replay safety, and what a worker
does with messages that are not sealed with its key (on the fake fabric, under MockClock)."""

from __future__ import annotations

import contextlib

import pytest
import trio

from engine_sim import EngineSim, Recorder
from kvcr import KVCR
from kvcr.telemetry import STATE_METRIC
from kvcr.transport import messages as m
from kvcr.transport.auth import (
    KEY_ENV,
    KEY_FILE_ENV,
    MAGIC,
    WINDOW,
    PeerAuth,
    Rejected,
    cluster_key_from_env,
)
from kvcr.transport.fake import Fault, FaultPlan
from peer_world import Worker, World, key, share

KEY = b"k" * 32
CONTRACT_METRICS = {"kvcr_duration_seconds", "kvcr_transfer_bytes", "kvcr_transfer_blocks"}
OTHER = b"o" * 32


def rejected(auth: PeerAuth, raw: bytes) -> str:
    with pytest.raises(Rejected) as info:
        auth.open(raw)
    return info.value.reason


# -- sealing ---------------------------------------------------------------------------------


def test_a_sealed_message_opens_with_the_same_key_and_names_its_sender() -> None:
    sender, receiver = PeerAuth(KEY, 41), PeerAuth(KEY, 42)
    assert receiver.open(sender.seal(b"body")) == (41, b"body")


def test_a_tampered_or_foreign_message_is_unauthenticated() -> None:
    sender, receiver = PeerAuth(KEY, 1), PeerAuth(KEY, 2)
    sealed = sender.seal(b"pull this")
    flipped = sealed[:-1] + bytes([sealed[-1] ^ 1])
    assert rejected(receiver, flipped) == "unauthenticated"
    assert rejected(receiver, PeerAuth(OTHER, 1).seal(b"pull this")) == "unauthenticated"
    assert rejected(receiver, b"pull this") == "unauthenticated"
    assert rejected(receiver, sealed[:20]) == "unauthenticated"


def test_each_message_is_accepted_once_even_when_reordered() -> None:
    sender, receiver = PeerAuth(KEY, 7), PeerAuth(KEY, 8)
    first, second, third = (sender.seal(b"%d" % i) for i in range(3))
    receiver.open(third)
    receiver.open(first)  # late, within the window: the other channel's message
    assert rejected(receiver, first) == "replayed"
    assert rejected(receiver, third) == "replayed"
    receiver.open(second)


def test_messages_older_than_the_window_are_refused() -> None:
    sender, receiver = PeerAuth(KEY, 7), PeerAuth(KEY, 8)
    old = sender.seal(b"old")
    for _ in range(WINDOW):
        receiver.open(sender.seal(b"new"))
    assert rejected(receiver, old) == "replayed"


def test_senders_are_tracked_by_incarnation() -> None:
    one, two, receiver = PeerAuth(KEY, 1), PeerAuth(KEY, 2), PeerAuth(KEY, 3)
    assert receiver.open(one.seal(b"a")) == (1, b"a")
    assert receiver.open(two.seal(b"a")) == (2, b"a")  # sequence 1 of another sender


def test_without_a_key_messages_pass_and_sealed_ones_name_the_missing_key() -> None:
    plain = PeerAuth(None, 1)
    assert plain.seal(b"x") == b"x"
    assert plain.open(b"x") == (None, b"x")
    with pytest.raises(Rejected, match=KEY_ENV) as info:
        plain.open(PeerAuth(KEY, 2).seal(b"x"))
    assert info.value.reason == "sealed_without_key"


# -- configuration ---------------------------------------------------------------------------


def test_the_key_comes_from_the_environment_or_a_file(tmp_path) -> None:
    assert cluster_key_from_env({}) is None
    assert cluster_key_from_env({KEY_ENV: "s" * 16}) == b"s" * 16
    path = tmp_path / "cluster.key"
    path.write_bytes(b"f" * 40 + b"\n")
    assert cluster_key_from_env({KEY_FILE_ENV: str(path)}) == b"f" * 40


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({KEY_ENV: "short"}, f"{KEY_ENV}.*5 bytes.*at least 16"),
        ({KEY_ENV: "s" * 16, KEY_FILE_ENV: "/x"}, "not both"),
        ({KEY_FILE_ENV: "/nonexistent/kvcr.key"}, "cannot read .*/nonexistent/kvcr.key"),
    ],
    ids=["too-short", "both", "unreadable-file"],
)
def test_a_bad_key_setting_is_an_error_naming_it(environ, named) -> None:
    with pytest.raises(ValueError, match=named):
        cluster_key_from_env(environ)


def test_a_worker_with_a_bad_key_setting_does_not_start(monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, "short")
    engine = EngineSim(name="bad-key")
    with pytest.raises(ValueError, match=KEY_ENV):
        KVCR(engine.config, Recorder().bindings(), engine.backend_configs)


# -- workers with keys -----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def keyed(monkeypatch, worker: Worker, cluster_key: bytes | None):
    """``worker`` running with ``cluster_key`` (read from the environment at construction)."""
    if cluster_key is None:
        monkeypatch.delenv(KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(KEY_ENV, cluster_key.decode())
    async with worker.running() as kv:
        yield kv


def dropped(worker: Worker) -> dict[str, int]:
    return dict(worker.runtime.plane.dropped)


async def test_workers_sharing_the_key_pull_with_every_message_sealed(autojump_clock, monkeypatch):
    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")
    async with keyed(monkeypatch, a, KEY), keyed(monkeypatch, b, KEY):
        await share(a, b, [0, 1])
        entries = await b.deliver([(0, 10), (1, 11)])

        assert {e.status.value for e in entries.values()} == {"SUCCESS"}
        assert b.engine.checksum(10) == a.engine.checksum(0)
        assert all(raw[:4] == MAGIC for _, raw in world.hub.sent)
        assert dropped(a) == dropped(b) == {}


@pytest.mark.parametrize("dest_key", [OTHER, None], ids=["wrong-key", "no-key"])
async def test_a_peer_without_the_key_gets_nothing(autojump_clock, monkeypatch, dest_key):
    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")
    async with keyed(monkeypatch, a, KEY), keyed(monkeypatch, b, dest_key):
        a.engine.write(0, seed=3)
        await a.deposit([(0, 0)])
        b.kv.submit_hint(b.hint(a, [0]), request_id="r")

        entries = await b.deliver([(0, 10)])

        assert {e.status.value for e in entries.values()} == {"FAILED"}
        assert b.engine.checksum(10) != a.engine.checksum(0)
        assert dropped(a)["unauthenticated"] >= 1  # every Hello, none answered
        assert a.transport.known_agents == frozenset()  # b's metadata was never loaded
        assert [x.peer for x in a.transport.posted] == [None]  # the deposit, no write


async def test_an_unauthenticated_pull_is_dropped_and_counted(autojump_clock, monkeypatch):
    world = World()
    a = Worker(world, "a", enable_telemetry=True)
    async with keyed(monkeypatch, a, KEY):
        a.engine.write(0, seed=1)
        await a.deposit([(0, 0)])
        mallory = world.hub.channel("tcp://mallory:1")
        target = a.runtime.plane.incarnation
        dst = m.Pull.pack([(0x1000, 4096)])
        pull = m.Pull("tcp://mallory:1", 5, target, 1, [key(0)], 1, dst)
        for _ in range(3):
            mallory.send(a.endpoint, m.encode(pull))
        await trio.sleep(0.01)

        assert mallory.recv() == []  # not even an Over: nothing to learn
        assert dropped(a) == {"unauthenticated": 3}
        stats = a.kv.get_stats()
        assert stats.gauges[(STATE_METRIC, ("peer_messages_unauthenticated",))] == 3
        assert stats.gauges[(STATE_METRIC, ("peer_messages_dropped",))] == 3
        assert {name for name, _ in stats.counters} <= CONTRACT_METRICS
        assert a.runtime.index.get(key(0)).claims == 0


async def test_a_replayed_pull_is_dropped_and_writes_nothing_twice(autojump_clock, monkeypatch):
    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")
    async with keyed(monkeypatch, a, KEY), keyed(monkeypatch, b, KEY):
        await share(a, b, [0])
        assert {e.status.value for e in (await b.deliver([(0, 10)])).values()} == {"SUCCESS"}
        (sealed_pull,) = [raw for to, raw in world.hub.sent if to == a.endpoint][-1:]
        writes = len(a.transport.posted)

        world.hub.channel("tcp://mallory:1").send(a.endpoint, sealed_pull)
        await trio.sleep(0.01)

        assert dropped(a) == {"replayed": 1}
        assert len(a.transport.posted) == writes  # the deposit and the one write
        assert not a.runtime.source.jobs


async def test_a_pull_duplicated_on_the_wire_is_served_once_and_the_copy_counted(
    autojump_clock, monkeypatch
):
    world = World()
    plan = FaultPlan()
    world.fabric.plan = world.hub.plan = plan
    a, b = Worker(world, "a"), Worker(world, "b")
    async with trio.open_nursery() as nursery:
        await nursery.start(plan.run)
        async with keyed(monkeypatch, a, KEY), keyed(monkeypatch, b, KEY):
            await share(a, b, [0])
            plan.add("pull", Fault("duplicate", 0.1))

            entries = await b.deliver([(0, 10)])
            await trio.sleep(0.5)

            assert {e.status.value for e in entries.values()} == {"SUCCESS"}
            assert plan.applied == [("pull", Fault("duplicate", 0.1))]
            assert dropped(a) == {"replayed": 1}
            assert [x.peer is not None for x in a.transport.posted] == [False, True]
        nursery.cancel_scope.cancel()
