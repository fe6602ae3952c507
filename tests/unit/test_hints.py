"""Behaviour of router hints (``kvcr.hints``, contract section 6).

Read top to bottom: what a hint looks like, what is accepted, what is rejected and how the
error reads, how a decoded block hash is looked up, and how ``HintBook`` keeps per-request
hints bounded.
"""

from __future__ import annotations

import copy
import time

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcr import hints
from kvcr.hint_book import HintBook
from kvcr.hints import (
    ROUTER_HINT_CAPABILITIES,
    ROUTER_HINT_KEY,
    RouterHint,
    parse_router_hint,
)
from kvcr.logs import capture_events

MAX_HASH = 2**64 - 1
ENDPOINT = "tcp://10.0.0.7:5555"


def envelope(*, payload_extra=None, actions=None, **top):
    """A valid envelope with one kv.fetch action; keyword arguments override parts of it."""
    payload = {"source_control_endpoint": ENDPOINT, "block_hashes": [11, 22, 33]}
    payload.update(payload_extra or {})
    fetch = {
        "action_id": "a-1",
        "action_type": "kv.fetch",
        "action_version": "1.0",
        "payload": payload,
    }
    result = {
        "protocol_version": "0.1",
        "message_id": "m-1",
        "actions": [fetch] if actions is None else actions,
    }
    result.update(top)
    return result


def fetch_action(endpoint=ENDPOINT, hashes=(1,), **extra):
    return {
        "action_type": "kv.fetch",
        "action_version": "1.0",
        "payload": {"source_control_endpoint": endpoint, "block_hashes": list(hashes)},
        **extra,
    }


def hint(hashes=(1, 2, 3), endpoint=ENDPOINT) -> RouterHint:
    return RouterHint(source_control_endpoint=endpoint, ordered_hashes=hashes)


@pytest.fixture(autouse=True)
def _fresh_version_log():
    """Each test sees unknown versions as never logged before."""
    hints.forget_logged_versions()
    yield
    hints.forget_logged_versions()


# --- the public constants ---------------------------------------------------------------------


def test_router_hint_key_and_capabilities_are_the_contract_values():
    assert ROUTER_HINT_KEY == "kv_hint"
    assert isinstance(ROUTER_HINT_CAPABILITIES, frozenset)
    assert set(ROUTER_HINT_CAPABILITIES) == {"router_hint"}


# --- accepted envelopes -----------------------------------------------------------------------


def test_a_valid_envelope_parses_into_a_router_hint_with_every_field():
    parsed = parse_router_hint(envelope())

    assert parsed == RouterHint(
        source_control_endpoint=ENDPOINT,
        ordered_hashes=(11, 22, 33),
        message_id="m-1",
        action_id="a-1",
        protocol_version="0.1",
        action_version="1.0",
        mode="copy",
    )
    assert parsed.block_hashes == frozenset({11, 22, 33})


def test_ordered_hashes_keep_order_and_duplicates_and_block_hashes_is_their_set():
    parsed = parse_router_hint(envelope(payload_extra={"block_hashes": [5, 3, 5, 1]}))

    assert parsed.ordered_hashes == (5, 3, 5, 1)
    assert parsed.block_hashes == frozenset({1, 3, 5})


def test_the_first_kv_fetch_action_wins():
    first = fetch_action("tcp://first:1", [1], action_id="first")
    second = fetch_action("tcp://second:2", [2], action_id="second")

    parsed = parse_router_hint(envelope(actions=[first, second]))

    assert (parsed.source_control_endpoint, parsed.ordered_hashes) == ("tcp://first:1", (1,))
    assert parsed.action_id == "first"


def test_actions_of_other_types_are_skipped_even_when_malformed_inside():
    others = [
        {"action_type": "kv.evict", "payload": "whatever"},
        {"action_type": None},
        {"no_type_at_all": True},
    ]

    parsed = parse_router_hint(envelope(actions=[*others, fetch_action(hashes=[9])]))

    assert parsed.ordered_hashes == (9,)


