"""Behaviour of ZmqPeerControlChannel with real ZeroMQ sockets on 127.0.0.1.

Nothing here sleeps to synchronise: tests wait on the channel's fd (or retry) with a
deadline of a few seconds.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
import trio
import zmq

from kvcr.control_channels import (
    KVCRServiceError,
    KVCRSocketError,
    ZmqPeerControlChannel,
)
from kvcr.logs import capture_events
from procs import free_port

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"
DEADLINE_S = 5.0
# A call that blocks would wait for a peer that never comes: forever. One second tells it
# from a call that returns at once even when a loaded 2-core machine preempts the test.
AT_ONCE_S = 1.0


def listening_socket() -> socket.socket:
    """What the guard service does for a pool group: bind an ephemeral port and listen."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((HOST, 0))
    listener.listen(16)
    return listener


def recv_at_least(channel: ZmqPeerControlChannel, count: int) -> list[bytes]:
    """Drain until ``count`` messages arrived, waiting on the fd between drains."""
    received: list[bytes] = []
    deadline = time.monotonic() + DEADLINE_S
    while True:
        received += channel.recv()  # drain fully before waiting: the fd is edge-triggered
        remaining = deadline - time.monotonic()
        if len(received) >= count or remaining <= 0:
            return received
        select.select([channel.fileno()], [], [], min(remaining, 0.5))


ChannelFactory = Callable[..., ZmqPeerControlChannel]


@pytest.fixture
def channels() -> Iterator[ChannelFactory]:
    """Factory of initialized channels on free local ports; all are closed at teardown."""
    made: list[ZmqPeerControlChannel] = []

    def make(
        channel: ZmqPeerControlChannel | None = None, send_hwm: int | None = None
    ) -> ZmqPeerControlChannel:
        channel = channel or ZmqPeerControlChannel(HOST, free_port(), HOST)
        if send_hwm is not None:
            channel.send_hwm = send_hwm
        made.append(channel)
        channel.initialize()
        return channel

    yield make
    for channel in made:
        channel.close()


@pytest.mark.parametrize("bad_port", [0, -1, True, 65536, 5555.0, "5555", None])
def test_constructor_rejects_invalid_bind_port(bad_port: object) -> None:
    with pytest.raises(ValueError, match="bind_port"):
        ZmqPeerControlChannel(HOST, bad_port, HOST)  # type: ignore[arg-type]


def test_construction_creates_no_socket() -> None:
    port = free_port()
    channel = ZmqPeerControlChannel(HOST, port, HOST)
    with socket.socket() as plain:
        plain.bind((HOST, port))  # the port is still free: the channel bound nothing
        plain.listen()
    assert channel.fileno() is None
    assert channel.recv() == []
    assert channel.send(f"tcp://{HOST}:{free_port()}", b"x") is False  # not initialized
    channel.close()


def test_endpoint_is_advertise_host_and_bind_port() -> None:
    channel = ZmqPeerControlChannel("0.0.0.0", 5555, "node-a.example")
    assert channel.endpoint == "tcp://node-a.example:5555"
    assert channel.control_bind_address() == ("0.0.0.0", 5555)


def test_initialize_binds_and_is_idempotent(channels: ChannelFactory) -> None:
    channel = channels()
    port = int(channel.endpoint.rsplit(":", 1)[1])
    with socket.socket() as plain, pytest.raises(OSError) as excinfo:
        plain.bind((HOST, port))
    assert excinfo.value.errno == errno.EADDRINUSE
    fd = channel.fileno()
    channel.initialize()
    assert channel.fileno() == fd


def test_initialize_error_names_the_address_and_can_be_retried() -> None:
    occupier = listening_socket()
    port = occupier.getsockname()[1]
    channel = ZmqPeerControlChannel(HOST, port, HOST)
    with pytest.raises(KVCRSocketError, match=f"tcp://{HOST}:{port}") as excinfo:
        channel.initialize()
    assert isinstance(excinfo.value, KVCRServiceError)
    occupier.close()
    channel.initialize()
    assert channel.fileno() is not None
    channel.close()


def test_two_channels_exchange_messages_both_ways(channels: ChannelFactory) -> None:
    alice, bob = channels(), channels()
    # recv() does not say who sent a message, so a sender puts its reply endpoint inside.
    assert alice.send(bob.endpoint, b"hello from " + alice.endpoint.encode())
    [request] = recv_at_least(bob, 1)
    reply_to = request.removeprefix(b"hello from ").decode()
    assert reply_to == alice.endpoint
    assert bob.send(reply_to, b"hello back")
    assert recv_at_least(alice, 1) == [b"hello back"]


