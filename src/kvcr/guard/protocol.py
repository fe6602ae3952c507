"""Guard service wire protocol, version 1: messages and framing (pure) + fd passing helpers.

A frame is a 4-byte big-endian body length followed by the body, one msgpack map
``{"v": 1, "t": <type>, ...fields}`` of at most :data:`MAX_FRAME` bytes. Every field is
checked strictly (an int is an int, not a bool or a string; sizes and strings are bounded),
and anything else is a :class:`~kvcr.errors.KVCRMsgFramingError` naming the problem, the
message type and the field path. A :class:`FrameReader` that raised stays failed: the
connection must be closed, since the stream position can no longer be trusted.

Flow (one request, one reply, on a Unix stream socket; a granted claim's connection stays
open for the lease's life and carries the holder's heartbeats)::

    worker (KVCRClient)                                 guard service
    ClaimRequest(index, layouts, digest, ...) ────────▶ check digest, layout, g3, pidfd
              ◀──────────────── ClaimGranted + SCM_RIGHTS [group fd, control listener fd]
              ◀──────────────── ClaimRefused(code, message)          (nothing passed)
    Heartbeat(index, lease, seq) ─────────────────────▶ (on the granted claim's connection,
    Heartbeat(index, lease, seq + 1) ─────────────────▶  open for the lease's life; no reply)
    ClaimRequest(reattach=True) + [pidfd, group fd, listener fd] ──▶ a group a dead service lent
              ◀──────────────── ClaimGranted (nothing passed: the holder has both already)
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
from kvcr.guard.fields import (
    MAX_PATH,
    U64,
    boolean,
    bound_port,
    each_str,
    group_index,
    int_in,
    list_of,
    one_of,
    optional_int,
    pid_field,
    pools,
    port_field,
    str_map,
    str_of,
    to_tuples,
    u64,
)
from kvcr.wire import describe, pack, strict_scalars

PROTOCOL_VERSION = 1
MAX_FRAME = 1 << 20
HEADER = 4
MAX_DIGEST = 256
MAX_HOST = 256
MAX_BACKEND = 64
MAX_G3_PATHS = 1024
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
    "not_detached",
)
GROUP_STATES = ("idle", "held", "serving", "handing_back", "unusable", "fencing", "detached")
MAX_HEARTBEAT_MS = 3_600_000


# --- messages ---


@attrs.frozen
class G3Description:
    """A plain description of the claimant's G3 (file) tier, compared by the service."""

    paths: list[str] = attrs.field(validator=list_of(each_str(1, MAX_PATH), 1, MAX_G3_PATHS))
    capacity_bytes_per_file: int = attrs.field(validator=int_in(1, U64 - 1))
    backend: str = attrs.field(validator=str_of(1, MAX_BACKEND))
    backend_options: dict[str, str] = attrs.field(validator=str_map)


@attrs.frozen
class ClaimRequest:
    """Claim pool group ``guard_index``; the claimant's pidfd travels with it (SCM_RIGHTS)."""

    TYPE: ClassVar[str] = "claim"
    guard_index: int = attrs.field(validator=group_index)
    pool_layouts: list[tuple[str, int]] = attrs.field(converter=to_tuples, validator=pools(2, 1))
    compatibility_digest: str = attrs.field(validator=str_of(1, MAX_DIGEST))
    control_host: str = attrs.field(validator=str_of(1, MAX_HOST))
    control_port: int = attrs.field(validator=port_field)  # 0: the service picks one
    g3: G3Description | None = attrs.field(
        validator=attrs.validators.optional(attrs.validators.instance_of(G3Description))
    )
    remote_fw_dram_backend: str = attrs.field(validator=str_of(1, MAX_BACKEND))
    pid: int = attrs.field(validator=pid_field)
    # The host peers reach the endpoint at, when it differs from (or is a wildcard for)
    # control_host: the service advertises it when it serves the group itself.
    control_advertise: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(str_of(1, MAX_HOST))
    )
    # Re-attach a group this process still maps, lent by a service that has since died: the
    # group file and the control listener travel after the pidfd (SCM_RIGHTS).
    reattach: bool = attrs.field(default=False, validator=boolean)