def test_an_envelope_wrapped_under_kv_hint_parses_like_the_bare_one():
    kv_transfer_params = {ROUTER_HINT_KEY: envelope(), "do_remote_prefill": False}

    assert parse_router_hint(kv_transfer_params) == parse_router_hint(envelope())


def test_absent_ids_are_none():
    bare = envelope()
    del bare["message_id"]
    del bare["actions"][0]["action_id"]

    parsed = parse_router_hint(bare)

    assert (parsed.message_id, parsed.action_id) == (None, None)


@pytest.mark.parametrize("small_id", [None, True, 7, 2.5, "req-42", 2**100])
def test_small_scalar_ids_are_kept_as_given(small_id):
    parsed = parse_router_hint(envelope(message_id=small_id))

    assert parsed.message_id == small_id


@pytest.mark.parametrize("big_id", [{"a": [1, 2, 3]}, [1] * 1000, "x" * 10_000, 10**400])
def test_container_or_huge_ids_become_a_short_repr_so_hints_stay_small_and_hashable(big_id):
    parsed = parse_router_hint(envelope(message_id=big_id))

    assert isinstance(parsed.message_id, str)
    assert len(parsed.message_id) <= 80
    hash(parsed)


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://10.0.0.7:5555",
        "tcp://worker-3.pod.cluster.local:1",
        "tcp://host_a:65535",
        "tcp://[::1]:5555",
        "tcp://[fe80::1%eth0]:5555",
    ],
)
def test_accepted_endpoints(endpoint):
    parsed = parse_router_hint(envelope(payload_extra={"source_control_endpoint": endpoint}))

    assert parsed.source_control_endpoint == endpoint


def test_the_largest_64_bit_hash_and_zero_are_accepted():
    parsed = parse_router_hint(envelope(payload_extra={"block_hashes": [0, MAX_HASH]}))

    assert parsed.ordered_hashes == (0, MAX_HASH)


@pytest.mark.parametrize(
    "extra",
    [{}, {"mode": "copy"}, {"mode": None}],
    ids=["mode-absent", "mode-copy", "mode-null"],
)
def test_copy_mode_explicit_absent_or_null_is_accepted(extra):
    assert parse_router_hint(envelope(payload_extra=extra)).mode == "copy"


def test_move_mode_is_parsed():
    assert parse_router_hint(envelope(payload_extra={"mode": "move"})).mode == "move"


@pytest.mark.parametrize(
    ("given", "parsed"),
    [
        ({}, False),
        ({"no_retain": None}, False),
        ({"no_retain": False}, False),
        ({"no_retain": True}, True),
    ],
)
def test_no_retain_absent_null_or_a_bool_is_accepted(given, parsed):
    assert parse_router_hint(envelope(payload_extra=given)).no_retain is parsed


def test_parsing_does_not_modify_the_envelope():
    original = envelope()
    untouched = copy.deepcopy(original)

    parse_router_hint(original)

    assert original == untouched


def test_parsing_ten_thousand_hashes_takes_well_under_a_tenth_of_a_second():
    big = envelope(payload_extra={"block_hashes": list(range(MAX_HASH - 10_000, MAX_HASH))})

    best = min(_seconds(parse_router_hint, big) for _ in range(5))

    assert best < 0.1, f"parsing 10,000 hashes took {best * 1e3:.2f} ms"


def _seconds(fn, arg):
    start = time.perf_counter()
    fn(arg)
    return time.perf_counter() - start


# --- versions ---------------------------------------------------------------------------------


def test_expected_versions_are_not_logged():
    with capture_events() as logs:
        parse_router_hint(envelope())

    assert logs == []


def test_an_unknown_protocol_version_is_logged_once_and_parsed_anyway():
    with capture_events() as logs:
        first = parse_router_hint(envelope(protocol_version="0.2"))
        parse_router_hint(envelope(protocol_version="0.2"))

    assert first.protocol_version == "0.2"
    assert first.ordered_hashes == (11, 22, 33)
    assert [(e["event"], e["field"], e["version"], e["log_level"]) for e in logs] == [
        ("router_hint_version_unknown", "protocol_version", "0.2", "warning")
    ]


