"""KVCRClient against a scripted peer on a real Unix socket: every way a reply can be wrong
becomes the right KVCRServiceError, and no descriptor leaks."""

from __future__ import annotations

import os
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvcr import KVCRClient, KVCRPoolHold
from kvcr.config import LocalDramOptions
from kvcr.errors import (
    KVCRGuardProtocolError,
    KVCRMsgFramingError,
    KVCRServiceError,
    KVCRSocketError,
)
from kvcr.guard import fdpass
from kvcr.guard import protocol as wire

LAYOUT = [("", 4096)]


def open_fds() -> Counter[str]:
    """How many pidfds and pipes this process has open (sockets come and go with the script)."""
    kinds: Counter[str] = Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "pidfd" in target or target.startswith("pipe:"):
            kinds[target.split(":")[0] + ("pidfd" if "pidfd" in target else "")] += 1
    return kinds


class Script:
    """Accepts one connection, reads the request, and answers with ``reply(conn)``."""

    def __init__(self, path: Path, reply: Callable[[socket.socket], None]) -> None:
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(str(path))
        self.server.listen(1)
        self.request: list[wire.Message] = []
        self.thread = threading.Thread(target=self._serve, args=(reply,), daemon=True)
        self.thread.start()

    def _serve(self, reply: Callable[[socket.socket], None]) -> None:
        conn, _ = self.server.accept()
        with conn:
            data, fds = fdpass.recv_frame_with_fds(conn, 4)
            for fd in fds:
                os.close(fd)
            self.request += wire.FrameReader().feed(data)
            reply(conn)

    def close(self) -> None:
        self.thread.join(10)
        self.server.close()


@pytest.fixture
def scripted(tmp_path) -> Iterator[Callable[..., KVCRClient]]:
    scripts: list[Script] = []

    def start(reply: Callable[[socket.socket], None]) -> KVCRClient:
        path = tmp_path / f"s{len(scripts)}.sock"
        scripts.append(Script(path, reply))
        client = KVCRClient(str(path))
        client.timeout_s = 1.0
        return client

    yield start
    for script in scripts:
        script.close()


def granted(index: int = 0) -> wire.ClaimGranted:
    return wire.ClaimGranted(
        guard_index=index,
        lease=7,
        pools=[("", 100 << 20, 1 << 20)],
        journal_offset=0,
        journal_size=100 << 20,
        group_path="/nonexistent",
        control_host="127.0.0.1",
        control_port=5555,
    )


def claim(client: KVCRClient) -> KVCRPoolHold:
    return client.claim(0, LAYOUT, "d", ("127.0.0.1", 0))


def test_a_refusal_is_a_protocol_error_with_the_services_reason(scripted) -> None:
    client = scripted(lambda c: c.sendall(wire.encode_frame(wire.ClaimRefused("held", "busy"))))
    with pytest.raises(KVCRGuardProtocolError, match=r"claim of group 0 refused \(held\): busy"):
        claim(client)


def test_a_grant_without_its_descriptors_is_a_protocol_error(scripted) -> None:
    before = open_fds()
    client = scripted(lambda c: c.sendall(wire.encode_frame(granted())))
    with pytest.raises(KVCRGuardProtocolError, match=r"granted with 0 descriptor\(s\), expected 2"):
        claim(client)
    assert open_fds() == before


def test_extra_descriptors_are_a_framing_error_and_all_are_closed(scripted) -> None:
    before = open_fds()
    pipes = [os.pipe() for _ in range(2)]
    fds = [fd for pair in pipes for fd in pair]
    client = scripted(lambda c: fdpass.send_frame_with_fds(c, granted(), fds))
    with pytest.raises(KVCRMsgFramingError, match="more than 2 descriptors"):
        claim(client)
    for fd in fds:
        os.close(fd)
    assert open_fds() == before


def test_garbage_is_a_framing_error(scripted) -> None:
    client = scripted(lambda c: c.sendall(b"\x00\x00\x00\x03abc"))
    with pytest.raises(KVCRMsgFramingError, match="status: guard frame: body is not msgpack"):
        client.status()


def test_a_wrong_reply_type_is_a_protocol_error(scripted) -> None:
    client = scripted(
        lambda c: c.sendall(wire.encode_frame(wire.ReleaseAck(guard_index=0, lease=1)))
    )
    with pytest.raises(KVCRGuardProtocolError, match="status: unexpected reply 'release_ack'"):
        client.status()


def test_a_closed_connection_and_silence_are_socket_errors(scripted) -> None:
    client = scripted(lambda c: None)
    with pytest.raises(KVCRSocketError, match="connection closed before the reply"):
        client.status()

    done = threading.Event()
    client = scripted(lambda c: done.wait(5))
    with pytest.raises(KVCRSocketError, match="timed out"):
        client.status()
    done.set()


def test_a_release_acknowledged_for_another_lease_is_a_protocol_error(scripted) -> None:
    client = scripted(
        lambda c: c.sendall(wire.encode_frame(wire.ReleaseAck(guard_index=0, lease=8)))
    )
    with pytest.raises(KVCRGuardProtocolError, match="acknowledged as group 0 lease 8"):
        client.release(0, 7)


def test_arguments_the_protocol_cannot_carry_are_value_errors(tmp_path) -> None:
    client = KVCRClient(str(tmp_path / "unused.sock"))
    with pytest.raises(
        ValueError, match=r"KVCRClient.claim: compatibility_digest must be 1\.\.256"
    ):
        client.claim(0, LAYOUT, "", ("127.0.0.1", 0))
    with pytest.raises(ValueError, match="control_port must be in"):
        client.claim(0, LAYOUT, "d", ("127.0.0.1", 70000))
    with pytest.raises(ValueError, match="non-empty path"):
        KVCRClient("")


def test_a_bare_hold_has_nothing_to_release_and_no_listener() -> None:
    hold = KVCRPoolHold(LocalDramOptions(pools=[("", 4096, 4096)]))
    assert hold.lease is None and hold.journal is None
    with pytest.raises(KVCRServiceError, match="no control listener"):
        hold.hand_listener_to(lambda fd: None)
    hold.release()
    hold.release()  # idempotent
    assert hold.released
