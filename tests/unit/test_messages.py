"""Behaviour of the peer control codec (``kvcr.transport.messages``).

Read top to bottom: every message type survives encode/decode unchanged and says what it
is on the wire; everything a peer could send that is not a valid message is a
``MessageError`` whose text names the message type and the field; random bytes and random
msgpack structures never escape as anything else; and decoding a large pull is cheap.
"""

from __future__ import annotations

import statistics
import time

import attrs
import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvcr.transport import messages as m
from kvcr.transport.messages import (
    MAX_ENDPOINT,
    MAX_KEY_BYTES,
    MAX_KEYS,
    MAX_MESSAGE_BYTES,
    MAX_POOLS,
    PROBE_STATES,
    PROTOCOL_VERSION,
    TYPES,
    U64,
    Confirm,
    Hello,
    HelloAck,
    MessageError,
    Over,
    Probe,
    ProbeAck,
    Pull,
    Written,
    decode,
    encode,
)

EP = "tcp://10.0.0.7:5555"

# One valid instance of every message type.
EXAMPLES = [
    Hello(sender=EP, incarnation=7, agent="agent-a", metadata=b"\x00nixl-md\xff"),
    HelloAck(sender=EP, incarnation=7, acked=9, agent="agent-b"),
    Pull(
        sender=EP,
        incarnation=7,
        target=9,
        req=1,
        keys=[b"k0", b"k1"],
        pools=2,
        dst=Pull.pack([(4096, 512), (16384, 256), (8192, 512), (12288, 256)]),
        move=True,
    ),
    Written(incarnation=9, req=1, indices=[0, 1]),
    Confirm(sender=EP, incarnation=7, req=1, indices=[1]),
    Over(sender=EP, incarnation=9, req=1, reason="nothing to write"),
    Probe(sender=EP, incarnation=7, req=1, cancel=True),
    ProbeAck(sender=EP, incarnation=9, req=1, state="writing"),
]
VALID_FIELDS = {
    type(msg).TYPE: attrs.asdict(msg, recurse=False) for msg in EXAMPLES
}  # type name -> field values of the example above
FIELD_NAMES = sorted({name for fields in VALID_FIELDS.values() for name in fields})


def wire(kind: str, **changes) -> bytes:
    """The example ``kind`` message as raw msgpack, with fields changed (``...`` drops one).

    ``v`` and ``t`` are fields here too, so the envelope can be broken the same way.
    """
    body = {"v": PROTOCOL_VERSION, "t": kind, **VALID_FIELDS[kind]}
    for name, value in changes.items():
        if value is ...:
            body.pop(name)
        else:
            body[name] = value
    return msgpack.packb(body, use_bin_type=True)


# --- round trips ---------------------------------------------------------------------------


def test_there_is_one_example_of_every_message_type():
    assert sorted(type(msg).TYPE for msg in EXAMPLES) == sorted(TYPES)


def test_a_copy_pull_leaves_move_off_the_wire_so_older_sources_read_it():
    copy = attrs.evolve(EXAMPLES[2], move=False)

    raw = msgpack.unpackb(encode(copy), raw=False)

    assert "move" not in raw
    assert decode(encode(copy)) == copy


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda msg: type(msg).TYPE)
def test_every_message_type_round_trips_equal(message):
    decoded = decode(encode(message))

    assert decoded == message
    assert type(decoded) is type(message)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda msg: type(msg).TYPE)
def test_the_encoded_form_is_one_map_with_version_type_and_exactly_the_fields(message):
    raw = msgpack.unpackb(encode(message), raw=False)

    assert raw["v"] == PROTOCOL_VERSION == 1
    assert raw["t"] == type(message).TYPE
    assert set(raw) == {"v", "t"} | {f.name for f in attrs.fields(type(message))}


def test_bytes_travel_as_msgpack_bin_and_text_as_msgpack_str():
    raw = msgpack.unpackb(encode(EXAMPLES[0]), raw=True)  # raw=True keeps str as bytes

    assert raw[b"metadata"] == b"\x00nixl-md\xff"
    # With raw=False a bin stays bytes while a str becomes str: the two never mix.
    assert msgpack.unpackb(encode(EXAMPLES[0]), raw=False)["metadata"] == b"\x00nixl-md\xff"