def test_an_unknown_action_version_is_logged_once_and_parsed_anyway():
    action = fetch_action(hashes=[4])
    action["action_version"] = "2.0"

    with capture_events() as logs:
        first = parse_router_hint(envelope(actions=[action]))
        parse_router_hint(envelope(actions=[action]))

    assert (first.action_version, first.ordered_hashes) == ("2.0", (4,))
    assert [(e["event"], e["field"], e["version"]) for e in logs] == [
        ("router_hint_version_unknown", "action_version", "2.0")
    ]


def test_each_distinct_unknown_version_is_logged_once():
    with capture_events() as logs:
        for version in ["0.2", "0.3", "0.2", "0.3", "0.4"]:
            parse_router_hint(envelope(protocol_version=version))

    assert [e["version"] for e in logs] == ["0.2", "0.3", "0.4"]


def test_an_absent_version_counts_as_unknown_and_is_stored_empty():
    bare = envelope()
    del bare["protocol_version"]

    with capture_events() as logs:
        parsed = parse_router_hint(bare)

    assert parsed.protocol_version == ""
    assert [(e["field"], e["version"]) for e in logs] == [("protocol_version", None)]


def test_unknown_version_logging_is_bounded_so_a_noisy_router_cannot_flood_logs():
    with capture_events() as logs:
        for n in range(200):
            parse_router_hint(envelope(protocol_version=f"9.{n}"))

    assert len(logs) == 64


# --- rejected envelopes -----------------------------------------------------------------------


def _with_action(**changes):
    action = fetch_action()
    action.update(changes)
    return envelope(actions=[action])


def _with_payload(**changes):
    return envelope(payload_extra=changes)


def _without_action_field(name):
    bare = envelope()
    del bare["actions"][0][name]
    return bare


def _without_payload_field(name):
    bare = envelope()
    del bare["actions"][0]["payload"][name]
    return bare


