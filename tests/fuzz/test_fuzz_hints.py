"""Router hints from outside the process: the envelope parser and a live KVCR.

Read top to bottom: a valid envelope with any one part replaced, removed or added (values of
any type, non-string keys, tuples for lists, wrapped or bare) parses to exactly the hint it
names or raises a ValueError that starts with ``submit_hint:`` and names the field path;
then the same inputs go to a live KVCR (real NIXL, a real ZMQ control channel) through
``submit_hint``, and afterwards the request's earlier valid hint still covers its blocks and
deposited blocks still hit.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from types import MappingProxyType

import pytest
from fuzzing import case, fuzz
from hypothesis import given
from hypothesis import strategies as st

from engine_sim import EngineSim, router_hint
from kvcr import KVCR
from kvcr.config import KVCRBackendConfigs, RemoteFWDramOptions
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.hints import HASH_LIMIT, ROUTER_HINT_KEY, parse_router_hint
from kvcr.types import BlockKey, CacheTier, QueryStatus
from procs import free_port

ENDPOINT = "tcp://10.0.0.7:5555"
# "submit_hint: <field path>: <what is wrong>", the path rooted at the envelope
FIELD_PATH = re.compile(r"submit_hint: (envelope|kv_hint|(kv_hint\.)?actions[\w\[\]\.]*): \S")
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**65), 2**65),
    st.sampled_from([10**5000, -1, HASH_LIMIT, HASH_LIMIT - 1, 0]),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.sampled_from(["kv.fetch", "copy", "move", "tcp://h:1", "tcp://*:1", "tcp://h:0", "x" * 300]),
    st.binary(max_size=8),
    st.lists(st.integers(0, 2**64), max_size=3),
    st.lists(st.integers(0, 9), max_size=3).map(tuple),
    st.dictionaries(st.one_of(st.text(max_size=3), st.integers(0, 3)), st.integers(), max_size=2),
    st.builds(object),
)


def paths(node: object, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path into the envelope: dict keys and list indices."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths(v, (*prefix, i))


@st.composite
def envelopes(draw: st.DrawFn) -> object:
    hashes = draw(st.lists(st.integers(0, HASH_LIMIT - 1), min_size=1, max_size=6))
    env = router_hint(ENDPOINT, hashes)
    if draw(st.booleans()):  # a second action, before or after the fetch
        other = {"action_type": draw(st.sampled_from(["kv.evict", "kv.fetch"])), "payload": {}}
        env["actions"].insert(draw(st.integers(0, 1)), other)
    for _ in range(draw(st.integers(0, 3))):
        path = draw(st.sampled_from(list(paths(env))))
        how = draw(st.sampled_from(["replace", "replace", "remove", "add", "tuple", "proxy"]))
        if not path:
            env = draw(JUNK) if how == "replace" else env
            continue
        parent = env
        for step in path[:-1]:
            parent = parent[step]
        last = path[-1]
        if how == "replace":
            parent[last] = draw(JUNK)
        elif how == "remove":
            del parent[last]
        elif how == "add" and isinstance(parent, dict):
            parent[draw(st.one_of(st.text(max_size=6), st.integers(0, 3)))] = draw(JUNK)
        elif how == "tuple" and isinstance(parent[last], list):
            parent[last] = tuple(parent[last])
        elif how == "proxy" and isinstance(parent[last], dict):
            parent[last] = MappingProxyType(parent[last])  # a Mapping that is not a dict
    if draw(st.booleans()):
        env = {ROUTER_HINT_KEY: env, "other": 1}
    return env


def named(envelope: object) -> tuple[str, list[int]] | None:
    """What a valid envelope names, by the contract's rules (None: it must be rejected)."""
    if isinstance(envelope, dict) and ROUTER_HINT_KEY in envelope:
        envelope = envelope[ROUTER_HINT_KEY]
    try:
        actions = envelope["actions"]
        assert type(actions) is list
        fetch = next(a for a in actions if a.get("action_type") == "kv.fetch")
        payload = fetch["payload"]
        return payload["source_control_endpoint"], payload["block_hashes"]
    except Exception:
        return None