def test_bounds_are_inclusive_at_the_top():
    biggest = U64 - 1
    hello = Hello(sender="x" * MAX_ENDPOINT, incarnation=biggest, agent="a", metadata=b"")
    pull = Pull(
        sender=EP,
        incarnation=0,
        target=biggest,
        req=biggest,
        keys=[b"k" * MAX_KEY_BYTES],
        pools=MAX_POOLS,
        dst=Pull.pack([(biggest, biggest)] * MAX_POOLS),
    )
    written = Written(incarnation=0, req=0, indices=[MAX_KEYS - 1])

    for message in (hello, pull, written):
        assert decode(encode(message)) == message


def test_a_pull_may_name_no_keys():
    empty = Pull(sender=EP, incarnation=1, target=2, req=3, keys=[], pools=1, dst=b"")

    assert decode(encode(empty)) == empty


def test_pull_ranges_come_back_key_by_key_and_pool_by_pool():
    pull = EXAMPLES[2]
    assert list(pull.ranges()) == [4096, 512, 16384, 256, 8192, 512, 12288, 256]


# --- rejections ----------------------------------------------------------------------------


def field_error(kind, field):
    """A pattern for a MessageError about ``field`` of a ``kind`` message."""
    return rf"peer message '{kind}': .*\b{field}\b"


TOO_MANY_KEYS = [i.to_bytes(3, "big") for i in range(MAX_KEYS + 1)]