REJECTED = [
    # (id, envelope, field path in the message, what the message says)
    ("envelope-list", [envelope()], "envelope", "expected a mapping"),
    ("envelope-none", None, "envelope", "expected a mapping"),
    ("envelope-string", '{"actions": []}', "envelope", "expected a mapping"),
    ("wrapped-none", {ROUTER_HINT_KEY: None}, "kv_hint", "expected a mapping"),
    ("actions-missing", {"protocol_version": "0.1"}, "actions", "missing"),
    ("actions-mapping", envelope(actions={"0": fetch_action()}), "actions", "expected a list"),
    ("actions-tuple", envelope(actions=(fetch_action(),)), "actions", "expected a list"),
    ("actions-empty", envelope(actions=[]), "actions", "no 'kv.fetch' action"),
    (
        "actions-no-fetch",
        envelope(actions=[{"action_type": "kv.evict"}]),
        "actions",
        "no 'kv.fetch' action",
    ),
    (
        "action-not-mapping",
        envelope(actions=[fetch_action(), "kv.fetch"]),
        "actions[1]",
        "expected a mapping",
    ),
    (
        "action-type-not-exact",
        envelope(actions=[{**fetch_action(), "action_type": "KV.FETCH"}]),
        "actions",
        "no 'kv.fetch' action",
    ),
    ("payload-missing", _without_action_field("payload"), "actions[0].payload", "missing"),
    ("payload-list", _with_action(payload=[1, 2]), "actions[0].payload", "expected a mapping"),
    (
        "endpoint-missing",
        _without_payload_field("source_control_endpoint"),
        "actions[0].payload.source_control_endpoint",
        "missing",
    ),
    (
        "endpoint-none",
        _with_payload(source_control_endpoint=None),
        "actions[0].payload.source_control_endpoint",
        "expected a string",
    ),
    (
        "endpoint-int",
        _with_payload(source_control_endpoint=5555),
        "actions[0].payload.source_control_endpoint",
        "expected a string",
    ),
    (
        "endpoint-empty",
        _with_payload(source_control_endpoint=""),
        "actions[0].payload.source_control_endpoint",
        "empty",
    ),
    (
        "endpoint-not-tcp",
        _with_payload(source_control_endpoint="udp://h:5555"),
        "actions[0].payload.source_control_endpoint",
        "does not look like 'tcp://HOST:PORT'",
    ),
    (
        "endpoint-no-port",
        _with_payload(source_control_endpoint="tcp://h"),
        "actions[0].payload.source_control_endpoint",
        "does not look like 'tcp://HOST:PORT'",
    ),
    (
        "endpoint-no-host",
        _with_payload(source_control_endpoint="tcp://:5555"),
        "actions[0].payload.source_control_endpoint",
        "does not look like 'tcp://HOST:PORT'",
    ),
    (
        "endpoint-port-not-decimal",
        _with_payload(source_control_endpoint="tcp://h:55x5"),
        "actions[0].payload.source_control_endpoint",
        "does not look like 'tcp://HOST:PORT'",
    ),
    (
        "endpoint-space",
        _with_payload(source_control_endpoint="tcp://a b:5555"),
        "actions[0].payload.source_control_endpoint",
        "does not look like 'tcp://HOST:PORT'",
    ),
    (
        "endpoint-port-zero",
        _with_payload(source_control_endpoint="tcp://h:0"),
        "actions[0].payload.source_control_endpoint",
        "outside 1..65535",
    ),
    (
        "endpoint-port-too-big",
        _with_payload(source_control_endpoint="tcp://h:65536"),
        "actions[0].payload.source_control_endpoint",
        "outside 1..65535",
    ),
    (
        "endpoint-wildcard",
        _with_payload(source_control_endpoint="tcp://*:5555"),
        "actions[0].payload.source_control_endpoint",
        "wildcard",
    ),
    (
        "endpoint-too-long",
        _with_payload(source_control_endpoint="tcp://" + "h" * 300 + ":1"),
        "actions[0].payload.source_control_endpoint",
        "too long",
    ),
    (
        "hashes-missing",
        _without_payload_field("block_hashes"),
        "actions[0].payload.block_hashes",
        "missing",
    ),
    (
        "hashes-none",
        _with_payload(block_hashes=None),
        "actions[0].payload.block_hashes",
        "expected a non-empty list",
    ),
    (
        "hashes-tuple",
        _with_payload(block_hashes=(1, 2)),
        "actions[0].payload.block_hashes",
        "expected a non-empty list",
    ),
    (
        "hashes-int",
        _with_payload(block_hashes=7),
        "actions[0].payload.block_hashes",
        "expected a non-empty list",
    ),
    ("hashes-empty", _with_payload(block_hashes=[]), "actions[0].payload.block_hashes", "empty"),
    (
        "hash-true",
        _with_payload(block_hashes=[True]),
        "actions[0].payload.block_hashes[0]",
        "bools are not hashes",
    ),
    (
        "hash-false-later",
        _with_payload(block_hashes=[1, 2, False]),
        "actions[0].payload.block_hashes[2]",
        "bools are not hashes",
    ),
    (
        "hash-negative",
        _with_payload(block_hashes=[1, -1]),
        "actions[0].payload.block_hashes[1]",
        "got int -1",
    ),
    (
        "hash-2**64",
        _with_payload(block_hashes=[0, 1, 2, 2**64]),
        "actions[0].payload.block_hashes[3]",
        f"got int {2**64}",
    ),
    (
        "hash-float",
        _with_payload(block_hashes=[1.0]),
        "actions[0].payload.block_hashes[0]",
        "got float 1.0",
    ),
    (
        "hash-string",
        _with_payload(block_hashes=["12"]),
        "actions[0].payload.block_hashes[0]",
        "got str '12'",
    ),
    (
        "hash-none",
        _with_payload(block_hashes=[1, None]),
        "actions[0].payload.block_hashes[1]",
        "got None",
    ),
    (
        "mode-other",
        _with_payload(mode="teleport"),
        "actions[0].payload.mode",
        "'teleport'; expected 'copy' or 'move'",
    ),
    ("mode-number", _with_payload(mode=1), "actions[0].payload.mode", "expected 'copy' or 'move'"),
    (
        "no-retain-zero",
        _with_payload(no_retain=0),
        "actions[0].payload.no_retain",
        "expected true or false",
    ),
    (
        "no-retain-truthy",
        _with_payload(no_retain="yes"),
        "actions[0].payload.no_retain",
        "expected true or false",
    ),
    (
        "wrapped-hash-bad",
        {ROUTER_HINT_KEY: _with_payload(block_hashes=[-5])},
        "kv_hint.actions[0].payload.block_hashes[0]",
        "got int -5",
    ),
    (
        "path-names-the-chosen-action",
        envelope(actions=[{"action_type": "other"}, fetch_action(hashes=[1, 2**70])]),
        "actions[1].payload.block_hashes[1]",
        "expected an int in [0, 2**64)",
    ),
]


