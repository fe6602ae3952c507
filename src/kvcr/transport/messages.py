"""Peer control messages: kvcr's own wire protocol between workers. Pure code.

Payload bytes never travel here; NIXL moves them. A message is one msgpack map
``{"v": 1, "t": <type>, ...fields}``; every field is checked strictly (an int is an int,
not a bool or a string), sizes are bounded, and anything else is a
:class:`MessageError` naming the message type and the field. The receiver drops such a
message with one log event per kind.

Flow (destination-initiated pull, one control round trip)::

    destination                                   source
    Hello(md) ───────────────────────────────────▶ add_peer(md)
             ◀───────────────────────────────────── HelloAck
    Pull(req, keys, dst ranges) ─────────────────▶ claim G2 / pin engine memory
             ◀═══════ one NIXL WRITE, notif=Written(req, indices) ═══
             ◀───────────────────────────────────── Over(req)   (nothing written, or failed)
    Probe(req, cancel) ──────────────────────────▶ (at the deadline)
             ◀───────────────────────────────────── ProbeAck(req, state)

Every message names its sender's endpoint (the reply address: the control channel does not
say who sent what) and its sender's *incarnation*, a random 64-bit id drawn when an
instance starts. A peer restarted at the same address has a new incarnation: operations
aimed at the old one fail at once.
"""

from __future__ import annotations

import array
import reprlib
import sys
import types
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import cattrs
import msgpack
from cattrs.preconf.msgpack import make_converter

from kvcr.wire import describe, pack, strict_scalars

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 16 << 20
MAX_KEYS = 65536
MAX_KEY_BYTES = 1024
MAX_ENDPOINT = 256
U64 = 1 << 64


class MessageError(ValueError):
    """A control message that cannot be accepted; the text names the type and the field."""


def _check_u64(_inst: object, attr: attrs.Attribute, value: int) -> None:
    if not 0 <= value < U64:
        raise ValueError(f"{attr.name} must be in [0, 2**64), got {value}")


def _check_endpoint(_inst: object, attr: attrs.Attribute, value: str) -> None:
    if not value or len(value) > MAX_ENDPOINT:
        raise ValueError(f"{attr.name} must be 1..{MAX_ENDPOINT} characters")


MAX_POOLS = 64


def _check_pools(_inst: object, attr: attrs.Attribute, value: int) -> None:
    if not 1 <= value <= MAX_POOLS:
        raise ValueError(f"{attr.name} must be in [1, {MAX_POOLS}], got {value}")


def _check_keys(_inst: object, attr: attrs.Attribute, value: list[bytes]) -> None:
    if len(value) > MAX_KEYS:
        raise ValueError(f"{attr.name} has {len(value)} entries, at most {MAX_KEYS}")
    if any(not k or len(k) > MAX_KEY_BYTES for k in value):
        raise ValueError(f"{attr.name}: every key must be 1..{MAX_KEY_BYTES} bytes")
    if len(set(value)) != len(value):
        raise ValueError(f"{attr.name}: keys must be unique")


@attrs.frozen
class Hello:
    """The sender's NIXL agent metadata; answered by HelloAck."""

    TYPE: ClassVar[str] = "hello"
    sender: str = attrs.field(validator=_check_endpoint)
    incarnation: int = attrs.field(validator=_check_u64)
    agent: str = attrs.field(validator=_check_endpoint)
    metadata: bytes = attrs.field(validator=attrs.validators.max_len(1 << 20))


@attrs.frozen
class HelloAck:
    TYPE: ClassVar[str] = "hello_ack"
    sender: str = attrs.field(validator=_check_endpoint)
    incarnation: int = attrs.field(validator=_check_u64)
    acked: int = attrs.field(validator=_check_u64)  # the incarnation whose metadata was added
    agent: str = attrs.field(validator=_check_endpoint)  # the sender's NIXL agent name


@attrs.frozen
class Pull:
    """Write these keys into these destination ranges: ``pools`` (address, bytes) pairs per
    key, in key order, packed as little-endian uint64s (one bulk check and no per-entry
    objects on either side: a 256-key pull decodes in well under 100 µs)."""

    TYPE: ClassVar[str] = "pull"
    sender: str = attrs.field(validator=_check_endpoint)
    incarnation: int = attrs.field(validator=_check_u64)
    target: int = attrs.field(validator=_check_u64)  # the source incarnation it is meant for
    req: int = attrs.field(validator=_check_u64)
    keys: list[bytes] = attrs.field(validator=_check_keys)
    pools: int = attrs.field(validator=_check_pools)
    dst: bytes
    # A router's "move": the destination sends Confirm once its engine has the keys, and
    # the source may then drop its copies. Left off the wire when False (older peers).
    move: bool = False

    def __attrs_post_init__(self) -> None:
        expected = 16 * self.pools * len(self.keys)
        if len(self.dst) != expected:
            raise ValueError(
                f"dst: {len(self.dst)} bytes, expected {expected} (16 per pool per key)"
            )
        if expected and min(_u64s(self.dst)) == 0:
            raise ValueError("dst: addresses and sizes must be positive")

    @staticmethod
    def pack(ranges: Sequence[tuple[int, int]]) -> bytes:
        """Pack (address, bytes) pairs, key by key and pool by pool."""
        flat = array.array("Q", [value for pair in ranges for value in pair])
        if sys.byteorder != "little":
            flat.byteswap()
        return flat.tobytes()

    def ranges(self) -> array.array:
        """The flat (address, bytes, address, bytes, ...) sequence."""
        return _u64s(self.dst)