@attrs.frozen
class ClaimGranted:
    """The group is the claimant's under ``lease``; the group file and the control listener
    travel with it (SCM_RIGHTS, in that order)."""

    TYPE: ClassVar[str] = "granted"
    guard_index: int = attrs.field(validator=group_index)
    lease: int = attrs.field(validator=u64)
    pools: list[tuple[str, int, int]] = attrs.field(  # (name, offset in the group file, size)
        converter=to_tuples, validator=pools(3, 1)
    )
    journal_offset: int = attrs.field(validator=u64)
    journal_size: int = attrs.field(validator=int_in(1, U64 - 1))
    group_path: str = attrs.field(validator=str_of(1, MAX_PATH))
    control_host: str = attrs.field(validator=str_of(1, MAX_HOST))
    control_port: int = attrs.field(validator=bound_port)
    # How often the holder's runtime beats on this connection (0: the service fences by
    # process exit alone, and no beats are expected).
    heartbeat_ms: int = attrs.field(default=0, validator=int_in(0, MAX_HEARTBEAT_MS))


@attrs.frozen
class Heartbeat:
    """The holder of ``lease`` is alive: sent on the claim's connection, which stays open
    for the lease's life; ``seq`` grows by one per beat. No reply."""

    TYPE: ClassVar[str] = "beat"
    guard_index: int = attrs.field(validator=group_index)
    lease: int = attrs.field(validator=u64)
    seq: int = attrs.field(validator=u64)


@attrs.frozen
class ClaimRefused:
    TYPE: ClassVar[str] = "refused"
    code: str = attrs.field(validator=one_of(REFUSAL_CODES))
    message: str = attrs.field(validator=str_of(0, MAX_REFUSAL))


@attrs.frozen
class Release:
    """Give the group back; ``activated`` says whether the worker ever served from it."""

    TYPE: ClassVar[str] = "release"
    guard_index: int = attrs.field(validator=group_index)
    lease: int = attrs.field(validator=u64)
    activated: bool = attrs.field(validator=boolean)


@attrs.frozen
class ReleaseAck:
    TYPE: ClassVar[str] = "release_ack"
    guard_index: int = attrs.field(validator=group_index)
    lease: int = attrs.field(validator=u64)


@attrs.frozen
class StatusRequest:
    TYPE: ClassVar[str] = "status"


@attrs.frozen
class GroupStatus:
    index: int = attrs.field(validator=group_index)
    state: str = attrs.field(validator=one_of(GROUP_STATES))
    holder_pid: int | None = attrs.field(validator=optional_int(1, (1 << 31) - 1))
    layouts: list[tuple[str, int]] = attrs.field(converter=to_tuples, validator=pools(2, 0))
    control_port: int | None = attrs.field(validator=optional_int(1, 65535))
    # What the group's journal holds, as the service last read it (None: never read).
    journal_fill_percent: int | None = attrs.field(default=None, validator=optional_int(0, 100))
    journal_blocks: int | None = attrs.field(default=None, validator=optional_int(0, U64 - 1))
    recovery_disabled: bool = attrs.field(default=False, validator=boolean)
    # Holders of this group fenced for missed heartbeats since the service started, and how
    # long ago the current holder last beat (None: no holder, or no heartbeat required).
    fenced: int = attrs.field(default=0, validator=u64)
    last_beat_ms: int | None = attrs.field(default=None, validator=optional_int(0, U64 - 1))
    # Blocks the service wrote to peers while serving the group, and those of them it read
    # from the group's G3 files (since the service started; absent in older frames).
    served_blocks: int = attrs.field(default=0, validator=u64)
    served_g3_blocks: int = attrs.field(default=0, validator=u64)


@attrs.frozen
class StatusReply:
    TYPE: ClassVar[str] = "status_reply"
    groups: list[GroupStatus] = attrs.field(
        validator=list_of(
            lambda name, x: _expect(name, x, GroupStatus),
            0,
            MAX_GROUPS,
        )
    )


def _expect(name: str, value: Any, cls: type) -> None:
    if type(value) is not cls:
        raise TypeError(f"{name}: expected {cls.__name__}, got {type(value).__name__}")


Message = (
    ClaimRequest
    | ClaimGranted
    | Heartbeat
    | ClaimRefused
    | Release
    | ReleaseAck
    | StatusRequest
    | StatusReply
)
TYPES: dict[str, type] = {
    cls.TYPE: cls
    for cls in (
        ClaimRequest,
        ClaimGranted,
        Heartbeat,
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
