"""Router hints: the envelope a KV-aware router attaches to a request (contract section 6).

Theory of operation
-------------------
A router that knows which peer worker already holds a request's prefix sends, with the
request, a versioned envelope naming that peer's control endpoint and the router's block
hashes (unsigned 64-bit ints) of the blocks worth pulling from it::

    {"protocol_version": "0.1", "message_id": <any>,
     "actions": [{"action_id": <any>, "action_type": "kv.fetch", "action_version": "1.0",
                  "payload": {"source_control_endpoint": "tcp://HOST:PORT",
                              "block_hashes": [<int in [0, 2**64)>, ...]}}]}

Engines pass it along with the request (vLLM 0.33: the request's ``kv_hints``; others in
``kv_transfer_params``), so the same envelope is also accepted wrapped as
``{ROUTER_HINT_KEY: envelope}`` (other keys of the wrapper are ignored;
error paths then start with ``kv_hint.``). ``parse_router_hint`` turns either shape into a
frozen ``RouterHint`` or raises ``ValueError``; ``HintBook`` (``hint_book.py``) remembers
the parsed hint of each request, bounded, and answers "does this request's hint cover this
block hash?". Everything
here is plain code over plain values: no I/O, no threads of its own, no trio.

Rules (contract section 6, plus the decisions marked *)
-------------------------------------------------------
- The first ``kv.fetch`` action counts; actions of other types (or with no readable type)
  are skipped. *Every entry of ``actions`` must be a mapping, wherever it sits.
- A ``protocol_version`` other than ``"0.1"`` or an ``action_version`` (of the chosen action)
  other than ``"1.0"`` is logged once per distinct value per process (structlog event
  ``router_hint_version_unknown`` on logger ``kvcr.hints``) and parsed anyway. *An absent or
  null version counts as unknown and is stored as ``""``. *At most 64 distinct unknown
  values are remembered; later ones are parsed silently, so a misbehaving router cannot grow
  memory or flood logs (``forget_logged_versions`` re-arms the warning).
- ``source_control_endpoint`` is a non-empty string of the form ``tcp://HOST:PORT``:
  *HOST is a name or IPv4 address (``[A-Za-z0-9._-]+``) or a bracketed IPv6 address, not the
  bind wildcard ``*``; PORT is decimal in 1..65535; at most 256 characters in all.
- ``block_hashes`` is a non-empty *``list`` (what JSON and msgpack decode to; tuples are
  rejected) of ``int`` in ``[0, 2**64)``. Bools are not ints here. *Int subclasses are
  rejected too. Duplicates are allowed and kept in ``ordered_hashes``.
- ``payload.mode`` absent (*or null) means ``"copy"``; ``"move"`` lets the source drop its
  copy once this destination confirmed the keys (after the engine polled their success);
  anything else is rejected. ``payload.no_retain`` absent or null means false; *it must be
  a bool: true makes a ``fetch`` drop the fetched blocks from local G2 when the engine
  releases them (a ``deliver`` from a peer writes straight into engine memory and never
  keeps a local copy).
- *``message_id`` and ``action_id`` are kept for logs: None, bools, floats, ints of at most
  128 bits and strings of at most 256 characters as given; anything else as a short repr
  string (so a hint stays small, hashable and safe to log).
- Every rejection is a ``ValueError`` whose message starts with ``submit_hint:``, names the
  field path (``actions[0].payload.block_hashes[3]``) and says what is wrong; values in
  messages are shortened to about 80 characters.

Block hash lookup (``RouterHint.covers``)
-----------------------------------------
``KeyAdapter.decode(key)`` returns the router's block hash as ``int | bytes``. *An int must
be in ``[0, 2**64)``; bytes (or bytearray) of 1 to 8 bytes are read as a big-endian unsigned
integer (leading zero bytes do not matter). Anything else cannot be a router hash and means
the adapter is broken, so it raises (ValueError for a bad value, TypeError for a bad type,
including bool) rather than silently answering "not covered" forever.
"""

from __future__ import annotations

import re
import reprlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any, cast

import attrs

from kvcr.logs import get_logger

__all__ = [
    "DEFAULT_MAX_REQUESTS",
    "FETCH_ACTION_TYPE",
    "FETCH_ACTION_VERSION",
    "HASH_LIMIT",
    "PROTOCOL_VERSION",
    "ROUTER_HINT_CAPABILITIES",
    "ROUTER_HINT_KEY",
    "RouterHint",
    "forget_logged_versions",
    "parse_router_hint",
]

ROUTER_HINT_KEY = "kv_hint"
ROUTER_HINT_CAPABILITIES = frozenset({"router_hint"})

