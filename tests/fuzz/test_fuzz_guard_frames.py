"""Guard frames from outside the process: the frame decoder, and a live guard service.

Read top to bottom: a valid frame of every message type with one field replaced by anything,
removed or added is decoded whole or rejected with a ``KVCRMsgFramingError`` that names the
message type and the field; then a live ``kvcr-guard`` subprocess gets such frames, length
prefixes that lie (zero, oversized, longer than the body before EOF) and valid frames cut
into pieces. Each malformed connection is answered ``ClaimRefused("bad_request")`` naming
the problem, and after every case the service is up, no group changed hands, and a valid
claim is granted, maps the group and is released. (``tests/integration/test_guard_fuzz.py``
sends mixed garbage streams with descriptors; this file adds field-level and length-prefix
cases and the claim after each.)
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import msgpack
import pytest
from fuzzing import case, fuzz
from hypothesis import given
from hypothesis import strategies as st

from kvcr.errors import KVCRMsgFramingError
from kvcr.guard import protocol as wire
from procs import GuardProcess

TEXT = st.characters(blacklist_categories=("Cs",))  # msgpack cannot encode lone surrogates
G3 = wire.G3Description(["/g3/a", "/g3/b"], 1 << 20, "POSIX", {"k": "v"})
GROUP = wire.GroupStatus(0, "held", 42, [("", 4096)], 5555, 10, 3, False)
SAMPLES = [
    wire.ClaimRequest(0, [("k", 4096), ("v", 4096)], "d", "127.0.0.1", 0, G3, "UCX", 7, "h"),
    wire.ClaimGranted(1, 9, [("", 0, 4096)], 0, 4096, "/p/g1", "127.0.0.1", 5555),
    wire.ClaimRefused("held", "group 1 is held"),
    wire.Release(1, 9, True),
    wire.ReleaseAck(1, 9),
    wire.StatusRequest(),
    wire.StatusReply([GROUP]),
]
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(allow_nan=True),
    st.text(TEXT, max_size=20),
    st.sampled_from(["", ":", "x" * 5000, "held", "bad_request", "idle"]),
    st.binary(max_size=8),
    st.lists(st.integers(-1, 1 << 20), max_size=3),
    st.lists(
        st.lists(st.one_of(st.text(TEXT, max_size=2), st.integers(-1, 9)), max_size=4), max_size=3
    ),
    st.dictionaries(
        st.text(TEXT, max_size=3),
        st.one_of(st.integers(-9, 9), st.text(TEXT, max_size=3)),
        max_size=3,
    ),
)


def _fields(body: dict, prefix: tuple = ()) -> list[tuple]:
    """Paths to every field, into nested maps (g3, groups[i]) too."""
    out = []
    for k, v in body.items():
        if prefix == () and k in ("v", "t"):
            continue
        out.append((*prefix, k))
        if isinstance(v, dict) and k == "g3":
            out += _fields(v, (*prefix, k))
        if isinstance(v, list) and k == "groups":
            for i, g in enumerate(v):
                out += _fields(g, (*prefix, k, i))
    return out


@st.composite
def wrong_field_frames(draw: st.DrawFn) -> tuple[str, tuple, bytes]:
    """(message type, the path changed, a whole frame) for a valid message with one field
    replaced by anything, removed, or a field added."""
    message = draw(st.sampled_from(SAMPLES))
    body = msgpack.unpackb(wire.encode(message), raw=False)
    paths = _fields(body)
    how = draw(
        st.sampled_from(["replace", "replace", "remove", "add"]) if paths else st.just("add")
    )
    path = draw(st.sampled_from(paths)) if how != "add" else ()
    parent = body
    for step in path[:-1]:
        parent = parent[step]
    if how == "replace":
        parent[path[-1]] = draw(JUNK)
    elif how == "remove":
        del parent[path[-1]]
    else:
        name = draw(st.text(TEXT, min_size=1, max_size=6).filter(lambda n: n not in body))
        body[name] = draw(JUNK)
        path = (name,)
    raw = msgpack.packb(body, use_bin_type=True)
    return message.TYPE, path, len(raw).to_bytes(4, "big") + raw


@fuzz(1500)
@given(drawn=wrong_field_frames())
def test_a_wrong_field_is_decoded_whole_or_rejected_naming_the_type_and_field(drawn) -> None:
    case("guard frame (decoder)")
    kind, path, frame = drawn
    reader = wire.FrameReader()
    try:
        (message,) = reader.feed(frame)
    except KVCRMsgFramingError as exc:
        text = str(exc)
        assert text.startswith(f"guard frame {kind!r}: bad field: "), text
        assert str(path[0]) in text or "unexpected field" in text, (path, text)
        assert len(text) < 400 and reader.failed
    else:
        assert kind == message.TYPE
        assert wire.decode_body(wire.encode(message)) == message  # accepted means valid


# --- a live service -------------------------------------------------------------------------

TERMS = [("", 4096)]


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[GuardProcess]:
    guard = GuardProcess(tmp_path_factory.mktemp("guardfuzz"), extra=("--idle-timeout-s", "2"))
    try:
        yield guard
    finally:
        assert guard.stop() == 0, guard.log()


def _exchange(path: str, chunks: list[bytes]) -> bytes:
    """Send ``chunks`` on one connection, close our side, and read everything back."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(path)
        reply = b""
        try:
            for chunk in chunks:
                sock.sendall(chunk)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the service refused and closed first: it may
        try:
            while data := sock.recv(65536):
                reply += data
        except ConnectionResetError:
            pass
        return reply