REJECTED = [
    # The envelope: what is not a message at all.
    pytest.param(bytearray(wire("hello")), r"peer message: expected bytes, got bytearray", id="not-bytes-bytearray"),
    pytest.param("hello", r"peer message: expected bytes, got str", id="not-bytes-str"),
    pytest.param(None, r"peer message: expected bytes, got NoneType", id="not-bytes-none"),
    pytest.param(b"\x00" * (MAX_MESSAGE_BYTES + 1), rf"peer message: {MAX_MESSAGE_BYTES + 1} bytes, at most {MAX_MESSAGE_BYTES}", id="oversize"),
    pytest.param(b"", r"peer message: not msgpack", id="empty"),
    pytest.param(b"\xc1", r"peer message: not msgpack", id="not-msgpack-reserved-byte"),
    pytest.param(wire("hello")[:-1], r"peer message: not msgpack", id="not-msgpack-truncated"),
    pytest.param(wire("hello") + b"\x00", r"peer message: not msgpack", id="not-msgpack-trailing-data"),
    pytest.param(msgpack.packb({1: 2}), r"peer message: not msgpack", id="map-with-non-string-key"),
    pytest.param(msgpack.packb([1, "hello"]), r"peer message: expected a map, got list", id="not-a-map-list"),
    pytest.param(msgpack.packb(1), r"peer message: expected a map, got int", id="not-a-map-int"),
    pytest.param(wire("hello", v=2), r"peer message: protocol version 2, expected 1", id="wrong-version"),
    pytest.param(wire("hello", v=0), r"peer message: protocol version 0, expected 1", id="version-zero"),
    pytest.param(wire("hello", v="1"), r"peer message: protocol version '1', expected 1", id="version-as-str"),
    pytest.param(wire("hello", v=...), r"peer message: protocol version None, expected 1", id="missing-version"),
    pytest.param(wire("hello", v=True), r"peer message: protocol version", id="version-as-bool"),
    pytest.param(wire("hello", v=1.0), r"peer message: protocol version", id="version-as-float"),
    pytest.param(wire("hello", t="goodbye"), r"peer message: unknown type 'goodbye'", id="unknown-type"),
    pytest.param(wire("hello", t="Hello"), r"peer message: unknown type 'Hello'", id="type-is-case-sensitive"),
    pytest.param(wire("hello", t=3), r"peer message: unknown type '3'", id="type-not-a-string"),
    pytest.param(wire("hello", t=...), r"peer message: unknown type 'None'", id="missing-type"),
    pytest.param(wire("hello", t="x" * 100), r"peer message: unknown type 'x{40}'$", id="unknown-type-is-cut-to-40-chars"),
    # Fields present or absent.
    pytest.param(wire("hello", agent=...), r"^peer message 'hello': missing field agent$", id="missing-field"),
    pytest.param(wire("pull", dst=...), r"^peer message 'pull': missing field dst$", id="missing-field-pull-dst"),
    pytest.param(wire("written", req=...), r"^peer message 'written': missing field req$", id="missing-field-written-req"),
    pytest.param(wire("hello", bogus=1), field_error("hello", "bogus"), id="extra-field"),
    pytest.param(wire("written", sender=EP), field_error("written", "sender"), id="extra-field-from-another-type"),
    # Field types: an int is an int, not a bool or a string; bytes are not str and so on.
    pytest.param(wire("hello", incarnation=True), field_error("hello", "incarnation"), id="bool-for-int"),
    pytest.param(wire("hello", incarnation="7"), field_error("hello", "incarnation"), id="str-for-int"),
    pytest.param(wire("hello", incarnation=7.0), field_error("hello", "incarnation"), id="float-for-int"),
    pytest.param(wire("hello", metadata="md"), field_error("hello", "metadata"), id="str-for-bytes"),
    pytest.param(wire("hello", sender=5), field_error("hello", "sender"), id="int-for-str"),
    pytest.param(wire("hello", sender=EP.encode()), field_error("hello", "sender"), id="bytes-for-str"),
    pytest.param(wire("hello", agent=None), field_error("hello", "agent"), id="nil-for-str"),
    pytest.param(wire("probe", cancel=1), field_error("probe", "cancel"), id="int-for-bool"),
    pytest.param(wire("pull", keys=["k0", "k1"]), field_error("pull", "keys"), id="str-keys"),
    pytest.param(wire("pull", keys=b"k0k1"), field_error("pull", "keys"), id="bytes-for-list-of-keys"),
    pytest.param(wire("pull", dst=[[(4096, 512)], []]), field_error("pull", "dst"), id="list-for-packed-dst"),
    pytest.param(wire("pull", pools=True), field_error("pull", "pools"), id="bool-for-pools"),
    pytest.param(wire("written", indices=[True]), field_error("written", "indices"), id="bool-index"),
    # Ranges and sizes.
    pytest.param(wire("hello", incarnation=-1), field_error("hello", "incarnation"), id="negative-incarnation"),
    pytest.param(wire("hello_ack", acked=-(2**63)), field_error("hello_ack", "acked"), id="negative-acked"),
    pytest.param(wire("pull", target=-5), field_error("pull", "target"), id="negative-target"),
    pytest.param(wire("probe", req=-1), field_error("probe", "req"), id="negative-req"),
    pytest.param(wire("hello", sender=""), field_error("hello", "sender"), id="empty-endpoint"),
    pytest.param(wire("hello", sender="x" * (MAX_ENDPOINT + 1)), field_error("hello", "sender"), id="endpoint-too-long"),
    pytest.param(wire("hello_ack", agent=""), field_error("hello_ack", "agent"), id="empty-agent"),
    pytest.param(wire("hello", metadata=b"m" * ((1 << 20) + 1)), field_error("hello", "metadata"), id="metadata-too-long"),
    pytest.param(wire("over", reason="r" * 513), field_error("over", "reason"), id="reason-too-long"),
    pytest.param(wire("pull", keys=TOO_MANY_KEYS, dst=b""), field_error("pull", "keys"), id="too-many-keys"),
    pytest.param(wire("pull", keys=[b"k0", b"k0"]), field_error("pull", "keys.*unique"), id="duplicate-keys"),
    pytest.param(wire("pull", keys=[b"k0", b""]), field_error("pull", "keys"), id="empty-key"),
    pytest.param(wire("pull", keys=[b"k0", b"k" * (MAX_KEY_BYTES + 1)]), field_error("pull", "keys"), id="key-too-long"),
    pytest.param(wire("pull", dst=Pull.pack([(4096, 512)] * 3)), field_error("pull", "dst"), id="dst-shorter-than-keys"),
    pytest.param(wire("pull", dst=Pull.pack([(4096, 512)] * 5)), field_error("pull", "dst"), id="dst-longer-than-keys"),
    pytest.param(wire("pull", dst=Pull.pack([(4096, 512)] * 4)[:-1]), field_error("pull", "dst"), id="dst-not-whole-u64s"),
    pytest.param(wire("pull", dst=Pull.pack([(0, 512)] + [(4096, 512)] * 3)), field_error("pull", "dst"), id="zero-addr"),
    pytest.param(wire("pull", dst=Pull.pack([(4096, 0)] + [(4096, 512)] * 3)), field_error("pull", "dst"), id="zero-nbytes"),
    pytest.param(wire("pull", pools=0), field_error("pull", "pools"), id="no-pools"),
    pytest.param(wire("pull", pools=MAX_POOLS + 1), field_error("pull", "pools"), id="too-many-pools"),
    pytest.param(wire("written", indices=[0, MAX_KEYS]), field_error("written", "indices"), id="index-too-big"),
    pytest.param(wire("written", indices=[-1]), field_error("written", "indices"), id="negative-index"),
    pytest.param(wire("probe_ack", state="done"), field_error("probe_ack", "state"), id="unknown-probe-state"),
    pytest.param(wire("probe_ack", state="PENDING"), field_error("probe_ack", "state"), id="probe-state-is-case-sensitive"),
]  # fmt: skip