PROTOCOL_VERSION = "0.1"
FETCH_ACTION_TYPE = "kv.fetch"
FETCH_ACTION_VERSION = "1.0"
SUPPORTED_MODES = frozenset({"copy", "move"})
HASH_LIMIT = 2**64
MAX_ENDPOINT_LENGTH = 256
DEFAULT_MAX_REQUESTS = 65536

_SHORT = 80  # longest value text put into an error message or log field
_VERSION_LOG_LIMIT = 64
_MAX_ID_TEXT = 256
_MAX_ID_BITS = 128
_MISSING: Any = object()
_ENDPOINT = re.compile(
    r"tcp://(?P<host>\[[0-9A-Za-z:.%_-]+\]|[A-Za-z0-9._-]+|\*):(?P<port>[0-9]+)", re.ASCII
)

_log = get_logger("kvcr.hints")


# --- bounded descriptions of outside values ---------------------------------------------------


class _ShortRepr(reprlib.Repr):
    """reprlib with small limits that never builds the full repr of a big container, and never
    calls ``repr`` on a huge int (Python refuses ints over 4300 digits)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = 6
        self.maxdeque = self.maxarray = 6
        self.maxdict = 4
        self.maxstring = self.maxother = _SHORT
        self.maxlong = 40

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > _MAX_ID_BITS:
            return f"<int of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_short_repr = _ShortRepr()


def _text(value: object) -> str:
    """A repr of ``value`` of at most ``_SHORT`` characters."""
    text = _short_repr.repr(value)
    return text if len(text) <= _SHORT else text[: _SHORT - 3] + "..."


def describe_value(value: object) -> str:
    """``<type> <short repr>``, e.g. ``bool True`` or ``list [1, 2, ...]``."""
    if value is None:
        return "None"
    return f"{type(value).__name__} {_text(value)}"


def _loggable_id(value: object) -> object:
    """A message or action id as given when it is a small scalar, else a short repr string."""
    if value is None or type(value) in (bool, float):
        return value
    if type(value) is int and value.bit_length() <= _MAX_ID_BITS:
        return value
    if type(value) is str and len(value) <= _MAX_ID_TEXT:
        return value
    return _text(value)


def _version_text(value: object) -> str:
    """A version as stored on a hint: the string as given (shortened), ``""`` when absent."""
    if value is None or value is _MISSING:
        return ""
    if type(value) is str:
        return value if len(value) <= _SHORT else value[: _SHORT - 3] + "..."
    return _text(value)


# --- "logged once" for unknown versions -----------------------------------------------------

_logged_versions: set[tuple[str, str]] = set()
_logged_versions_lock = threading.Lock()


def forget_logged_versions() -> None:
    """Forget which unknown versions were logged, so each is logged once more (tests use it;
    an operator may too, after fixing a router)."""
    with _logged_versions_lock:
        _logged_versions.clear()


def _note_version(field: str, value: object, expected: str) -> str:
    """The stored text of a version; logs ``router_hint_version_unknown`` the first time a
    given unexpected value of ``field`` is seen in this process."""
    if type(value) is str and value == expected:
        return value
    text = _version_text(value)
    key = (field, text)
    with _logged_versions_lock:
        if key in _logged_versions or len(_logged_versions) >= _VERSION_LOG_LIMIT:
            return text
        _logged_versions.add(key)
    _log.warning(
        "router_hint_version_unknown",
        field=field,
        version=text if value is not None and value is not _MISSING else None,
        expected=expected,
    )
    return text


# --- field rules, shared by the parser and by RouterHint's own validators --------------------


def _endpoint_problem(value: str) -> str | None:
    """What is wrong with a (string) control endpoint, or None if it is fine."""
    if not value:
        return "empty; expected 'tcp://HOST:PORT'"
    if len(value) > MAX_ENDPOINT_LENGTH:
        return f"too long ({len(value)} characters, at most {MAX_ENDPOINT_LENGTH}): {_text(value)}"
    match = _ENDPOINT.fullmatch(value)
    if match is None:
        return f"{_text(value)} does not look like 'tcp://HOST:PORT'"
    if match["host"] == "*":
        return f"{_text(value)} names the bind wildcard '*', which cannot be connected to"
    port = int(match["port"])
    if not 1 <= port <= 65535:
        return f"{_text(value)} has port {match['port'][:10]}, outside 1..65535"
    return None


def _first_bad_hash(hashes: Sequence[object]) -> int | None:
    """Index of the first element that is not an int in [0, 2**64), or None if all are fine.

    The all-good case runs at C speed (type set, min, max): about 0.1 ms for 10,000 hashes.
    """
    if hashes and set(map(type, hashes)) == {int}:
        ints = cast("Sequence[int]", hashes)  # every element's type is int
        if min(ints) >= 0 and max(ints) < HASH_LIMIT:
            return None
    for index, value in enumerate(hashes):
        if type(value) is not int or not 0 <= value < HASH_LIMIT:
            return index
    return None


def _bad_hash_problem(value: object) -> str:
    if type(value) is bool:
        return f"expected an int in [0, 2**64), got bool {value!r} (bools are not hashes)"
    return f"expected an int in [0, 2**64), got {describe_value(value)}"


def _validate_endpoint(_hint: object, _attribute: object, value: Any) -> None:
    # ``value`` is whatever the caller passed (Any, so the field keeps its declared type).
    if not isinstance(value, str):
        raise TypeError(
            f"RouterHint: source_control_endpoint must be a str, got {describe_value(value)}"
        )
    problem = _endpoint_problem(value)
    if problem is not None:
        raise ValueError(f"RouterHint: source_control_endpoint: {problem}")


def _validate_hashes(_hint: object, _attribute: object, value: tuple[object, ...]) -> None:
    if not value:
        raise ValueError("RouterHint: ordered_hashes: empty; a hint names at least one block")
    bad = _first_bad_hash(value)
    if bad is not None:
        raise ValueError(f"RouterHint: ordered_hashes[{bad}]: {_bad_hash_problem(value[bad])}")


def _validate_mode(_hint: object, _attribute: object, value: object) -> None:
    if value not in SUPPORTED_MODES:
        raise ValueError(f"RouterHint: mode: {describe_value(value)}; expected 'copy' or 'move'")


# --- the value ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class RouterHint:
    """A parsed ``kv.fetch`` router hint: pull these blocks from the peer at this endpoint.

    ``ordered_hashes`` are the router's block hashes as given (order and duplicates kept);
    ``block_hashes`` is the same set for O(1) membership, derived, not passed in. Hints compare
    by value. Build them with ``parse_router_hint``; direct construction validates the same
    rules (errors start with ``RouterHint:``).
    """

    source_control_endpoint: str = attrs.field(validator=_validate_endpoint)
    ordered_hashes: tuple[int, ...] = attrs.field(
        converter=tuple, validator=_validate_hashes, repr=lambda h: f"<{len(h)} hashes>"
    )
    block_hashes: frozenset[int] = attrs.field(init=False, eq=False, repr=False)
    message_id: object = attrs.field(default=None, converter=_loggable_id)
    action_id: object = attrs.field(default=None, converter=_loggable_id)
    protocol_version: str = attrs.field(
        default=PROTOCOL_VERSION, validator=attrs.validators.instance_of(str)
    )
    action_version: str = attrs.field(
        default=FETCH_ACTION_VERSION, validator=attrs.validators.instance_of(str)
    )
    mode: str = attrs.field(default="copy", validator=_validate_mode)
    no_retain: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:  # after the validators: the hashes are ints
        object.__setattr__(self, "block_hashes", frozenset(self.ordered_hashes))

    def covers(self, block_hash: int | bytes) -> bool:
        """Whether ``block_hash`` (what ``KeyAdapter.decode`` returns) is among the hint's
        hashes. Ints must be in [0, 2**64); bytes of 1..8 bytes are big-endian unsigned.
        Anything else raises: it cannot be a router block hash."""
        if type(block_hash) is int and 0 <= block_hash < HASH_LIMIT:
            return block_hash in self.block_hashes
        return _as_router_hash(block_hash) in self.block_hashes


def _as_router_hash(block_hash: object) -> int:
    """The router hash that a decoded key stands for (slow path of ``covers``)."""
    if isinstance(block_hash, (bytes, bytearray)):
        if 1 <= len(block_hash) <= 8:
            return int.from_bytes(block_hash, "big")
        raise ValueError(
            f"covers: block hash {describe_value(block_hash)} has {len(block_hash)} bytes; "
            "KeyAdapter.decode must return 1 to 8 bytes (big-endian unsigned 64-bit hash)"
        )
    if isinstance(block_hash, int) and not isinstance(block_hash, bool):
        if 0 <= block_hash < HASH_LIMIT:
            return int(block_hash)
        raise ValueError(
            f"covers: block hash {describe_value(block_hash)} is outside [0, 2**64); "
            "KeyAdapter.decode must return an unsigned 64-bit router block hash"
        )
    raise TypeError(
        f"covers: block hash {describe_value(block_hash)} is neither int nor bytes; "
        "KeyAdapter.decode must return the router's block hash as int or bytes"
    )


# --- the parser -----------------------------------------------------------------------------


def fetch_hint(endpoint: str, block_hashes: Sequence[int], message_id: object = 1) -> dict:
    """The envelope a router sends to say "these blocks are at ``endpoint``": for tools,
    tests and examples that stand in for the router."""
    return {
        "protocol_version": PROTOCOL_VERSION,
        "message_id": message_id,
        "actions": [
            {
                "action_id": 1,
                "action_type": FETCH_ACTION_TYPE,
                "action_version": FETCH_ACTION_VERSION,
                "payload": {
                    "source_control_endpoint": endpoint,
                    "block_hashes": list(block_hashes),
                },
            }
        ],
    }


def _reject(path: str, what: str) -> ValueError:
    return ValueError(f"submit_hint: {path}: {what}")


def parse_router_hint(envelope: object) -> RouterHint:
    """Parse a router hint envelope, bare or wrapped as ``{ROUTER_HINT_KEY: envelope}``.

    Raises ValueError (message ``submit_hint: <field path>: <what is wrong>``) for anything the
    module docstring's rules reject; never anything else for JSON-like input.
    """
    root, prefix = "envelope", ""
    if isinstance(envelope, Mapping) and ROUTER_HINT_KEY in envelope:
        envelope = envelope[ROUTER_HINT_KEY]
        root, prefix = ROUTER_HINT_KEY, ROUTER_HINT_KEY + "."
    if not isinstance(envelope, Mapping):
        raise _reject(
            root, f"expected a mapping (the router hint envelope), got {describe_value(envelope)}"
        )
    protocol_version = _note_version(
        "protocol_version", envelope.get("protocol_version"), PROTOCOL_VERSION
    )

    path = prefix + "actions"
    actions = envelope.get("actions", _MISSING)
    if actions is _MISSING:
        raise _reject(path, "missing; expected a list of actions")
    if type(actions) is not list:
        raise _reject(path, f"expected a list of actions, got {describe_value(actions)}")
    chosen = None
    for index, action in enumerate(actions):
        if not isinstance(action, Mapping):
            raise _reject(
                f"{path}[{index}]", f"expected a mapping (an action), got {describe_value(action)}"
            )
        if chosen is None:
            action_type = action.get("action_type")
            if type(action_type) is str and action_type == FETCH_ACTION_TYPE:
                chosen = index
    if chosen is None:
        raise _reject(path, f"no {FETCH_ACTION_TYPE!r} action among {len(actions)} action(s)")
    action, path = actions[chosen], f"{path}[{chosen}]"
    action_version = _note_version(
        "action_version", action.get("action_version"), FETCH_ACTION_VERSION
    )

    path += ".payload"
    payload = action.get("payload", _MISSING)
    if payload is _MISSING:
        raise _reject(path, "missing; expected a mapping")
    if not isinstance(payload, Mapping):
        raise _reject(path, f"expected a mapping, got {describe_value(payload)}")

    endpoint = payload.get("source_control_endpoint", _MISSING)
    where = path + ".source_control_endpoint"
    if endpoint is _MISSING:
        raise _reject(where, "missing; expected 'tcp://HOST:PORT'")
    if not isinstance(endpoint, str):
        raise _reject(where, f"expected a string 'tcp://HOST:PORT', got {describe_value(endpoint)}")
    problem = _endpoint_problem(endpoint)
    if problem is not None:
        raise _reject(where, problem)

    hashes = payload.get("block_hashes", _MISSING)
    where = path + ".block_hashes"
    if hashes is _MISSING:
        raise _reject(where, "missing; expected a non-empty list of ints in [0, 2**64)")
    if type(hashes) is not list:
        raise _reject(
            where, f"expected a non-empty list of ints in [0, 2**64), got {describe_value(hashes)}"
        )
    if not hashes:
        raise _reject(where, "empty; expected a non-empty list of ints in [0, 2**64)")
    bad = _first_bad_hash(hashes)
    if bad is not None:
        raise _reject(f"{where}[{bad}]", _bad_hash_problem(hashes[bad]))

    mode = payload.get("mode")
    if mode is None:
        mode = "copy"
    elif not (type(mode) is str and mode in SUPPORTED_MODES):
        raise _reject(path + ".mode", f"{describe_value(mode)}; expected 'copy' or 'move'")
    no_retain = payload.get("no_retain")
    if no_retain is None:
        no_retain = False
    elif type(no_retain) is not bool:
        raise _reject(path + ".no_retain", f"{describe_value(no_retain)}; expected true or false")

    return RouterHint(
        source_control_endpoint=str(endpoint),
        ordered_hashes=tuple(hashes),
        message_id=envelope.get("message_id"),
        action_id=action.get("action_id"),
        protocol_version=protocol_version,
        action_version=action_version,
        mode=str(mode),
        no_retain=no_retain,
    )
