"""Peer-to-peer control channel over ZeroMQ (contract sections 1 and 7).

Workers exchange small *control* messages (opaque ``bytes``; KV payload bytes never travel
here, they go over NIXL). Each channel binds one ROUTER socket for receiving and lazily
connects one DEALER socket per remote endpoint for sending. ``recv()`` returns only the
message bytes, not who sent them: a sender that wants a reply must put its own
``endpoint`` inside the message. Delivery is best effort (at most once): messages in
flight when a peer closes or dies are lost, so the protocol on top must tolerate loss.

Shared listeners (guard service): the guard binds and listens on a TCP socket for a pool
group and keeps it open; a worker adopts a duplicate of that fd, so the endpoint outlives
the worker (peers reconnect into the kernel backlog until the next worker adopts it).
This uses ``zmq.USE_FD``, verified with pyzmq 27.3 / libzmq 4.3.5: set it on the ROUTER
before ``bind``; libzmq then skips ``socket/bind/listen``, accepts on that fd and closes
it when the ROUTER closes (we always hand it a private ``os.dup``). libzmq does not make
the fd non-blocking, so we do, otherwise a lost accept race (two workers on one listener)
would block libzmq's I/O thread in ``accept``. O_NONBLOCK lives on the shared open file
description; a guard that only holds the listener is unaffected.

A channel is not thread-safe (ZMQ sockets are not): use it from one thread.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import cast

import zmq

from kvcr.errors import (
    KVCRGuardProtocolError,
    KVCRMsgFramingError,
    KVCRServiceError,
    KVCRSocketError,
)
from kvcr.logs import get_logger

__all__ = [
    "KVCRGuardProtocolError",
    "KVCRMsgFramingError",
    "KVCRServiceError",
    "KVCRSocketError",
    "ZmqPeerControlChannel",
]

log = get_logger(__name__)

_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})


def _url_host(host: str) -> str:
    """ZMQ needs IPv6 literals in brackets; IPv4 addresses and host names pass unchanged."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _valid_port(port: object) -> bool:
    return isinstance(port, int) and not isinstance(port, bool) and 0 < port <= 65535


def _parse_tcp_endpoint(endpoint: object) -> bool:
    """True if ``endpoint`` is ``tcp://host:port``. libzmq accepts ports 0 and > 65535."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        return False
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    return bool(sep and host and host != "*" and port.isdigit() and _valid_port(int(port)))


def endpoint_host(endpoint: str) -> str | None:
    """The host of ``tcp://host:port`` (IPv6 brackets removed); None if it is not one."""
    if not _parse_tcp_endpoint(endpoint):
        return None
    return endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")