def _u64s(data: bytes) -> array.array:
    values = array.array("Q")
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values


def _check_indices(_msg: object, _attribute: object, indices: list[int]) -> None:
    if any(not 0 <= i < MAX_KEYS for i in indices):
        raise ValueError(f"indices must be in [0, {MAX_KEYS})")


@attrs.frozen
class Written:
    """The NIXL notification of a finished write: which of the pull's keys were written."""

    TYPE: ClassVar[str] = "written"
    incarnation: int = attrs.field(validator=_check_u64)
    req: int = attrs.field(validator=_check_u64)
    indices: list[int] = attrs.field(validator=_check_indices)


# Over reasons that say the pull was never acted on, so asking again (after greeting the
# endpoint again) is safe: the process that got it cannot write it.
OTHER_INCARNATION = "the pull was meant for another incarnation of this source"
NOT_GREETED = "no metadata from this destination incarnation: say hello first"


@attrs.frozen
class Over:
    """The source is done with a pull without a (successful) write: nothing it holds can
    touch the destination's memory any more."""

    TYPE: ClassVar[str] = "over"
    sender: str = attrs.field(validator=_check_endpoint)
    incarnation: int = attrs.field(validator=_check_u64)
    req: int = attrs.field(validator=_check_u64)
    reason: str = attrs.field(validator=attrs.validators.max_len(512))


@attrs.frozen
class Probe:
    """Where is this pull? With ``cancel``, the source drops it if it has not started."""

    TYPE: ClassVar[str] = "probe"
    sender: str = attrs.field(validator=_check_endpoint)
    incarnation: int = attrs.field(validator=_check_u64)
    req: int = attrs.field(validator=_check_u64)
    cancel: bool


PROBE_STATES = ("pending", "writing", "over")


@attrs.frozen
class ProbeAck:
    TYPE: ClassVar[str] = "probe_ack"
    sender: str = attrs.field(validator=_check_endpoint)
    incarnation: int = attrs.field(validator=_check_u64)
    req: int = attrs.field(validator=_check_u64)
    state: str = attrs.field(validator=attrs.validators.in_(PROBE_STATES))


@attrs.frozen
class Confirm:
    """After a ``move`` pull: the destination's engine has taken the results of these of
    the pull's keys (indices into its keys); the source may drop its copies of them."""

    TYPE: ClassVar[str] = "confirm"
    sender: str = attrs.field(validator=_check_endpoint)
    incarnation: int = attrs.field(validator=_check_u64)
    req: int = attrs.field(validator=_check_u64)
    indices: list[int] = attrs.field(validator=_check_indices)


def xfer_id(incarnation: int, req: int) -> str:
    """A pull's transfer id, as both sides log it (``xfer=``): the destination's incarnation
    (random per process start) and its request number, both minted by the destination and
    carried in the pull (and in every message about it), so that a destination's and a
    source's events of one transfer can be joined across hosts."""
    return f"{incarnation:016x}.{req}"


Message = Hello | HelloAck | Pull | Written | Over | Probe | ProbeAck | Confirm
TYPES: dict[str, type] = {
    cls.TYPE: cls for cls in (Hello, HelloAck, Pull, Written, Over, Probe, ProbeAck, Confirm)
}


def _strict_converter() -> cattrs.Converter:
    converter = make_converter(forbid_extra_keys=True, omit_if_default=True)
    strict_scalars(converter, (int, bytes, str, bool))
    for item in (bytes, int):
        # Lists of plain values in one pass (a pull carries hundreds of keys).
        def list_hook(value: Any, _type: type, item: type = item) -> list:
            if type(value) is not list:
                raise TypeError(f"expected list, got {type(value).__name__}")
            for i, x in enumerate(value):
                if type(x) is not item:
                    raise TypeError(f"[{i}]: expected {item.__name__}, got {type(x).__name__}")
            return value

        list_of_item = types.GenericAlias(list, (item,))  # list[item]

        def is_list_of(t: Any, alias: Any = list_of_item) -> bool:
            return bool(t == alias)

        converter.register_structure_hook_func(is_list_of, list_hook)
    return converter


_converter = _strict_converter()


def encode(message: Message) -> bytes:
    return pack(_converter, PROTOCOL_VERSION, message)


def decode(data: bytes) -> Message:
    """Parse one message or raise MessageError naming what is wrong."""
    if not isinstance(data, bytes):
        raise MessageError(f"peer message: expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"peer message: {len(data)} bytes, at most {MAX_MESSAGE_BYTES}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:
        raise MessageError(f"peer message: not msgpack ({type(exc).__name__})") from None
    if not isinstance(raw, dict):
        raise MessageError(f"peer message: expected a map, got {type(raw).__name__}")
    version, kind = raw.pop("v", None), raw.pop("t", None)
    if type(version) is not int or version != PROTOCOL_VERSION:
        shown = reprlib.repr(version)  # bounded: never builds the repr of huge junk
        raise MessageError(f"peer message: protocol version {shown}, expected {PROTOCOL_VERSION}")
    cls = TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MessageError(f"peer message: unknown type {str(kind)[:40]!r}")
    try:
        return _converter.structure(raw, cls)
    except Exception as exc:
        raise MessageError(f"peer message {kind!r}: {describe(exc)[:300]}") from None
