"""Guard service wire protocol, version 1: messages and framing (pure) + fd passing helpers.

A frame is a 4-byte big-endian body length followed by the body, one msgpack map
``{"v": 1, "t": <type>, ...fields}`` of at most :data:`MAX_FRAME` bytes. Every field is
checked strictly (an int is an int, not a bool or a string; sizes and strings are bounded),
and anything else is a :class:`~kvcr.errors.KVCRMsgFramingError` naming the problem, the
message type and the field path. A :class:`FrameReader` that raised stays failed: the
connection must be closed, since the stream position can no longer be trusted.

Flow (one request, one reply, on a Unix stream socket)::

    worker (KVCRClient)                                 guard service
    ClaimRequest(index, layouts, digest, ...) ────────▶ check digest, layout, g3, pidfd
              ◀──────────────── ClaimGranted + SCM_RIGHTS [group fd, control listener fd]
              ◀──────────────── ClaimRefused(code, message)          (nothing passed)
    Release(index, lease, activated) ─────────────────▶ unmap, fence the lease
              ◀──────────────────────────────────────── ReleaseAck(index, lease)
    StatusRequest() ──────────────────────────────────▶
              ◀──────────────────────────────────────── StatusReply([GroupStatus, ...])

Descriptors received over ``SCM_RIGHTS`` belong to the receiver, which must close them on
every path, errors included; :func:`recv_message_with_fds` does so itself when the reply
cannot be read or decoded.
"""

from __future__ import annotations

import reprlib
from typing import Any, ClassVar, get_args

import attrs
import cattrs
import msgpack
from cattrs.gen import make_dict_structure_fn
from cattrs.preconf.msgpack import make_converter

from kvcr.config import MAX_GROUPS
from kvcr.errors import KVCRMsgFramingError
from kvcr.wire import describe, pack, strict_scalars

PROTOCOL_VERSION = 1
MAX_FRAME = 1 << 20
HEADER = 4
U64 = 1 << 64
MAX_POOLS = 64
MAX_NAME = 256
MAX_DIGEST = 256
MAX_HOST = 256
MAX_PATH = 4096
MAX_BACKEND = 64
MAX_G3_PATHS = 1024
MAX_BACKEND_OPTIONS = 64
MAX_REFUSAL = 1024
MAX_ERROR_TEXT = 300

REFUSAL_CODES = (
    "digest_mismatch",
    "index_out_of_range",
    "held",
    "layout_mismatch",
    "g3_mismatch",
    "backend_mismatch",
    "control_mismatch",
    "control_unavailable",
    "bad_request",
    "permission_denied",
)
GROUP_STATES = ("idle", "held", "serving", "handing_back", "unusable")


# --- validators (run on construction, so in-code and decoded values obey the same rules) ---


