"""Frames with descriptors attached (SCM_RIGHTS), blocking: the client's side of the guard
protocol (the service uses trio sockets)."""

from __future__ import annotations

import array
import contextlib
import os
import socket

from kvcr.errors import KVCRMsgFramingError, KVCRSocketError
from kvcr.guard.protocol import FrameReader, Message, encode_frame


def send_frame_with_fds(sock: socket.socket, message: Message, fds: list[int]) -> None:
    """Send one frame with ``fds`` attached (SCM_RIGHTS) to its first bytes. The sender
    keeps its own copies of the descriptors: closing them is still its business."""
    data = encode_frame(message)
    try:
        sent = socket.send_fds(sock, [data], fds) if fds else sock.send(data)
        if sent < len(data):
            sock.sendall(data[sent:])
    except OSError as exc:
        raise KVCRSocketError(f"guard socket: send failed: {exc}") from exc


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def recv_frame_with_fds(sock: socket.socket, max_fds: int) -> tuple[bytes, list[int]]:
    """One blocking receive: the bytes read so far (part of a frame, a frame, or more; b""
    at end of stream) and the descriptors that came with them, which the caller now owns
    and must close on every path. More descriptors than ``max_fds`` is an error (the
    kernel dropped the rest; the ones received are closed)."""
    flags = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
    itemsize = array.array("i").itemsize
    try:
        data, ancdata, msg_flags, _addr = sock.recvmsg(
            1 << 16, socket.CMSG_SPACE(max(max_fds, 1) * itemsize), flags
        )
    except OSError as exc:
        raise KVCRSocketError(f"guard socket: receive failed: {exc}") from exc
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % itemsize])
    received = list(fds)
    if msg_flags & getattr(socket, "MSG_CTRUNC", 0) or len(received) > max_fds:
        _close_all(received)
        raise KVCRMsgFramingError(f"guard frame: more than {max_fds} descriptors attached")
    return data, received


def recv_message_with_fds(
    sock: socket.socket, reader: FrameReader, max_fds: int
) -> tuple[Message, list[int]]:
    """Block until ``reader`` completes exactly one reply; return it with the descriptors
    that came with it. On any error (socket, end of stream, framing, extra data) every
    descriptor received so far is closed before the error propagates."""
    fds: list[int] = []
    try:
        while True:
            data, more = recv_frame_with_fds(sock, max_fds - len(fds))
            fds += more
            if not data:
                reader.eof()
                raise KVCRSocketError("guard socket: connection closed before the reply")
            messages = reader.feed(data)
            if messages:
                if len(messages) > 1 or reader.pending:
                    raise KVCRMsgFramingError("guard frame: data after the reply")
                return messages[0], fds
    except BaseException:
        _close_all(fds)
        raise