@fuzz(1500)
@given(envelope=envelopes())
def test_an_envelope_parses_to_the_hint_it_names_or_an_error_naming_the_field(envelope) -> None:
    case("router hint (parser)")
    before = _shape(envelope)
    try:
        hint = parse_router_hint(envelope)
    except ValueError as exc:
        text = str(exc)
        assert FIELD_PATH.match(text), text
        assert len(text) < 400, text
    else:
        assert named(envelope) == (hint.source_control_endpoint, list(hint.ordered_hashes))
    assert _shape(envelope) == before  # the caller's envelope is only read


def _shape(node: object) -> object:
    """The envelope's structure with every leaf by identity (what reading must not change)."""
    if isinstance(node, (dict, MappingProxyType)):
        return ("map", id(node), [(k, _shape(v)) for k, v in node.items()])
    if isinstance(node, (list, tuple)):
        return (type(node).__name__, id(node), [_shape(v) for v in node])
    return ("leaf", id(node))


# --- a live instance ------------------------------------------------------------------------


class IntKeys:
    def encode(self, framework_key: int) -> BlockKey:
        return BlockKey(framework_key.to_bytes(8, "big"))

    def decode(self, key: BlockKey) -> int:
        return int.from_bytes(key, "big")


GOOD = [100, 101, 102]  # hashes of the request's valid hint
LOCAL = [0, 1]  # deposited: local G2 hits
HIT = (QueryStatus.HIT, CacheTier.LOCAL_G2)
REMOTE = (QueryStatus.FETCHABLE, CacheTier.REMOTE_G2)
MISS = (QueryStatus.MISS, None)


@pytest.fixture(scope="module")
def live() -> Iterator[KVCR]:
    engine = EngineSim(name="hint-fuzz")
    channel = ZmqPeerControlChannel("127.0.0.1", free_port(), "127.0.0.1")
    bindings = engine_bindings(channel)
    backends = KVCRBackendConfigs(
        framework_regions=engine.backend_configs.framework_regions,
        local_dram=engine.backend_configs.local_dram,
        remote_fw_dram=RemoteFWDramOptions(eager_ctrl_connect=False),
    )
    kv = KVCR(engine.config, bindings, backends)
    try:
        keys = IntKeys()
        handle = kv.deposit({keys.encode(i): engine.refs(i) for i in LOCAL})
        assert engine.statuses(engine.wait(kv, handle, len(LOCAL))) == dict.fromkeys(
            [keys.encode(i) for i in LOCAL], "SUCCESS"
        )
        kv.submit_hint(router_hint(ENDPOINT, GOOD), request_id="good")
        yield kv
    finally:
        kv.close()
        channel.close()


def engine_bindings(channel):
    from kvcr import KVCRBindings

    return KVCRBindings(
        request_pin=lambda keys: 0,
        poll_pin_results=lambda: [],
        release_pin=lambda handle: True,
        framework_control=channel,
        key_adapter=IntKeys(),
    )


@pytest.mark.integration
@fuzz(1000)
@given(envelope=envelopes())
def test_a_bad_hint_is_a_value_error_and_leaves_the_instance_and_earlier_hints_intact(
    live, envelope
) -> None:
    case("router hint (live KVCR)")
    keys = IntKeys()
    try:
        live.submit_hint(envelope, request_id="good")
    except ValueError as exc:
        assert str(exc).startswith("submit_hint: ")
    else:  # a valid hint replaced the request's hint: put the original back
        live.submit_hint(router_hint(ENDPOINT, GOOD), request_id="good")
    asked = [keys.encode(i) for i in [*LOCAL, *GOOD, 999]]
    assert live.query(asked, request_id="good") == [HIT, HIT, REMOTE, REMOTE, REMOTE, MISS]
    assert live.query(asked) == [HIT, HIT, MISS, MISS, MISS, MISS]