def _int(lo: int, hi: int) -> Any:
    """An int (not a bool) in [lo, hi]."""

    def check(_inst: object, attr: attrs.Attribute, value: Any) -> None:
        if type(value) is not int:
            raise TypeError(f"{attr.name}: expected int, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise ValueError(f"{attr.name} must be in [{lo}, {hi}], got {value}")

    return check


def _optional_int(lo: int, hi: int) -> Any:
    inner = _int(lo, hi)

    def check(inst: object, attr: attrs.Attribute, value: Any) -> None:
        if value is not None:
            inner(inst, attr, value)

    return check


def _check_str(name: str, value: Any, lo: int, hi: int, forbid: str = "") -> None:
    if type(value) is not str:
        raise TypeError(f"{name}: expected str, got {type(value).__name__}")
    if not lo <= len(value) <= hi:
        raise ValueError(f"{name} must be {lo}..{hi} characters, got {len(value)}")
    for ch in forbid:
        if ch in value:
            raise ValueError(f"{name} must not contain {ch!r}")


def _str(lo: int, hi: int, forbid: str = "") -> Any:
    def check(_inst: object, attr: attrs.Attribute, value: Any) -> None:
        _check_str(attr.name, value, lo, hi, forbid)

    return check


def _bool(_inst: object, attr: attrs.Attribute, value: Any) -> None:
    if type(value) is not bool:
        raise TypeError(f"{attr.name}: expected bool, got {type(value).__name__}")


def _one_of(choices: tuple[str, ...]) -> Any:
    def check(_inst: object, attr: attrs.Attribute, value: Any) -> None:
        if value not in choices or type(value) is not str:
            raise ValueError(
                f"{attr.name} must be one of {list(choices)}, got {reprlib.repr(value)}"
            )

    return check


def _list_of(item: Any, lo: int, hi: int) -> Any:
    def check(inst: object, attr: attrs.Attribute, value: Any) -> None:
        if type(value) is not list:
            raise TypeError(f"{attr.name}: expected list, got {type(value).__name__}")
        if not lo <= len(value) <= hi:
            raise ValueError(f"{attr.name} must have {lo}..{hi} entries, got {len(value)}")
        for i, x in enumerate(value):
            item(f"{attr.name}[{i}]", x)

    return check


def _pool_entry(width: int) -> Any:
    """(name, size) or (name, offset, size): name 0..256 chars without ':' (the empty name is
    the single unnamed pool), size > 0."""

    def check(name: str, value: Any) -> None:
        if type(value) is not tuple or len(value) != width:
            raise TypeError(f"{name}: expected a {width}-tuple, got {reprlib.repr(value)}")
        _check_str(f"{name}[0]", value[0], 0, MAX_NAME, forbid=":")
        for j, x in enumerate(value[1:], start=1):
            if type(x) is not int:
                raise TypeError(f"{name}[{j}]: expected int, got {type(x).__name__}")
            lo = 1 if j == width - 1 else 0  # sizes are positive, offsets may be 0
            if not lo <= x < U64:
                raise ValueError(f"{name}[{j}] must be in [{lo}, 2**64), got {x}")

    return check


def _pools(width: int, lo: int) -> Any:
    """A list of pool entries with unique names."""
    each = _list_of(_pool_entry(width), lo, MAX_POOLS)

    def check(inst: object, attr: attrs.Attribute, value: Any) -> None:
        each(inst, attr, value)
        names = [entry[0] for entry in value]
        if len(set(names)) != len(names):
            raise ValueError(f"{attr.name}: pool names must be unique")

    return check


def _to_tuples(value: Any) -> Any:
    """Accept lists for pool entries (as they come off the wire) and store tuples."""
    if type(value) is list:
        return [tuple(x) if type(x) is list else x for x in value]
    return value


def _each_str(lo: int, hi: int) -> Any:
    return lambda name, x: _check_str(name, x, lo, hi)


def _str_map(_inst: object, attr: attrs.Attribute, value: Any) -> None:
    if type(value) is not dict:
        raise TypeError(f"{attr.name}: expected map, got {type(value).__name__}")
    if len(value) > MAX_BACKEND_OPTIONS:
        raise ValueError(f"{attr.name} has {len(value)} entries, at most {MAX_BACKEND_OPTIONS}")
    for k, v in value.items():
        _check_str(f"{attr.name} key", k, 1, MAX_NAME)
        _check_str(f"{attr.name}[{k!r}]", v, 0, MAX_PATH)


_u64 = _int(0, U64 - 1)
_pid = _int(1, (1 << 31) - 1)
_index = _int(0, MAX_GROUPS - 1)
_port = _int(0, 65535)
_bound_port = _int(1, 65535)


# --- messages ---


@attrs.frozen
class G3Description:
    """A plain description of the claimant's G3 (file) tier, compared by the service."""

    paths: list[str] = attrs.field(validator=_list_of(_each_str(1, MAX_PATH), 1, MAX_G3_PATHS))
    capacity_bytes_per_file: int = attrs.field(validator=_int(1, U64 - 1))
    backend: str = attrs.field(validator=_str(1, MAX_BACKEND))
    backend_options: dict[str, str] = attrs.field(validator=_str_map)


@attrs.frozen
class ClaimRequest:
    """Claim pool group ``guard_index``; the claimant's pidfd travels with it (SCM_RIGHTS)."""

    TYPE: ClassVar[str] = "claim"
    guard_index: int = attrs.field(validator=_index)
    pool_layouts: list[tuple[str, int]] = attrs.field(converter=_to_tuples, validator=_pools(2, 1))
    compatibility_digest: str = attrs.field(validator=_str(1, MAX_DIGEST))
    control_host: str = attrs.field(validator=_str(1, MAX_HOST))
    control_port: int = attrs.field(validator=_port)  # 0: the service picks one
    g3: G3Description | None = attrs.field(
        validator=attrs.validators.optional(attrs.validators.instance_of(G3Description))
    )
    remote_fw_dram_backend: str = attrs.field(validator=_str(1, MAX_BACKEND))
    pid: int = attrs.field(validator=_pid)
    # The host peers reach the endpoint at, when it differs from (or is a wildcard for)
    # control_host: the service advertises it when it serves the group itself.
    control_advertise: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(_str(1, MAX_HOST))
    )