@pytest.mark.parametrize(
    ("bad", "path", "what"), [r[1:] for r in REJECTED], ids=[r[0] for r in REJECTED]
)
def test_rejected_envelopes_raise_a_value_error_naming_the_field_and_the_problem(bad, path, what):
    with pytest.raises(ValueError) as caught:
        parse_router_hint(bad)

    message = str(caught.value)
    assert message.startswith(f"submit_hint: {path}: "), message
    assert what in message, message


@pytest.mark.parametrize(
    "bad",
    [
        [list(range(10_000))],
        _with_payload(source_control_endpoint="x" * 1_000_000),
        _with_payload(block_hashes=[10**5000]),
        _with_payload(mode="m" * 100_000),
        _with_action(payload="p" * 100_000),
    ],
    ids=["huge-list", "huge-endpoint", "huge-int", "huge-mode", "huge-payload"],
)
def test_error_messages_shorten_huge_values(bad):
    with pytest.raises(ValueError) as caught:
        parse_router_hint(bad)

    assert len(str(caught.value)) < 250, str(caught.value)


# --- RouterHint as a value --------------------------------------------------------------------


def test_router_hint_is_frozen_and_compares_and_hashes_by_value():
    a, b = hint((1, 2)), hint([1, 2])

    assert a == b
    assert hash(a) == hash(b)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        a.mode = "move"


def test_router_hint_derives_its_block_hash_set_and_keeps_its_repr_short():
    many = hint(range(10_000))

    assert many.block_hashes == frozenset(range(10_000))
    assert "<10000 hashes>" in repr(many)
    assert len(repr(many)) < 300


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"ordered_hashes": ()}, "ordered_hashes: empty"),
        ({"ordered_hashes": (1, True)}, "ordered_hashes[1]"),
        ({"ordered_hashes": (2**64,)}, "ordered_hashes[0]"),
        ({"source_control_endpoint": "tcp://h:0"}, "source_control_endpoint"),
        ({"mode": "teleport"}, "mode"),
    ],
)
def test_constructing_a_router_hint_directly_checks_the_same_rules(kwargs, what):
    fields = {"source_control_endpoint": ENDPOINT, "ordered_hashes": (1,), **kwargs}

    with pytest.raises(ValueError) as caught:
        RouterHint(**fields)

    assert str(caught.value).startswith(f"RouterHint: {what}"), str(caught.value)


# --- covers: looking up a decoded block hash ---------------------------------------------------


def test_covers_an_int_hash_among_the_hints_hashes():
    h = hint((1, MAX_HASH))

    assert h.covers(1)
    assert h.covers(MAX_HASH)
    assert not h.covers(2)


@pytest.mark.parametrize(
    "encoded",
    [
        (1).to_bytes(8, "big"),
        b"\x01",
        bytearray(b"\x00\x00\x01"),
    ],
)
def test_covers_reads_bytes_as_a_big_endian_unsigned_hash(encoded):
    assert hint((1,)).covers(encoded)
    assert not hint((2,)).covers(encoded)


def test_covers_reads_eight_bytes_of_ff_as_the_largest_hash():
    assert hint((MAX_HASH,)).covers(b"\xff" * 8)