@st.composite
def connections(draw: st.DrawFn) -> tuple[str, list[bytes]]:
    """(what kind, the chunks one connection sends)."""
    kind = draw(
        st.sampled_from(["wrong-field", "zero", "oversized", "short", "split", "split-bad"])
    )
    if kind == "wrong-field":
        return kind, [draw(wrong_field_frames())[2]]
    if kind == "zero":
        return kind, [bytes(4) + draw(st.binary(max_size=16))]
    if kind == "oversized":
        size = draw(st.integers(wire.MAX_FRAME + 1, (1 << 32) - 1))
        return kind, [size.to_bytes(4, "big") + draw(st.binary(max_size=64))]
    if kind == "short":  # the prefix promises more than comes before EOF
        body = wire.encode(draw(st.sampled_from(SAMPLES)))
        cut = draw(st.integers(0, len(body) - 1))
        extra = draw(st.integers(1, 1000))
        return kind, [(len(body) + extra).to_bytes(4, "big") + body[:cut]]
    frame = wire.encode_frame(wire.StatusRequest())
    if kind == "split-bad":
        frame = draw(wrong_field_frames())[2]
    cuts = sorted(draw(st.sets(st.integers(1, len(frame) - 1), max_size=6)))
    return kind, [frame[a:b] for a, b in zip([0, *cuts], [*cuts, len(frame)])]


@pytest.mark.integration
@fuzz(600)
@given(drawn=connections())
def test_the_service_refuses_bad_frames_and_grants_a_valid_claim_after_each(service, drawn) -> None:
    case("guard frame (live service)")
    kind, chunks = drawn
    reply_bytes = _exchange(service.socket_path, chunks)

    replies = wire.FrameReader().feed(reply_bytes)
    try:
        sent = wire.FrameReader().feed(b"".join(chunks))
    except KVCRMsgFramingError:
        sent = None
    if sent is None:  # one bad_request that says what was wrong, then the close
        (reply,) = replies
        assert reply == wire.ClaimRefused("bad_request", reply.message), (kind, reply)
        assert reply.message.startswith("guard "), (kind, reply.message)
    elif sent == [wire.StatusRequest()]:  # however it was cut up
        assert [r.TYPE for r in replies] == ["status_reply"]
    else:  # a well-formed message: one answer (a refusal, for what a client may not send)
        assert len(replies) == 1, (kind, replies)
    # The service is up, nobody holds anything, and a valid claim is granted.
    assert service.proc.poll() is None
    assert service.states() == [("idle", None), ("idle", None)]
    hold = service.client.claim(1, TERMS, service.digest, ("127.0.0.1", 0))
    try:
        assert [name for name, _, _ in hold.local_dram.pools] == [""]
    finally:
        hold.release()