@attrs.frozen
class ClaimGranted:
    """The group is the claimant's under ``lease``; the group file and the control listener
    travel with it (SCM_RIGHTS, in that order)."""

    TYPE: ClassVar[str] = "granted"
    guard_index: int = attrs.field(validator=_index)
    lease: int = attrs.field(validator=_u64)
    pools: list[tuple[str, int, int]] = attrs.field(  # (name, offset in the group file, size)
        converter=_to_tuples, validator=_pools(3, 1)
    )
    journal_offset: int = attrs.field(validator=_u64)
    journal_size: int = attrs.field(validator=_int(1, U64 - 1))
    group_path: str = attrs.field(validator=_str(1, MAX_PATH))
    control_host: str = attrs.field(validator=_str(1, MAX_HOST))
    control_port: int = attrs.field(validator=_bound_port)


@attrs.frozen
class ClaimRefused:
    TYPE: ClassVar[str] = "refused"
    code: str = attrs.field(validator=_one_of(REFUSAL_CODES))
    message: str = attrs.field(validator=_str(0, MAX_REFUSAL))


@attrs.frozen
class Release:
    """Give the group back; ``activated`` says whether the worker ever served from it."""

    TYPE: ClassVar[str] = "release"
    guard_index: int = attrs.field(validator=_index)
    lease: int = attrs.field(validator=_u64)
    activated: bool = attrs.field(validator=_bool)


@attrs.frozen
class ReleaseAck:
    TYPE: ClassVar[str] = "release_ack"
    guard_index: int = attrs.field(validator=_index)
    lease: int = attrs.field(validator=_u64)


@attrs.frozen
class StatusRequest:
    TYPE: ClassVar[str] = "status"


@attrs.frozen
class GroupStatus:
    index: int = attrs.field(validator=_index)
    state: str = attrs.field(validator=_one_of(GROUP_STATES))
    holder_pid: int | None = attrs.field(validator=_optional_int(1, (1 << 31) - 1))
    layouts: list[tuple[str, int]] = attrs.field(converter=_to_tuples, validator=_pools(2, 0))
    control_port: int | None = attrs.field(validator=_optional_int(1, 65535))
    # What the group's journal holds, as the service last read it (None: never read).
    journal_fill_percent: int | None = attrs.field(default=None, validator=_optional_int(0, 100))
    journal_blocks: int | None = attrs.field(default=None, validator=_optional_int(0, U64 - 1))
    recovery_disabled: bool = attrs.field(default=False, validator=_bool)
    # Blocks the service wrote to peers while serving the group, and those of them it read
    # from the group's G3 files (since the service started; absent in older frames).
    served_blocks: int = attrs.field(default=0, validator=_u64)
    served_g3_blocks: int = attrs.field(default=0, validator=_u64)


@attrs.frozen
class StatusReply:
    TYPE: ClassVar[str] = "status_reply"
    groups: list[GroupStatus] = attrs.field(
        validator=_list_of(
            lambda name, x: _expect(name, x, GroupStatus),
            0,
            MAX_GROUPS,
        )
    )


def _expect(name: str, value: Any, cls: type) -> None:
    if type(value) is not cls:
        raise TypeError(f"{name}: expected {cls.__name__}, got {type(value).__name__}")


Message = (
    ClaimRequest | ClaimGranted | ClaimRefused | Release | ReleaseAck | StatusRequest | StatusReply
)
TYPES: dict[str, type] = {
    cls.TYPE: cls
    for cls in (
        ClaimRequest,
        ClaimGranted,
        ClaimRefused,
        Release,
        ReleaseAck,
        StatusRequest,
        StatusReply,
    )
}


# --- codec ---