@pytest.mark.parametrize(
    ("block_hash", "error", "what"),
    [
        (-1, ValueError, r"outside \[0, 2\*\*64\)"),
        (2**64, ValueError, r"outside \[0, 2\*\*64\)"),
        (b"", ValueError, "has 0 bytes"),
        (b"\x00" * 9, ValueError, "has 9 bytes"),
        (True, TypeError, "neither int nor bytes"),
        ("1", TypeError, "neither int nor bytes"),
        (None, TypeError, "neither int nor bytes"),
    ],
)
def test_covers_refuses_what_cannot_be_a_router_hash(block_hash, error, what):
    with pytest.raises(error, match=rf"^covers: .*{what}"):
        hint((1,)).covers(block_hash)


# --- HintBook ---------------------------------------------------------------------------------


def test_a_book_returns_the_hint_submitted_for_a_request():
    book, h = HintBook(), hint()

    book.submit("r1", h)

    assert book.get("r1") is h
    assert "r1" in book
    assert len(book) == 1
    assert not book.failed("r1")


def test_a_book_knows_nothing_of_other_requests():
    book = HintBook()
    book.submit("r1", hint((1,)))

    assert book.get("r2") is None
    assert not book.covers("r2", 1)
    assert not book.failed("r2")


def test_a_book_covers_a_hash_only_through_the_requests_own_hint():
    book = HintBook()
    book.submit("r1", hint((1,)))
    book.submit("r2", hint((2,)))

    assert book.covers("r1", 1)
    assert not book.covers("r1", 2)
    assert book.covers("r2", b"\x02")


def test_resubmitting_for_a_request_replaces_its_hint():
    book, old, new = HintBook(), hint((1,)), hint((2,))
    book.submit("r1", old)

    book.submit("r1", new)

    assert book.get("r1") is new
    assert len(book) == 1


def test_none_is_a_request_id_whose_hint_each_new_none_submission_replaces():
    book, first, second = HintBook(), hint((1,)), hint((2,))

    book.submit(None, first)
    book.submit(None, second)

    assert book.get(None) is second
    assert book.covers(None, 2)
    assert not book.covers(None, 1)


def test_discard_forgets_the_request_and_reports_whether_it_was_known():
    book = HintBook()
    book.submit("r1", hint())

    assert book.discard("r1") is True
    assert book.get("r1") is None
    assert book.discard("r1") is False


def test_a_failed_hint_covers_nothing_but_is_still_there_for_diagnostics():
    book, h = HintBook(), hint((1,))
    book.submit("r1", h)

    assert book.mark_failed("r1") is True

    assert book.failed("r1")
    assert not book.covers("r1", 1)
    assert book.get("r1") is h


def test_resubmitting_clears_the_failed_mark():
    book = HintBook()
    book.submit("r1", hint((1,)))
    book.mark_failed("r1")

    book.submit("r1", hint((1,)))

    assert not book.failed("r1")
    assert book.covers("r1", 1)


def test_discarding_a_failed_request_clears_the_failed_mark():
    book = HintBook()
    book.submit("r1", hint())
    book.mark_failed("r1")

    book.discard("r1")

    assert not book.failed("r1")


def test_marking_an_unknown_request_failed_does_nothing():
    book = HintBook()

    assert book.mark_failed("late") is False
    assert "late" not in book
    assert not book.failed("late")


def test_a_full_book_evicts_the_oldest_requests_first_and_says_which():
    book = HintBook(max_requests=3)
    for request_id in ["r1", "r2", "r3"]:
        assert book.submit(request_id, hint()) == ()

    assert book.submit("r4", hint()) == ("r1",)
    assert book.submit("r5", hint()) == ("r2",)
    assert len(book) == 3
    assert [r for r in ["r1", "r2", "r3", "r4", "r5"] if r in book] == ["r3", "r4", "r5"]


def test_resubmitting_makes_a_request_the_newest_so_it_is_evicted_last():
    book = HintBook(max_requests=2)
    book.submit("r1", hint())
    book.submit("r2", hint())

    assert book.submit("r1", hint()) == ()
    assert book.submit("r3", hint()) == ("r2",)
    assert "r1" in book