class ZmqPeerControlChannel:
    """One ROUTER to receive on, one cached DEALER per remote endpoint to send with."""

    #: Messages queued per peer before ``send`` answers False; set before the first send.
    send_hwm: int = 1000

    def __init__(self, bind_host: str, bind_port: int, advertise_host: str) -> None:
        if not _valid_port(bind_port):
            raise ValueError(f"bind_port must be an int in 1..65535, got {bind_port!r}")
        if not isinstance(advertise_host, str) or advertise_host in _WILDCARD_HOSTS:
            raise ValueError(f"advertise_host must be a reachable host, got {advertise_host!r}")
        if not isinstance(bind_host, str) or not bind_host:
            raise ValueError(f"bind_host must be a non-empty string, got {bind_host!r}")
        self._bind_host = bind_host.strip("[]")
        self._bind_port = bind_port
        self._advertise_host = advertise_host
        # Nothing is created here: no context, no socket, no bind (contract section 7).
        self._ctx: zmq.Context | None = None
        self._router: zmq.Socket | None = None
        self._dealers: dict[str, zmq.Socket] = {}
        self._listener_fd: int | None = None  # our private dup, until libzmq owns it
        self._closed = False

    @classmethod
    def from_shared_listener(cls, listener: socket.socket) -> ZmqPeerControlChannel:
        """Channel whose endpoint is an already bound and listening TCP socket.

        The listener's own address is both bound and advertised, so it must be a concrete
        address peers can reach (a wildcard address raises ValueError). The caller keeps
        ownership of ``listener``; the channel works on a duplicate of its fd.
        """
        host, port = listener.getsockname()[:2]
        if host in _WILDCARD_HOSTS:
            raise ValueError(f"shared listener is bound to wildcard {host!r}; bind a peer address")
        channel = cls(host, port, _url_host(host))
        channel.adopt_listener(listener.fileno())
        return channel

    @property
    def endpoint(self) -> str:
        """Address peers pass to ``send``; the port is the bound (or adopted) one."""
        return f"tcp://{self._advertise_host}:{self._bind_port}"

    def control_bind_address(self) -> tuple[str, int]:
        """(host, port) a guard service should bind the shared listener to, for this channel."""
        return (self._bind_host, self._bind_port)

    def adopt_listener(self, listener_fd: int) -> None:
        """Receive on a listening TCP socket bound by another process (call before initialize).

        ``listener_fd`` is duplicated, so the caller still owns (and may close) it. The
        channel's port becomes the listener's real port (from ``getsockname``).
        """
        if self._closed or self._router is not None:
            raise RuntimeError("adopt_listener must be called before initialize() and close()")
        fd = os.dup(listener_fd)
        try:
            probe = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            raise
        try:
            if probe.family not in (socket.AF_INET, socket.AF_INET6) or (
                probe.type != socket.SOCK_STREAM
            ):
                raise ValueError(f"listener_fd {listener_fd} is not a TCP socket")
            if not probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                raise ValueError(f"listener_fd {listener_fd} is not listening")
            host, port = probe.getsockname()[:2]
            probe.setblocking(False)  # see module docstring: libzmq's accept must not block
        except BaseException:
            probe.close()
            raise
        probe.detach()
        if self._listener_fd is not None:
            os.close(self._listener_fd)
        if port != self._bind_port:
            log.info("control_channel.adopted_port", configured=self._bind_port, actual=port)
        self._listener_fd, self._bind_host, self._bind_port = fd, host, port

    def initialize(self) -> None:
        """Create the ROUTER and bind it (idempotent). Raises KVCRSocketError naming the address."""
        if self._closed:
            raise RuntimeError("control channel is closed")
        if self._router is not None:
            return
        address = f"tcp://{_url_host(self._bind_host)}:{self._bind_port}"
        # The process-wide context is never terminated: a context of our own would have to
        # be, and a context finalized by the garbage collector before its sockets blocks
        # whatever thread the collector runs in (seen: the runtime thread, forever).
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        router = ctx.socket(zmq.ROUTER)
        try:
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.IPV6, 1 if ":" in self._bind_host else 0)
            if self._listener_fd is not None:
                router.setsockopt(zmq.USE_FD, self._listener_fd)
            router.bind(address)
        except zmq.ZMQError as exc:
            router.close(linger=0)
            raise KVCRSocketError(f"cannot bind control channel to {address}: {exc}") from exc
        self._listener_fd = None  # libzmq owns it now and closes it with the ROUTER
        self._ctx, self._router = ctx, router
        log.info("control_channel.bound", address=address, endpoint=self.endpoint)

    def send(self, endpoint: str, message: bytes) -> bool:
        """Queue ``message`` for ``endpoint`` without blocking; False if it was not queued.

        False means: channel not initialized or closed, malformed endpoint, or the send
        high-water mark for that peer is reached (e.g. it is down). Messages queue while a
        connection is being (re)established (IMMEDIATE off).
        """
        if not isinstance(message, (bytes, bytearray, memoryview)):
            raise TypeError(f"message must be bytes, got {type(message).__name__}")
        if self._ctx is None or self._closed or not _parse_tcp_endpoint(endpoint):
            return False
        dealer = self._dealers.get(endpoint)
        if dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            try:
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.setsockopt(zmq.SNDHWM, self.send_hwm)
                dealer.setsockopt(zmq.IMMEDIATE, 0)
                dealer.setsockopt(zmq.IPV6, 1)  # also connects to IPv4 peers
                dealer.connect(endpoint)
            except zmq.ZMQError as exc:
                dealer.close(linger=0)
                log.warning("control_channel.connect_failed", endpoint=endpoint, error=str(exc))
                return False
            self._dealers[endpoint] = dealer
        try:
            dealer.send(message, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def recv(self) -> list[bytes]:
        """All messages available right now, oldest first; ``[]`` if none. Never blocks."""
        if self._router is None or self._closed:
            return []
        messages: list[bytes] = []
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            if len(frames) != 2:  # [routing identity, payload]; DEALERs here send one frame
                log.warning("control_channel.dropped_malformed", frames=len(frames))
                continue
            messages.append(frames[1])

    def fileno(self) -> int | None:
        """ZMQ_FD of the receiving socket, for an event loop to wait on (None if not bound).

        The fd is edge-triggered and only says "ZMQ state may have changed", not "a
        message is ready". After it becomes readable, call ``recv()`` until it returns
        ``[]`` (which means ZMQ_EVENTS has no POLLIN) before waiting on the fd again;
        otherwise messages that are already queued produce no new wake-up.
        """
        if self._router is None or self._closed:
            return None
        return cast(int, self._router.getsockopt(zmq.FD))  # an int option

    def __del__(self) -> None:
        # Sockets left open would keep queued messages and fds alive for the process's life.
        with contextlib.suppress(Exception):
            self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close every socket, even if one close fails (logged, not raised). Idempotent."""
        if self._closed:
            return
        self._closed = True
        sockets = [*self._dealers.values(), *([self._router] if self._router else [])]
        self._dealers.clear()
        self._router = None
        all_closed = True
        for sock in sockets:
            try:
                sock.close(linger=0)
            except Exception:
                all_closed = False
                log.warning("control_channel.close_failed", exc_info=True)
        if self._listener_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._listener_fd)
            self._listener_fd = None
        if not all_closed:
            log.warning("control_channel.socket_leaked")
        self._ctx = None