def _strict_converter() -> cattrs.Converter:
    converter = make_converter(forbid_extra_keys=True)
    strict_scalars(converter, (int, str, bool))

    def is_list(t: Any) -> bool:
        return getattr(t, "__origin__", None) is list

    def list_hook(value: Any, t: Any) -> list:
        if type(value) is not list:
            raise TypeError(f"expected list, got {type(value).__name__}")
        (item,) = get_args(t)
        out = []
        for i, x in enumerate(value):
            try:
                out.append(converter.structure(x, item))
            except Exception as exc:
                inner = describe(exc)
                sep = "" if inner.startswith("[") else ": "
                raise TypeError(f"[{i}]{sep}{inner}") from None
        return out

    converter.register_structure_hook_func(is_list, list_hook)

    def is_tuple(t: Any) -> bool:
        return getattr(t, "__origin__", None) is tuple

    def tuple_hook(value: Any, t: Any) -> tuple:
        items = get_args(t)
        if type(value) is not list or len(value) != len(items):
            raise TypeError(f"expected a {len(items)}-element array, got {reprlib.repr(value)}")
        for j, (x, cls) in enumerate(zip(value, items)):
            if type(x) is not cls:
                raise TypeError(f"[{j}]: expected {cls.__name__}, got {type(x).__name__}")
        return tuple(value)

    converter.register_structure_hook_func(is_tuple, tuple_hook)

    def str_map_hook(value: Any, _type: Any) -> dict:
        if type(value) is not dict:
            raise TypeError(f"expected map, got {type(value).__name__}")
        return value  # keys and values are checked by the attrs validator

    converter.register_structure_hook_func(lambda t: t == dict[str, str], str_map_hook)

    for cls in (G3Description, GroupStatus):
        inner = make_dict_structure_fn(cls, converter, _cattrs_forbid_extra_keys=True)

        def map_hook(value: Any, _type: Any, inner: Any = inner) -> Any:
            if type(value) is not dict:
                raise TypeError(f"expected map, got {type(value).__name__}")
            return inner(value, _type)

        converter.register_structure_hook(cls, map_hook)
    return converter


_converter = _strict_converter()


def encode(message: Message) -> bytes:
    """The msgpack body of ``message`` (no length prefix)."""
    return pack(_converter, PROTOCOL_VERSION, message)


def encode_frame(message: Message) -> bytes:
    """Length prefix + body; a body over MAX_FRAME is a KVCRMsgFramingError."""
    body = encode(message)
    if len(body) > MAX_FRAME:
        raise KVCRMsgFramingError(
            f"guard frame {message.TYPE!r}: body of {len(body)} bytes, at most {MAX_FRAME}"
        )
    return len(body).to_bytes(HEADER, "big") + body


def decode_body(raw: bytes) -> Message:
    """Parse one frame body or raise KVCRMsgFramingError naming what is wrong."""
    if len(raw) > MAX_FRAME:
        raise KVCRMsgFramingError(f"guard frame: body of {len(raw)} bytes, at most {MAX_FRAME}")
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:
        raise KVCRMsgFramingError(
            f"guard frame: body is not msgpack ({type(exc).__name__})"
        ) from None
    if type(data) is not dict:
        raise KVCRMsgFramingError(f"guard frame: body is not a map, got {type(data).__name__}")
    version, kind = data.pop("v", None), data.pop("t", None)
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise KVCRMsgFramingError(
            f"guard frame: wrong protocol version {reprlib.repr(version)}, expected {PROTOCOL_VERSION}"
        )
    cls = TYPES.get(kind) if type(kind) is str else None
    if cls is None:
        raise KVCRMsgFramingError(f"guard frame: unknown type {reprlib.repr(kind)}")
    try:
        return _converter.structure(data, cls)
    except Exception as exc:
        text = describe(exc)[:MAX_ERROR_TEXT]
        raise KVCRMsgFramingError(f"guard frame {kind!r}: bad field: {text}") from None


class FrameReader:
    """Sans-IO incremental frame decoder for one connection.

    ``feed`` the bytes as they arrive; it returns the messages completed by them. On a
    malformed frame it raises KVCRMsgFramingError and every later ``feed`` raises again:
    close the connection. An oversized length is rejected as soon as its header arrives.
    """

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buffer = bytearray()
        self._max_frame = max_frame
        self._error: str | None = None

    @property
    def failed(self) -> bool:
        return self._error is not None

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Message]:
        if self._error is not None:
            raise KVCRMsgFramingError(f"guard connection already failed: {self._error}")
        self._buffer += data
        messages: list[Message] = []
        buffer = self._buffer
        while len(buffer) >= HEADER:
            size = int.from_bytes(buffer[:HEADER], "big")
            if size == 0 or size > self._max_frame:
                what = (
                    "zero" if size == 0 else f"oversized ({size} bytes, at most {self._max_frame})"
                )
                self._fail(f"guard frame: {what} length")
            if len(buffer) < HEADER + size:
                break
            body = bytes(buffer[HEADER : HEADER + size])
            del buffer[: HEADER + size]
            try:
                messages.append(decode_body(body))
            except KVCRMsgFramingError as exc:
                self._fail(str(exc))
        return messages

    def eof(self) -> None:
        """The peer closed the connection: an incomplete frame is a framing error."""
        if self._error is None and self._buffer:
            self._fail(f"guard frame: connection closed mid-frame ({len(self._buffer)} bytes)")

    def _fail(self, text: str) -> None:
        self._error = text
        self._buffer.clear()
        raise KVCRMsgFramingError(text)