def test_many_messages_from_one_sender_arrive_in_order(channels: ChannelFactory) -> None:
    sender, receiver = channels(), channels()
    sent = [f"msg-{i}".encode() for i in range(500)]
    assert all(sender.send(receiver.endpoint, message) for message in sent)
    assert recv_at_least(receiver, len(sent)) == sent


def test_send_to_endpoint_nobody_listens_on_never_blocks(channels: ChannelFactory) -> None:
    channel = channels(send_hwm=5)
    nobody = f"tcp://{HOST}:{free_port()}"
    started = time.monotonic()
    assert channel.send(nobody, b"queued while connecting") is True
    assert time.monotonic() - started < AT_ONCE_S
    # Once the high-water mark for that peer is reached, send says "not queued" at once.
    results = []
    for _ in range(100):
        started = time.monotonic()
        results.append(channel.send(nobody, b"more"))
        assert time.monotonic() - started < AT_ONCE_S
    assert results[0] is True
    assert results[-1] is False
    assert 1 <= results.index(False) <= 50


def test_send_after_close_returns_false(channels: ChannelFactory) -> None:
    channel, peer = channels(), channels()
    assert channel.send(peer.endpoint, b"before")
    channel.close()
    assert channel.send(peer.endpoint, b"after") is False


@pytest.mark.parametrize(
    "endpoint",
    [
        "garbage",
        "tcp://",
        f"tcp://{HOST}",
        f"tcp://{HOST}:notaport",
        f"tcp://{HOST}:0",
        f"tcp://{HOST}:70000",
        "tcp://*:5555",
        "ipc:///tmp/kvcr-control",
        42,
    ],
)
def test_send_to_malformed_endpoint_returns_false(
    channels: ChannelFactory, endpoint: object
) -> None:
    assert channels().send(endpoint, b"x") is False  # type: ignore[arg-type]


def test_send_rejects_non_bytes_message(channels: ChannelFactory) -> None:
    channel, peer = channels(), channels()
    with pytest.raises(TypeError):
        channel.send(peer.endpoint, "text")  # type: ignore[arg-type]


def test_recv_on_empty_channel_returns_immediately(channels: ChannelFactory) -> None:
    channel = channels()
    started = time.monotonic()
    assert channel.recv() == []
    assert time.monotonic() - started < AT_ONCE_S


def test_close_is_idempotent_and_final(channels: ChannelFactory) -> None:
    channel = channels()
    channel.close()
    channel.close()
    assert channel.fileno() is None
    assert channel.recv() == []
    with pytest.raises(RuntimeError, match="closed"):
        channel.initialize()


