"""Behaviour of the guard service wire protocol (``kvcr.guard.protocol``).

Read top to bottom: every message survives a trip through a frame unchanged, however the
stream is cut; a frame is a 4-byte big-endian length and a msgpack map ``{"v": 1, "t": ...}``;
everything else a peer could send is a ``KVCRMsgFramingError`` naming the problem, after
which the reader refuses all further input; arbitrary byte streams never escape as anything
else; and descriptors passed with a frame over a Unix socket arrive usable, or are closed
by the helper when the frame cannot be decoded.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading

import attrs
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcr.errors import KVCRMsgFramingError, KVCRServiceError, KVCRSocketError
from kvcr.guard.fdpass import recv_frame_with_fds, recv_message_with_fds, send_frame_with_fds
from kvcr.guard.protocol import (
    GROUP_STATES,
    MAX_FRAME,
    PROTOCOL_VERSION,
    REFUSAL_CODES,
    TYPES,
    U64,
    ClaimGranted,
    ClaimRefused,
    ClaimRequest,
    FrameReader,
    G3Description,
    GroupStatus,
    Heartbeat,
    Release,
    ReleaseAck,
    StatusReply,
    StatusRequest,
    decode_body,
    encode,
    encode_frame,
)

G3 = G3Description(
    paths=["/mnt/g3/a", "/mnt/g3/b"],
    capacity_bytes_per_file=1 << 30,
    backend="POSIX",
    backend_options={"use_direct_io": "true"},
)
CLAIM = ClaimRequest(
    guard_index=0,
    pool_layouts=[("kv", 1 << 30), ("mamba", 4096)],
    compatibility_digest="sha256:abc",
    control_host="10.0.0.1",
    control_port=5555,
    g3=G3,
    remote_fw_dram_backend="UCX",
    pid=4242,
)
GRANTED = ClaimGranted(
    guard_index=3,
    lease=U64 - 1,
    pools=[("kv", 100 << 20, 1 << 30), ("mamba", (100 << 20) + (1 << 30), 4096)],
    journal_offset=0,
    journal_size=100 << 20,
    group_path="/dev/shm/kvcr/group-3",
    control_host="10.0.0.1",
    control_port=5555,
)
STATUS = StatusReply(
    groups=[
        GroupStatus(index=0, state="idle", holder_pid=None, layouts=[], control_port=None),
        GroupStatus(
            index=1, state="serving", holder_pid=77, layouts=[("kv", 4096)], control_port=6000
        ),
    ]
)
SAMPLES = [
    CLAIM,
    ClaimRequest(
        guard_index=7,
        pool_layouts=[("kv", 1)],
        compatibility_digest="d",
        control_host="::1",
        control_port=0,
        g3=None,
        remote_fw_dram_backend="UCX",
        pid=1,
    ),
    GRANTED,
    attrs.evolve(GRANTED, heartbeat_ms=50),
    attrs.evolve(CLAIM, reattach=True),
    Heartbeat(guard_index=3, lease=12345, seq=0),
    Heartbeat(guard_index=0, lease=(1 << 64) - 1, seq=(1 << 64) - 1),
    *(ClaimRefused(code=code, message=f"because {code}") for code in REFUSAL_CODES),
    ClaimRefused(code="bad_request", message=""),
    Release(guard_index=3, lease=12345, activated=True),
    Release(guard_index=0, lease=0, activated=False),
    ReleaseAck(guard_index=3, lease=12345),
    StatusRequest(),
    StatusReply(groups=[]),
    STATUS,
]


def frames(*messages) -> bytes:
    return b"".join(encode_frame(m) for m in messages)


def raw_frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


def body(kind: str, **fields) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": kind, **fields}, use_bin_type=True)


# --- round trips ---


def test_samples_cover_every_type():
    assert {type(m) for m in SAMPLES} == set(TYPES.values())
    assert {cls.TYPE for cls in TYPES.values()} == set(TYPES)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_a_frame(message):
    frame = encode_frame(message)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    assert frame[4:] == encode(message)
    wire = msgpack.unpackb(frame[4:])
    assert wire["v"] == 1
    assert wire["t"] == message.TYPE
    assert decode_body(frame[4:]) == message
    assert FrameReader().feed(frame) == [message]


def test_pool_entries_are_tuples_after_decoding():
    decoded = decode_body(encode(CLAIM))
    assert decoded.pool_layouts == [("kv", 1 << 30), ("mamba", 4096)]
    assert all(type(entry) is tuple for entry in decoded.pool_layouts)
    assert decoded.g3 == G3


def test_a_stream_fed_one_byte_at_a_time_decodes_the_same():
    stream = frames(*SAMPLES)
    reader = FrameReader()
    got = []
    for i in range(len(stream)):
        got += reader.feed(stream[i : i + 1])
    assert got == SAMPLES
    assert reader.pending == 0


def test_a_frame_split_at_every_boundary_decodes_the_same():
    frame = encode_frame(CLAIM)
    for cut in range(len(frame) + 1):
        reader = FrameReader()
        assert reader.feed(frame[:cut]) + reader.feed(frame[cut:]) == [CLAIM]


def test_several_frames_in_one_feed():
    reader = FrameReader()
    assert reader.feed(frames(*SAMPLES)) == SAMPLES
    # and a trailing partial frame waits for the rest
    tail = encode_frame(GRANTED)
    assert reader.feed(frames(CLAIM) + tail[:5]) == [CLAIM]
    assert reader.pending == 5
    assert reader.feed(tail[5:]) == [GRANTED]


def test_eof_mid_frame_is_a_framing_error():
    reader = FrameReader()
    reader.feed(encode_frame(CLAIM)[:-1])
    with pytest.raises(KVCRMsgFramingError, match="mid-frame"):
        reader.eof()
    FrameReader().eof()  # nothing pending: a clean end


def test_framing_errors_are_service_errors():
    assert issubclass(KVCRMsgFramingError, KVCRServiceError)
    assert issubclass(KVCRServiceError, RuntimeError)


# --- rejection table: the text names the problem; the reader stays failed ---

CLAIM_FIELDS = msgpack.unpackb(encode(CLAIM))
del CLAIM_FIELDS["v"], CLAIM_FIELDS["t"]


def claim_with(**changes) -> bytes:
    fields = {**CLAIM_FIELDS, **changes}
    return raw_frame(body("claim", **{k: v for k, v in fields.items() if v is not ...}))


REJECTED = {
    "zero length": (b"\0\0\0\0", "zero length"),
    "oversized length": ((MAX_FRAME + 1).to_bytes(4, "big"), "oversized"),
    "huge length": (b"\xff\xff\xff\xff", "oversized"),
    "garbage body": (raw_frame(b"\xc1\xc1\xc1"), "not msgpack"),
    "trailing data in body": (raw_frame(body("status") + b"\x00"), "not msgpack"),
    "not a map": (raw_frame(msgpack.packb([1, "status"])), "not a map"),
    "no version": (raw_frame(msgpack.packb({"t": "status"})), "wrong protocol version"),
    "wrong version": (raw_frame(msgpack.packb({"v": 2, "t": "status"})), "version 2"),
    "bool version": (raw_frame(msgpack.packb({"v": True, "t": "status"})), "version True"),
    "unknown type": (raw_frame(body("steal")), "unknown type 'steal'"),
    "type not a string": (raw_frame(body(7)), "unknown type 7"),
    "missing field": (claim_with(pid=...), "missing field pid"),
    "extra field": (claim_with(evil=1), "unexpected field(s) ['evil']"),
    "extra field on empty message": (raw_frame(body("status", x=1)), "unexpected field"),
    "string for int": (claim_with(guard_index="0"), "guard_index: expected int, got str"),
    "bool for int": (claim_with(guard_index=True), "guard_index: expected int, got bool"),
    "bool for port": (claim_with(control_port=False), "control_port: expected int, got bool"),
    "float for int": (claim_with(pid=1.0), "pid: expected int, got float"),
    "int for bool": (
        raw_frame(body("release", guard_index=0, lease=1, activated=1)),
        "activated: expected bool, got int",
    ),
    "negative index": (claim_with(guard_index=-1), "guard_index must be in"),
    "port out of range": (claim_with(control_port=65536), "control_port must be in [0, 65535]"),
    "pid zero": (claim_with(pid=0), "pid must be in"),
    "lease out of range": (
        raw_frame(body("release_ack", guard_index=0, lease=-1)),
        "lease must be in",
    ),
    "empty digest": (claim_with(compatibility_digest=""), "compatibility_digest must be 1..256"),
    "long digest": (claim_with(compatibility_digest="x" * 257), "compatibility_digest must be"),
    "no pools": (claim_with(pool_layouts=[]), "pool_layouts must have 1..64 entries"),
    "layouts not a list": (claim_with(pool_layouts="kv"), "pool_layouts: expected list"),
    "layout entry too short": (claim_with(pool_layouts=[["kv"]]), "pool_layouts[0]: expected a 2"),
    "layout name not a string": (
        claim_with(pool_layouts=[["kv", 1], [5, 1]]),
        "pool_layouts[1][0]: expected str, got int",
    ),
    "layout size is a bool": (
        claim_with(pool_layouts=[["kv", True]]),
        "pool_layouts[0][1]: expected int, got bool",
    ),
    "layout name with colon": (claim_with(pool_layouts=[["a:b", 1]]), "must not contain ':'"),
    "duplicate layout names": (
        claim_with(pool_layouts=[["kv", 1], ["kv", 2]]),
        "pool names must be unique",
    ),
    "zero pool size": (claim_with(pool_layouts=[["kv", 0]]), "pool_layouts[0][1] must be in [1"),
    "g3 not a map": (claim_with(g3=5), "g3: expected map, got int"),
    "g3 paths a string": (
        claim_with(g3={**CLAIM_FIELDS["g3"], "paths": "/mnt"}),
        "g3.paths: expected list, got str",
    ),
    "g3 path not a string": (
        claim_with(g3={**CLAIM_FIELDS["g3"], "paths": ["/a", 3]}),
        "g3.paths[1]: expected str, got int",
    ),
    "g3 option not a string": (
        claim_with(g3={**CLAIM_FIELDS["g3"], "backend_options": {"a": 1}}),
        "backend_options['a']: expected str, got int",
    ),
    "g3 missing field": (
        claim_with(g3={k: v for k, v in CLAIM_FIELDS["g3"].items() if k != "backend"}),
        "missing field g3.backend",
    ),
    "unknown refusal code": (
        raw_frame(body("refused", code="nope", message="")),
        "code must be one of",
    ),
    "refusal text too long": (
        raw_frame(body("refused", code="held", message="x" * 1025)),
        "message must be 0..1024",
    ),
    "bad group state": (
        raw_frame(
            body(
                "status_reply",
                groups=[
                    {
                        "index": 0,
                        "state": "zombie",
                        "holder_pid": None,
                        "layouts": [],
                        "control_port": None,
                    }
                ],
            )
        ),
        "state must be one of",
    ),
    "group not a map": (raw_frame(body("status_reply", groups=[1])), "groups[0]: expected map"),
}


@pytest.mark.parametrize(("data", "expected"), REJECTED.values(), ids=list(REJECTED))
def test_rejection_names_the_problem_and_the_reader_stays_failed(data, expected):
    reader = FrameReader()
    assert reader.feed(encode_frame(StatusRequest())) == [StatusRequest()]
    with pytest.raises(KVCRMsgFramingError) as info:
        reader.feed(data)
    assert expected in str(info.value)
    assert reader.failed
    with pytest.raises(KVCRMsgFramingError, match="already failed"):
        reader.feed(encode_frame(StatusRequest()))


def test_oversized_length_is_rejected_before_the_body_arrives():
    reader = FrameReader()
    with pytest.raises(KVCRMsgFramingError, match="oversized"):
        reader.feed((MAX_FRAME + 1).to_bytes(4, "big"))


def test_a_full_size_frame_is_accepted_and_one_byte_more_is_not():
    reader = FrameReader()
    with pytest.raises(KVCRMsgFramingError, match="not msgpack"):
        reader.feed(raw_frame(b"\x00" * MAX_FRAME))  # length accepted, body junk
    with pytest.raises(KVCRMsgFramingError, match="already failed: guard frame: body is not"):
        reader.feed(b"")


def test_error_text_is_bounded():
    huge = "k" * 100_000
    with pytest.raises(KVCRMsgFramingError) as info:
        FrameReader().feed(claim_with(**{huge: 1}))
    assert len(str(info.value)) < 500
    with pytest.raises(KVCRMsgFramingError) as info:
        FrameReader().feed(raw_frame(body(huge)))
    assert len(str(info.value)) < 500


def test_constructing_an_invalid_message_in_code_fails_too():
    with pytest.raises(TypeError):
        Release(guard_index=0, lease=1, activated=1)
    with pytest.raises(ValueError, match="unique"):
        attrs.evolve(GRANTED, pools=[("a", 0, 1), ("a", 1, 1)])
    with pytest.raises(ValueError, match="state"):
        GroupStatus(index=0, state="x", holder_pid=None, layouts=[], control_port=None)
    assert set(GROUP_STATES) == {
        "idle",
        "held",
        "serving",
        "handing_back",
        "unusable",
        "fencing",
        "detached",
    }


def test_encode_frame_refuses_an_oversized_body():
    big = StatusReply(
        groups=[
            GroupStatus(
                index=i,
                state="held",
                holder_pid=1,
                layouts=[(f"{'p' * 250}{j}", 1) for j in range(64)],
                control_port=1,
            )
            for i in range(100)
        ]
    )
    with pytest.raises(KVCRMsgFramingError, match="at most"):
        encode_frame(big)


# --- fuzzing: nothing but KVCRMsgFramingError escapes ---


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


def _framed(bodies: list[bytes]) -> bytes:
    return b"".join(raw_frame(b) if b else b"" for b in bodies)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), U64 - 1) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
field_maps = st.builds(
    lambda kind, fields: msgpack.packb({"v": 1, "t": kind, **fields}),
    st.sampled_from(sorted(TYPES)),
    st.dictionaries(
        st.sampled_from([*sorted(CLAIM_FIELDS), "groups", "lease", "code", "message"]),
        msgpack_values,
        max_size=8,
    ),
)
streams = st.one_of(
    st.binary(max_size=200),
    st.lists(st.binary(min_size=1, max_size=60), max_size=4).map(_framed),
    st.lists(field_maps, min_size=1, max_size=3).map(_framed),
    st.builds(
        lambda good, flip: bytes(
            b ^ (0xFF if i == flip % len(good) else 0) for i, b in enumerate(good)
        ),
        st.sampled_from([encode_frame(m) for m in SAMPLES]),
        st.integers(0, 1 << 16),
    ),
)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=streams, cuts=st.lists(st.integers(0, 1 << 16), max_size=6))
def test_arbitrary_streams_raise_only_framing_errors(data, cuts):
    reader = FrameReader()
    for chunk in _chunks(data, cuts):
        try:
            for message in reader.feed(chunk):
                assert type(message) in TYPES.values()
        except KVCRMsgFramingError:
            assert reader.failed
            with pytest.raises(KVCRMsgFramingError):
                reader.feed(b"")
            return


# --- descriptor passing over a real Unix socket pair ---


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(5)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


def test_two_fds_arrive_usable_with_the_frame(pair):
    a, b = pair
    r, w = os.pipe()
    try:
        send_frame_with_fds(a, GRANTED, [r, w])
    finally:
        os.close(r)
        os.close(w)  # the sender's copies are its own business
    message, fds = recv_message_with_fds(b, FrameReader(), max_fds=4)
    try:
        assert message == GRANTED
        assert len(fds) == 2
        rr, ww = fds
        os.write(ww, b"ping")
        assert os.read(rr, 4) == b"ping"
        assert not os.get_inheritable(rr)
    finally:
        for fd in fds:
            os.close(fd)


def test_raw_receive_returns_the_bytes_so_far_and_the_fds(pair):
    a, b = pair
    r, w = os.pipe()
    send_frame_with_fds(a, Release(guard_index=1, lease=2, activated=True), [r])
    os.close(r)
    os.close(w)
    data, fds = recv_frame_with_fds(b, max_fds=2)
    try:
        assert len(fds) == 1
        assert FrameReader().feed(data) == [Release(guard_index=1, lease=2, activated=True)]
    finally:
        os.close(fds[0])


def test_a_frame_without_fds(pair):
    a, b = pair
    send_frame_with_fds(a, StatusRequest(), [])
    assert recv_message_with_fds(b, FrameReader(), max_fds=0) == (StatusRequest(), [])


def test_on_a_decode_error_the_received_fds_are_closed(pair):
    a, b = pair
    r, w = os.pipe()
    bad = raw_frame(body("granted", guard_index=True))
    socket.send_fds(a, [bad], [r, w])
    os.close(r)
    os.close(w)
    seen: list[int] = []
    original = recv_frame_with_fds

    def spy(sock, max_fds):
        data, fds = original(sock, max_fds)
        seen.extend(fds)
        return data, fds

    from kvcr.guard import fdpass

    fdpass.recv_frame_with_fds = spy
    try:
        with pytest.raises(KVCRMsgFramingError, match="guard_index"):
            fdpass.recv_message_with_fds(b, FrameReader(), max_fds=4)
    finally:
        fdpass.recv_frame_with_fds = original
    assert len(seen) == 2
    for fd in seen:
        assert not _is_open(fd)
        with pytest.raises(OSError):
            os.fstat(fd)


def test_too_many_fds_are_all_closed(pair):
    a, b = pair
    pipes = [os.pipe() for _ in range(2)]
    flat = [fd for p in pipes for fd in p]
    send_frame_with_fds(a, StatusRequest(), flat)
    for fd in flat:
        os.close(fd)
    with pytest.raises(KVCRMsgFramingError, match="more than 1 descriptors"):
        recv_frame_with_fds(b, max_fds=1)


def test_connection_closed_before_the_reply(pair):
    a, b = pair
    a.sendall(encode_frame(CLAIM)[:10])
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(KVCRMsgFramingError, match="mid-frame"):
        recv_message_with_fds(b, FrameReader(), max_fds=2)
    a2, b2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a2, b2:
        a2.close()
        with pytest.raises(KVCRSocketError, match="closed"):
            recv_message_with_fds(b2, FrameReader(), max_fds=2)


def test_data_after_the_reply_is_an_error_and_closes_the_fds(pair):
    a, b = pair
    r, w = os.pipe()
    socket.send_fds(a, [frames(StatusRequest(), StatusRequest())], [r])
    os.close(r)
    os.close(w)
    with pytest.raises(KVCRMsgFramingError, match="after the reply"):
        recv_message_with_fds(b, FrameReader(), max_fds=2)


def test_a_large_frame_sent_in_pieces_arrives_whole(pair):
    a, b = pair
    message = StatusReply(
        groups=[
            GroupStatus(index=i, state="held", holder_pid=1, layouts=[("kv", 1)], control_port=1)
            for i in range(4000)
        ]
    )
    assert len(encode_frame(message)) > 1 << 16
    r, w = os.pipe()
    sender = threading.Thread(target=send_frame_with_fds, args=(a, message, [r]))
    sender.start()
    got, fds = recv_message_with_fds(b, FrameReader(), max_fds=1)
    sender.join()
    os.close(r)
    os.close(w)
    assert got == message
    assert len(fds) == 1
    os.close(fds[0])