@pytest.mark.parametrize(("data", "match"), REJECTED)
def test_decode_rejects_with_a_message_naming_type_and_field(data, match):
    with pytest.raises(MessageError, match=match):
        decode(data)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(wire("hello", t="t" * 100_000), id="huge-type"),
        pytest.param(wire("hello", sender="s" * 100_000), id="huge-endpoint"),
        pytest.param(wire("pull", keys=["k"] * 10_000), id="many-wrong-keys"),
        pytest.param(wire("hello", bogus="b" * 100_000), id="huge-extra-field"),
        pytest.param(wire("hello", v="v" * 100_000), id="huge-version"),
        pytest.param(wire("hello", v=[0] * 100_000), id="long-version-list"),
    ],
)  # fmt: skip
def test_the_error_text_stays_short_whatever_the_peer_sends(data):
    with pytest.raises(MessageError) as error:
        decode(data)

    assert len(str(error.value)) <= 400


def test_message_error_is_a_value_error():
    assert issubclass(MessageError, ValueError)


def test_the_size_limit_is_inclusive():
    padded = wire("over", reason="")
    # Pad with a bin field that makes the frame exactly MAX_MESSAGE_BYTES: only the size
    # check can pass it, and then the extra field is what rejects it.
    body = msgpack.unpackb(padded, raw=False)
    body["pad"] = b""
    overhead = len(msgpack.packb(body, use_bin_type=True)) + 3  # bin8 -> bin32 header
    body["pad"] = b"p" * (MAX_MESSAGE_BYTES - overhead)
    data = msgpack.packb(body, use_bin_type=True)
    assert len(data) == MAX_MESSAGE_BYTES

    with pytest.raises(MessageError, match=r"^peer message 'over'"):
        decode(data)
    with pytest.raises(MessageError, match=r"bytes, at most"):
        decode(data + b"\x00")


def test_integers_of_2_to_the_64_cannot_be_carried_by_msgpack_at_all():
    """So ``>= 2**64`` never reaches decode; the message classes reject it themselves."""
    with pytest.raises(OverflowError):
        msgpack.packb(U64)


@pytest.mark.parametrize(
    ("build", "field"),
    [
        pytest.param(lambda: Hello(EP, U64, "a", b""), "incarnation", id="hello-incarnation"),
        pytest.param(lambda: HelloAck(EP, 1, U64, "a"), "acked", id="hello-ack-acked"),
        pytest.param(lambda: Pull(EP, 1, U64, 1, [], 1, b""), "target", id="pull-target"),
        pytest.param(lambda: Written(1, U64, []), "req", id="written-req"),
    ],
)
def test_messages_cannot_be_built_with_integers_of_2_to_the_64(build, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        build()


# --- properties ----------------------------------------------------------------------------

endpoints = st.text(min_size=1, max_size=MAX_ENDPOINT)
u64s = st.integers(0, U64 - 1)
positive_u64s = st.integers(1, U64 - 1)


@st.composite
def pulls(draw):
    keys = draw(st.lists(st.binary(min_size=1, max_size=MAX_KEY_BYTES), unique=True, max_size=8))
    pools = draw(st.integers(1, 3))
    ranges = draw(
        st.lists(
            st.tuples(positive_u64s, positive_u64s),
            min_size=pools * len(keys),
            max_size=pools * len(keys),
        )
    )
    return Pull(draw(endpoints), draw(u64s), draw(u64s), draw(u64s), keys, pools, Pull.pack(ranges))


messages = st.one_of(
    st.builds(Hello, endpoints, u64s, endpoints, st.binary(max_size=4096)),
    st.builds(HelloAck, endpoints, u64s, u64s, endpoints),
    pulls(),
    st.builds(Written, u64s, u64s, st.lists(st.integers(0, MAX_KEYS - 1), max_size=32)),
    st.builds(Over, endpoints, u64s, u64s, st.text(max_size=512)),
    st.builds(Probe, endpoints, u64s, u64s, st.booleans()),
    st.builds(ProbeAck, endpoints, u64s, u64s, st.sampled_from(PROBE_STATES)),
)

# Anything msgpack can carry, with the real field names among the map keys.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), U64 - 1),
    st.integers(-3, 3),
    st.floats(allow_nan=False),
    st.text(max_size=12),
    st.binary(max_size=12),
    st.sampled_from((*PROBE_STATES, EP, "hello", "pull")),
)
map_keys = st.one_of(st.sampled_from([*FIELD_NAMES, "v", "t"]), st.text(max_size=8))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(map_keys, inner, max_size=4),
    ),
    max_leaves=16,
)