def test_close_closes_everything_even_if_one_close_raises(
    channels: ChannelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    peer_a, peer_b = channels(), channels()
    created: list[zmq.Socket] = []  # the channel's sockets, in the order it makes them
    make_socket = zmq.Context.socket

    def recording(ctx: zmq.Context, kind: int, *args: object, **kwargs: object) -> zmq.Socket:
        sock = make_socket(ctx, kind, *args, **kwargs)
        created.append(sock)
        return sock

    with monkeypatch.context() as patched:
        patched.setattr(zmq.Context, "socket", recording)
        channel = channels()
        assert channel.send(peer_a.endpoint, b"a") and channel.send(peer_b.endpoint, b"b")
    router, failing, healthy = created
    assert router.type == zmq.ROUTER and failing.type == healthy.type == zmq.DEALER

    def broken_close(*args: object, **kwargs: object) -> None:
        raise OSError("close failed")

    monkeypatch.setattr(failing, "close", broken_close)
    with capture_events() as logs:
        channel.close()  # does not raise
    assert healthy.closed and router.closed
    assert "control_channel.close_failed" in [entry["event"] for entry in logs]
    assert channel.send(peer_a.endpoint, b"x") is False
    monkeypatch.undo()
    failing.close(linger=0)


def test_from_shared_listener_receives_on_the_listener_port(channels: ChannelFactory) -> None:
    listener = listening_socket()
    port = listener.getsockname()[1]
    channel = channels(ZmqPeerControlChannel.from_shared_listener(listener))
    assert channel.endpoint == f"tcp://{HOST}:{port}"
    assert channel.control_bind_address() == (HOST, port)
    assert channels().send(channel.endpoint, b"via shared listener")
    assert recv_at_least(channel, 1) == [b"via shared listener"]
    listener.close()


def test_from_shared_listener_rejects_unusable_sockets() -> None:
    with socket.socket() as unlistened:
        unlistened.bind((HOST, 0))
        with pytest.raises(ValueError, match="not listening"):
            ZmqPeerControlChannel.from_shared_listener(unlistened)
    with socket.socket() as wildcard:
        wildcard.bind(("0.0.0.0", 0))
        wildcard.listen()
        with pytest.raises(ValueError, match="wildcard"):
            ZmqPeerControlChannel.from_shared_listener(wildcard)


def test_endpoint_survives_the_worker_while_the_listener_is_held(
    channels: ChannelFactory,
) -> None:
    guard_listener = listening_socket()
    peer = channels()
    first_worker = channels(ZmqPeerControlChannel.from_shared_listener(guard_listener))
    assert peer.send(first_worker.endpoint, b"one")
    assert recv_at_least(first_worker, 1) == [b"one"]
    first_worker.close()  # the guard still holds the listener, so the port stays bound

    second_worker = channels(ZmqPeerControlChannel.from_shared_listener(guard_listener))
    assert second_worker.endpoint == first_worker.endpoint
    # The peer's connection reconnects into the kernel backlog; a message written during
    # the handover may be lost (at most once), so keep sending until one gets through.
    received: list[bytes] = []
    deadline = time.monotonic() + DEADLINE_S
    while not received and time.monotonic() < deadline:
        peer.send(second_worker.endpoint, b"two")
        select.select([second_worker.fileno()], [], [], 0.1)
        received = second_worker.recv()
    assert received and set(received) == {b"two"}
    guard_listener.close()


def test_adopt_listener_uses_a_duplicate_of_the_fd(channels: ChannelFactory) -> None:
    listener = listening_socket()
    port = listener.getsockname()[1]
    fd = os.dup(listener.fileno())
    listener.close()  # "the other process" is gone; only fd keeps the port bound
    channel = ZmqPeerControlChannel(HOST, 1, HOST)  # the port comes from the listener
    channel.adopt_listener(fd)
    os.close(fd)  # the caller keeps ownership of the fd it passed in
    channels(channel)
    assert channel.endpoint == f"tcp://{HOST}:{port}"
    assert channels().send(channel.endpoint, b"adopted")
    assert recv_at_least(channel, 1) == [b"adopted"]


_CHILD_BINDS_AND_PASSES_FD = """
import socket, sys
parent = socket.socket(fileno=int(sys.argv[1]))
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(16)
port = listener.getsockname()[1]
socket.send_fds(parent, [str(port).encode()], [listener.fileno()])
"""


def test_adopt_listener_from_a_process_that_has_exited(channels: ChannelFactory) -> None:
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with parent_end, child_end:
        child = subprocess.run(
            [sys.executable, "-c", _CHILD_BINDS_AND_PASSES_FD, str(child_end.fileno())],
            pass_fds=[child_end.fileno()],
            timeout=30,
            check=True,
        )
        assert child.returncode == 0  # the process that bound the port is gone
        port_bytes, [fd], _, _ = socket.recv_fds(parent_end, 64, 1)
    channel = ZmqPeerControlChannel(HOST, 1, HOST)
    channel.adopt_listener(fd)
    os.close(fd)
    channels(channel)
    assert channel.endpoint == f"tcp://{HOST}:{int(port_bytes)}"
    assert channels().send(channel.endpoint, b"to an endpoint bound by another process")
    assert recv_at_least(channel, 1) == [b"to an endpoint bound by another process"]


def test_adopt_listener_rejects_non_listening_fd_and_late_calls(
    channels: ChannelFactory,
) -> None:
    with socket.socket() as unlistened:
        unlistened.bind((HOST, 0))
        with pytest.raises(ValueError, match="not listening"):
            ZmqPeerControlChannel(HOST, 1, HOST).adopt_listener(unlistened.fileno())
    listener = listening_socket()
    with pytest.raises(RuntimeError, match="before initialize"):
        channels().adopt_listener(listener.fileno())
    listener.close()


def test_fileno_becomes_readable_when_a_peer_sends(channels: ChannelFactory) -> None:
    receiver, sender = channels(), channels()
    fd = receiver.fileno()
    assert fd is not None
    while receiver.recv():  # drained: from now on the fd signals new activity
        pass
    assert sender.send(receiver.endpoint, b"wake up")
    received: list[bytes] = []
    deadline = time.monotonic() + DEADLINE_S
    while not received and time.monotonic() < deadline:
        readable, _, _ = select.select([fd], [], [], deadline - time.monotonic())
        assert readable == [fd]
        received = receiver.recv()  # may be [] after a wake-up for a connection event
    assert received == [b"wake up"]


async def test_trio_runtime_waits_on_fileno_without_polling(channels: ChannelFactory) -> None:
    receiver, sender = channels(), channels()
    fd = receiver.fileno()
    assert fd is not None
    for i in range(3):
        assert sender.send(receiver.endpoint, f"n{i}".encode())
    received: list[bytes] = []
    with trio.fail_after(DEADLINE_S):
        while len(received) < 3:
            batch = receiver.recv()
            received += batch
            if not batch:  # drained; only now is it safe to wait for the next edge
                await trio.lowlevel.wait_readable(fd)
    assert received == [b"n0", b"n1", b"n2"]
