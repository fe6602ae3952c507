"""Peer control messages from outside the process: the codec and two live instances.

Read top to bottom: whatever bytes arrive, ``decode`` answers with a message or a
``MessageError`` naming the message type; then two KVCR instances on the fake fabric (under
trio's MockClock, so every example is exact and instant) take a burst of hostile traffic,
malformed or well-formed but wrong (unknown request ids, foreign or stale incarnations,
pulls aimed at another incarnation or at memory nobody registered, huge key lists, bogus
``Written`` notifications), and afterwards the source still serves a valid pull byte-exact,
nothing stays claimed or pinned, and the log names what was dropped.
"""

from __future__ import annotations

import contextlib

import msgpack
import numpy as np
import trio
import trio.testing
from fuzzing import case, fuzz, open_fds
from hypothesis import given
from hypothesis import strategies as st

from kvcr.logs import capture_events
from kvcr.transport import messages as m
from kvcr.transport.base import Segment
from kvcr.transport.fake import FakeTransport
from peer_world import Worker, World, key, share

U64 = st.integers(0, m.U64 - 1)
TEXT = st.characters(blacklist_categories=("Cs",))  # msgpack cannot encode lone surrogates
MALLORY = "tcp://mallory:1"
BLOCK = 4096  # EngineSim's default layout: one pool of 4 KiB blocks

# --- the codec ------------------------------------------------------------------------------

EXAMPLES = [
    m.Hello("tcp://h:1", 7, "agent-a", b"\x00md"),
    m.HelloAck("tcp://h:1", 7, 9, "agent-b"),
    m.Pull("tcp://h:1", 7, 9, 3, [b"k1", b"k2"], 1, m.Pull.pack([(4096, 4096), (8192, 4096)])),
    m.Written(7, 3, [0, 1]),
    m.Over("tcp://h:1", 7, 3, "none of the keys is here"),
    m.Probe("tcp://h:1", 7, 3, True),
    m.ProbeAck("tcp://h:1", 7, 3, "writing"),
]
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(allow_nan=True),
    st.text(TEXT, max_size=300),
    st.binary(max_size=300),
    st.lists(st.integers(-5, 1 << 20), max_size=5),
    st.lists(st.binary(max_size=4), max_size=5),
    st.dictionaries(st.text(TEXT, max_size=3), st.integers(-5, 5), max_size=3),
)