@st.composite
def structures(draw):
    """A map that looks like a message: a real or random type and version, fields whose
    names are mostly real and whose values are anything."""
    kind = draw(st.one_of(st.sampled_from(sorted(TYPES)), values))
    version = draw(st.one_of(st.just(PROTOCOL_VERSION), values))
    body = {"v": version, "t": kind}
    body.update(draw(st.dictionaries(map_keys, values, max_size=8)))
    if draw(st.booleans()):
        for name in draw(st.sets(st.sampled_from(FIELD_NAMES), max_size=3)):
            body.pop(name, None)
    return body


@st.composite
def mutated_messages(draw):
    """A valid message with a few fields replaced, dropped or added: near misses."""
    body = msgpack.unpackb(encode(draw(messages)), raw=False)
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.one_of(st.sampled_from(sorted(body)), map_keys))
        if draw(st.booleans()):
            body[name] = draw(values)
        else:
            body.pop(name, None)
    return body


def decode_or_reject(data):
    """decode ``data``; a MessageError is fine, anything else escapes and fails the test."""
    try:
        return decode(data)
    except MessageError:
        return None


def assert_reencodes_equal(message):
    again = decode(encode(message))
    assert again == message
    assert encode(again) == encode(message)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_raise_anything_but_message_error(data):
    message = decode_or_reject(data)
    if message is not None:
        assert_reencodes_equal(message)


@settings(max_examples=300, deadline=None)
@given(messages, st.data())
def test_damaged_encodings_never_raise_anything_but_message_error(message, data):
    encoded = bytearray(encode(message))
    position = data.draw(st.integers(0, len(encoded) - 1))
    how = data.draw(st.sampled_from(["flip", "truncate", "insert"]))
    if how == "flip":
        encoded[position] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        del encoded[position:]
    else:
        encoded.insert(position, data.draw(st.integers(0, 255)))

    decoded = decode_or_reject(bytes(encoded))
    if decoded is not None:
        assert_reencodes_equal(decoded)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(structures(), mutated_messages(), values))
def test_arbitrary_msgpack_structures_never_raise_anything_but_message_error(structure):
    try:
        data = msgpack.packb(structure, use_bin_type=True)
    except (ValueError, OverflowError):
        assume(False)  # not representable in msgpack (e.g. a map with an unhashable key)
    decoded = decode_or_reject(data)
    if decoded is not None:
        assert_reencodes_equal(decoded)


@settings(max_examples=300, deadline=None)
@given(messages)
def test_valid_messages_round_trip(message):
    encoded = encode(message)

    assert decode(encoded) == message
    assert encode(decode(encoded)) == encoded


# --- cost ----------------------------------------------------------------------------------


def test_decoding_a_pull_of_256_keys_is_cheap(record_property):
    """Measured, not tuned: the bound is two orders of magnitude above what it takes."""
    keys = [i.to_bytes(4, "big") * 8 for i in range(256)]  # 32-byte keys, like content hashes
    pull = Pull(
        sender=EP,
        incarnation=U64 - 1,
        target=U64 - 2,
        req=12345,
        keys=keys,
        pools=2,
        dst=Pull.pack([r for i in range(256) for r in ((0x7F00_0000_0000 + i * 4096, 4096), (0x7E00_0000_0000 + i * 4096, 4096))]),
    )  # fmt: skip
    data = encode(pull)
    assert decode(data) == pull

    samples = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(50):
            decode(data)
        samples.append((time.perf_counter() - start) / 50)
    per_decode = statistics.median(samples)
    record_property("pull_256_keys_bytes", len(data))
    record_property("pull_256_keys_decode_seconds", per_decode)
    print(f"decode of a 256-key Pull ({len(data)} bytes): {per_decode * 1e6:.0f} us")

    assert per_decode < 0.05


def test_types_maps_each_wire_name_to_its_class():
    """``m.Message`` is the union decode returns; ``TYPES`` maps wire names to classes."""
    assert set(TYPES.values()) == set(m.Message.__args__)
    assert all(name == cls.TYPE for name, cls in TYPES.items())