def test_marking_failed_does_not_change_the_eviction_order():
    book = HintBook(max_requests=2)
    book.submit("r1", hint())
    book.submit("r2", hint())
    book.mark_failed("r1")

    assert book.submit("r3", hint()) == ("r1",)


def test_a_book_holds_65536_requests_by_default():
    assert HintBook().max_requests == 65536


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "8"])
def test_a_book_needs_a_positive_int_capacity(bad):
    with pytest.raises(ValueError, match=r"^HintBook: max_requests must be a positive int"):
        HintBook(max_requests=bad)


def test_a_book_only_stores_router_hints():
    with pytest.raises(TypeError, match=r"^HintBook\.submit: expected a RouterHint"):
        HintBook().submit("r1", envelope())


# --- properties over arbitrary input ----------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=12)
)
json_like = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)


hash_values = st.integers(min_value=0, max_value=MAX_HASH) | json_scalars
near_valid_payloads = st.fixed_dictionaries(
    {},
    optional={
        "source_control_endpoint": st.sampled_from(
            [ENDPOINT, "tcp://[::1]:1", "tcp://h:0", "tcp://*:9", "", "tcp://h:99999"]
        )
        | json_like,
        "block_hashes": st.lists(hash_values, max_size=6) | json_like,
        "mode": st.sampled_from(["copy", "move", None]) | json_like,
        "no_retain": st.sampled_from([False, True, None]) | json_like,
    },
)
near_valid_actions = st.fixed_dictionaries(
    {},
    optional={
        "action_type": st.sampled_from(["kv.fetch", "kv.evict"]) | json_like,
        "action_version": st.sampled_from(["1.0", "2.0"]) | json_like,
        "action_id": json_like,
        "payload": near_valid_payloads | json_like,
    },
)
near_valid_envelopes = st.fixed_dictionaries(
    {},
    optional={
        "protocol_version": st.sampled_from(["0.1", "0.2"]) | json_like,
        "message_id": json_like,
        "actions": st.lists(near_valid_actions | json_like, max_size=3) | json_like,
    },
)
anything = (
    json_like
    | near_valid_envelopes
    | near_valid_envelopes.map(lambda e: {ROUTER_HINT_KEY: e})
    | st.builds(envelope, payload_extra=near_valid_payloads)
)


@settings(max_examples=500)
@given(anything)
def test_any_json_like_input_either_parses_into_a_sound_hint_or_raises_value_error(candidate):
    with capture_events():
        try:
            parsed = parse_router_hint(candidate)
        except ValueError as error:
            assert str(error).startswith("submit_hint: ")
            assert len(str(error)) < 400
            return

    assert isinstance(parsed.source_control_endpoint, str)
    assert parsed.source_control_endpoint.startswith("tcp://")
    assert parsed.ordered_hashes
    assert all(type(h) is int and 0 <= h <= MAX_HASH for h in parsed.ordered_hashes)
    assert parsed.block_hashes == frozenset(parsed.ordered_hashes)
    assert parsed.mode in ("copy", "move") and type(parsed.no_retain) is bool
    assert all(parsed.covers(h) for h in parsed.ordered_hashes)
    hash(parsed)


@given(st.lists(st.integers(min_value=0, max_value=MAX_HASH), min_size=1, max_size=50))
def test_every_valid_hash_list_round_trips_in_order(hashes):
    parsed = parse_router_hint(envelope(payload_extra={"block_hashes": hashes}))

    assert parsed.ordered_hashes == tuple(hashes)
    assert all(parsed.covers(h.to_bytes(8, "big")) for h in hashes)


def test_a_book_keeps_when_each_hint_came_through_failure_and_resubmission():
    book = HintBook()
    book.submit("r1", hint((1,)), at=10.5)
    assert book.submitted_at("r1") == 10.5 and book.submitted_at("r2") is None
    book.mark_failed("r1")
    assert book.submitted_at("r1") == 10.5  # failed, still the same hint
    book.submit("r1", hint((2,)), at=11.0)
    assert book.submitted_at("r1") == 11.0 and not book.failed("r1")
    book.discard("r1")
    assert book.submitted_at("r1") is None