@st.composite
def field_mutations(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid message with one field replaced, removed or added: (its type, the bytes)."""
    message = draw(st.sampled_from(EXAMPLES))
    body = msgpack.unpackb(m.encode(message), raw=False)
    fields = [k for k in body if k not in ("v", "t")]
    how = draw(st.sampled_from(["replace", "remove", "add"]))
    if how == "replace":
        body[draw(st.sampled_from(fields))] = draw(JUNK)
    elif how == "remove":
        del body[draw(st.sampled_from(fields))]
    else:
        body[draw(st.text(TEXT, min_size=1, max_size=8).filter(lambda k: k not in body))] = draw(
            JUNK
        )
    return message.TYPE, msgpack.packb(body, use_bin_type=True)


@st.composite
def byte_mutations(draw: st.DrawFn) -> bytes:
    raw = bytearray(m.encode(draw(st.sampled_from(EXAMPLES))))
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["flip", "cut", "splice"]))
        if how == "flip" and raw:
            raw[draw(st.integers(0, len(raw) - 1))] ^= draw(st.integers(1, 255))
        elif how == "cut":
            del raw[draw(st.integers(0, len(raw))) :]
        else:
            at = draw(st.integers(0, len(raw)))
            raw[at:at] = draw(st.binary(min_size=1, max_size=16))
    return bytes(raw)


@fuzz(600)
@given(st.one_of(st.binary(max_size=200), byte_mutations()))
def test_any_bytes_decode_to_a_valid_message_or_a_message_error(raw: bytes) -> None:
    case("peer message (codec)")
    try:
        message = m.decode(raw)
    except m.MessageError as exc:
        assert str(exc).startswith("peer message") and len(str(exc)) < 400
    else:
        assert m.decode(m.encode(message)) == message  # what was accepted is fully valid


@fuzz(600)
@given(field_mutations())
def test_a_wrong_field_in_a_known_message_type_is_an_error_naming_the_type(drawn) -> None:
    case("peer message (codec)")
    kind, raw = drawn
    try:
        message = m.decode(raw)
    except m.MessageError as exc:
        assert str(exc).startswith(f"peer message {kind!r}: "), str(exc)
        assert len(str(exc)) < 400
    else:
        assert kind == message.TYPE and m.decode(m.encode(message)) == message


# --- two live instances ---------------------------------------------------------------------


class Mallory:
    """A third party on the fabric: a control endpoint and a fake NIXL agent with one
    registered buffer (so the source's writes into it are checked like NIXL checks them)."""

    def __init__(self, world: World) -> None:
        self.channel = world.hub.channel(MALLORY)
        self.buffer = np.zeros(4 * BLOCK, dtype=np.uint8)
        self.transport = FakeTransport("mallory", trio.current_time, world.fabric)
        self.transport.open_local([Segment("m", self.buffer.ctypes.data, BLOCK, 4)])
        self.incarnation = 0xBAD

    def hello(self) -> bytes:
        return m.encode(m.Hello(MALLORY, self.incarnation, "mallory", self.transport.metadata()))


def _ranges(draw: st.DrawFn, mallory_base: int, count: int) -> bytes:
    """Destination ranges for ``count`` keys: inside Mallory's buffer, outside anything
    registered, or of the wrong size."""
    pairs = []
    for _ in range(count):
        kind = draw(st.sampled_from(["inside", "outside", "wrong-size"]))
        if kind == "inside":
            pairs.append((mallory_base + BLOCK * draw(st.integers(0, 3)), BLOCK))
        elif kind == "outside":
            pairs.append((draw(st.integers(1, (1 << 47))), BLOCK))
        else:
            pairs.append((mallory_base, draw(st.integers(1, 3 * BLOCK)).__or__(1)))
    return m.Pull.pack(pairs)


@st.composite
def hostile(draw: st.DrawFn, ids: dict) -> tuple[str, str, bytes]:
    """One piece of hostile traffic: (where: "a" | "b" | "notif-b", what kind, bytes).

    ``ids`` holds the live values (incarnations, Mallory's buffer) so that messages can be
    well-formed and aimed at real state: a's and b's incarnations, the request id b used.
    """
    a_inc, b_inc = ids["a"], ids["b"]
    endpoint = st.sampled_from([MALLORY, ids["a_ep"], ids["b_ep"], "tcp://nobody:9"])
    foreign = st.one_of(st.just(0xBAD), U64.filter(lambda x: x not in (a_inc, b_inc)))
    req = st.one_of(st.integers(0, 4), U64)
    kind = draw(
        st.sampled_from(
            [
                "garbage",
                "mutated",
                "pull",
                "big-pull",
                "probe",
                "hello",
                "hello-ack",
                "over",
                "probe-ack",
                "written",
                "notif-garbage",
                "notif-other",
                "control-written",
            ]
        )
    )
    if kind == "garbage":
        return draw(st.sampled_from("ab")), kind, draw(st.binary(max_size=64))
    if kind == "mutated":
        return draw(st.sampled_from("ab")), kind, draw(byte_mutations())
    if kind in ("pull", "big-pull"):
        n = draw(st.integers(1, 6)) if kind == "pull" else draw(st.integers(500, 4096))
        known = [key(i) for i in range(4)]
        keys = draw(
            st.lists(
                st.one_of(st.sampled_from(known), st.binary(min_size=1, max_size=16)),
                min_size=n,
                max_size=n,
                unique=True,
            )
            if n <= 6
            else st.just(known + [b"x%d" % i for i in range(n - len(known))])
        )
        pools = draw(st.sampled_from([1, 1, 1, 2, m.MAX_POOLS]))
        dst = b"".join(
            _ranges(draw, ids["mallory_base"], len(keys)) if p == 0 else m.Pull.pack([(1, 1)])
            for p in range(pools)
        )[: 16 * pools * len(keys)]
        dst = dst.ljust(16 * pools * len(keys), b"\x01")
        msg = m.Pull(
            MALLORY,
            draw(st.one_of(st.just(0xBAD), foreign)),
            draw(st.one_of(st.just(a_inc), U64)),
            draw(req),
            keys,
            pools,
            dst,
        )
        return "a", kind, m.encode(msg)
    if kind == "probe":
        msg = m.Probe(draw(endpoint), draw(foreign), draw(req), draw(st.booleans()))
        return "a", kind, m.encode(msg)
    if kind == "hello":
        metadata = draw(st.one_of(st.binary(max_size=32), st.just(b"fake:")))
        return "a", kind, m.encode(m.Hello(MALLORY, draw(foreign), "mallory", metadata))
    if kind == "hello-ack":
        msg = m.HelloAck(
            draw(endpoint), draw(foreign), draw(st.sampled_from([b_inc, a_inc, 1])), "a"
        )
        return "b", kind, m.encode(msg)
    if kind == "over":
        inc = draw(st.one_of(st.just(a_inc), foreign))
        msg = m.Over(draw(endpoint), inc, draw(req), draw(st.text(TEXT, max_size=20)))
        return "b", kind, m.encode(msg)
    if kind == "probe-ack":
        inc = draw(st.one_of(st.just(a_inc), foreign))
        state = draw(st.sampled_from(m.PROBE_STATES))
        return "b", kind, m.encode(m.ProbeAck(draw(endpoint), inc, draw(req), state))
    if kind == "written":
        indices = draw(st.lists(st.integers(0, m.MAX_KEYS - 1), max_size=8))
        inc = draw(st.one_of(st.just(a_inc), foreign))
        return "notif-b", kind, m.encode(m.Written(inc, draw(req), indices))
    if kind == "notif-garbage":
        return "notif-b", kind, draw(st.binary(max_size=64))
    if kind == "notif-other":
        return "notif-b", kind, m.encode(m.Over(ids["a_ep"], a_inc, 1, "x"))
    return "a", kind, m.encode(m.Written(draw(foreign), draw(req), [0]))


# The log event kind each piece of traffic is dropped under, when it is dropped whole.
DROPPED_AS = {
    "garbage": "bad_message",
    "control-written": "unexpected_message",
    "notif-garbage": "bad_notification",
    "notif-other": "unexpected_notification",
}


@contextlib.asynccontextmanager
async def closing(world: World):
    """Close every control channel of ``world`` (each holds a pipe) when the example ends."""
    try:
        yield
    finally:
        for channel in world.hub.channels.values():
            channel.close()


def run(scenario) -> None:
    """One example in a fresh trio loop under MockClock; it leaves no descriptor open."""
    before = open_fds()
    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
    assert open_fds() == before, "an example leaked file descriptors"


@fuzz(60)
@given(st.data())
def test_hostile_peer_traffic_leaves_the_source_serving_valid_pulls(data) -> None:
    case("peer message (live pair)")

    async def scenario() -> None:
        world = World()
        a, b = Worker(world, "a"), Worker(world, "b")
        mallory = Mallory(world)
        async with closing(world), a.running(), b.running():
            await share(a, b, [0, 1, 2, 3])
            assert a.engine.statuses(await b.deliver([(0, 10)])) == {key(0): "SUCCESS"}
            ids = {
                "a": a.runtime.plane.incarnation,
                "b": b.runtime.plane.incarnation,
                "a_ep": a.endpoint,
                "b_ep": b.endpoint,
                "mallory_base": mallory.buffer.ctypes.data,
            }
            traffic = data.draw(st.lists(hostile(ids), min_size=1, max_size=12), "traffic")
            with capture_events() as events:
                mallory.channel.send(a.endpoint, mallory.hello())
                for where, _kind, raw in traffic:
                    if where == "notif-b":
                        b.transport.inject_notification(
                            data.draw(st.sampled_from(["a", "zz"])), raw
                        )
                    else:
                        mallory.channel.send(a.endpoint if where == "a" else b.endpoint, raw)
                    await trio.sleep(0.001)
                await trio.sleep(a.engine.config.abandon_timeout_ms / 1000)  # all jobs over

            # The source still serves a valid pull, byte-exact, from the same request's hint.
            entries = await b.deliver([(1, 11), (2, 12), (3, 13)])
            assert b.engine.statuses(entries) == dict.fromkeys([key(1), key(2), key(3)], "SUCCESS")
            for i in (1, 2, 3):
                assert b.engine.checksum(10 + i) == a.engine.checksum(i)
            await trio.sleep(0.01)
            # Nothing of the hostile traffic is still held: no claims, no pins, no jobs.
            index = a.runtime.index
            assert all(index.get(key(i)).claims == 0 for i in range(4))
            assert not a.pins.pinned and not a.runtime.source.jobs
            assert not a.runtime.source.stalled
            assert a.recorder.resilience == [] and b.recorder.resilience == []
            # What was dropped whole is named in the log (one event per kind per instance).
            dropped = {e["kind"] for e in events if e["event"] == "peer_message_dropped"}
            for _where, kind, _raw in traffic:
                if kind in DROPPED_AS:
                    assert DROPPED_AS[kind] in dropped, (kind, dropped)
            assert not [e for e in events if e["event"] == "peer_handler_failed"]

    run(scenario)


# --- regressions found by the fuzzing above -------------------------------------------------


async def _pull_after(message_to_b) -> dict:
    """b pulled from a once; then ``message_to_b(a, b)`` arrives at b from a third party;
    what does b's next pull from a give?"""
    world = World()
    a, b = Worker(world, "a"), Worker(world, "b")
    async with closing(world), a.running(), b.running():
        await share(a, b, [0, 1])
        assert b.engine.statuses(await b.deliver([(0, 10)])) == {key(0): "SUCCESS"}
        world.hub.channel(MALLORY).send(b.endpoint, m.encode(message_to_b(a, b)))
        await trio.sleep(0.5)
        return b.engine.statuses(await b.deliver([(1, 11)]))


async def test_an_unsolicited_hello_ack_with_a_foreign_incarnation_does_not_switch_the_link(
    autojump_clock,
):
    # Before the fix the link took 0xBAD as the source's incarnation, put the real one on
    # its "gone" list, and from then on dropped every answer of the real source.
    def ack(a, b):
        return m.HelloAck(a.endpoint, 0xBAD, b.runtime.plane.incarnation, "a")

    assert await _pull_after(ack) == {key(1): "SUCCESS"}


async def test_an_over_about_no_pull_of_ours_does_not_switch_the_link(autojump_clock):
    # A restarted source reveals itself by turning away one of our pulls; an Over or a
    # ProbeAck naming a request that is not in flight is dropped, not taken as a restart.
    def over(a, b):
        return m.Over(a.endpoint, 0xBAD, 77, "x")

    def probe_ack(a, b):
        return m.ProbeAck(a.endpoint, 0xBAD, 1, "over")

    assert await _pull_after(over) == {key(1): "SUCCESS"}
    assert await _pull_after(probe_ack) == {key(1): "SUCCESS"}
