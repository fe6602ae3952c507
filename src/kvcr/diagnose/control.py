"""The peer control endpoint: can a worker bind ``--control-port`` on ``--host`` (or
127.0.0.1), and does a message come back over it? The same ROUTER/DEALER pair kvcr's
control channel uses (control_channels.py), on plain ZMQ sockets."""

from __future__ import annotations

import errno
import ipaddress
import socket
from pathlib import Path

import zmq

from kvcr.diagnose import netif
from kvcr.diagnose.result import CheckResult

NAME = "control_port"
ROUND_TRIP_TIMEOUT_MS = 2000
_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def endpoint_url(host: str, port: int) -> str:
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        return f"tcp://{host}:{port}"
    return f"tcp://[{literal}]:{port}" if literal.version == 6 else f"tcp://{literal}:{port}"


def bind_address(host: str) -> str:
    """An address to bind for ``host``: ZMQ binds addresses (and interface names), not DNS
    names, so a name becomes its first address on this machine. OSError if it resolves to
    nothing."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    addresses = netif.resolve(host)
    interfaces = netif.interfaces()
    local = [a for a in addresses if netif.owner(a, interfaces) is not None]
    return (local or addresses)[0]


def free_port(host: str, after: int) -> int | None:
    """A port free on ``host`` right now to suggest instead: the next few after ``after``
    outside the ephemeral range (see :func:`check`), else any the kernel picks."""
    ephemeral = ephemeral_range()
    candidates = [
        p
        for p in range(after + 1, min(after + 100, 65535) + 1)
        if not (ephemeral and ephemeral[0] <= p <= ephemeral[1])
    ]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for candidate in [*candidates, 0]:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, candidate))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    return None


def ephemeral_range() -> tuple[int, int] | None:
    try:
        low, high = map(int, _PORT_RANGE.read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def _round_trip(context: zmq.Context[zmq.Socket[bytes]], endpoint: str, ipv6: bool) -> None:
    """Bind a ROUTER, connect a DEALER, and send a message each way (ZMQError on failure)."""
    router = context.socket(zmq.ROUTER)
    dealer = context.socket(zmq.DEALER)
    try:
        for sock in (router, dealer):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, int(ipv6))
        router.bind(endpoint)
        dealer.connect(endpoint)
        dealer.send(b"kvcr-diagnose ping")
        if not router.poll(ROUND_TRIP_TIMEOUT_MS):
            raise TimeoutError(f"no message arrived over {endpoint}")
        identity, _ = router.recv_multipart()
        router.send_multipart([identity, b"kvcr-diagnose pong"])
        if not dealer.poll(ROUND_TRIP_TIMEOUT_MS):
            raise TimeoutError(f"no reply came back over {endpoint}")
        dealer.recv()
    finally:
        router.close()
        dealer.close()


def check(port: int | None, host: str | None) -> CheckResult:
    if port is None:
        return CheckResult.skipped(NAME, "no --control-port given")
    try:
        bind_host = bind_address(host or "127.0.0.1")
    except OSError as exc:
        return CheckResult.fail(
            NAME,
            f"--host {host} does not resolve: {exc}",
            "pass an address of this machine (or a name that resolves to one) as --host",
            {"port": port, "host": host},
        )
    endpoint = endpoint_url(bind_host, port)
    details: dict[str, object] = {"port": port, "host": bind_host, "endpoint": endpoint}
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        _round_trip(context, endpoint, ipv6=":" in bind_host)
    except zmq.ZMQError as exc:
        details["error"] = str(exc)
        if exc.errno == errno.EADDRINUSE:
            spare = free_port(bind_host, port)
            instead = f" (e.g. --control-port {spare}, free now)" if spare else ""
            return CheckResult.fail(
                NAME,
                f"--control-port {port}: already in use on {bind_host}",
                f"choose a free port for --control-port{instead}, or stop the process that "
                f"listens on it (`ss -ltnp 'sport = :{port}'` shows it)",
                details,
            )
        if exc.errno in (errno.EADDRNOTAVAIL, errno.ENODEV, errno.EINVAL):
            return CheckResult.fail(
                NAME,
                f"--control-port {port}: cannot bind on {bind_host}: {exc}",
                "--host must be an address of this machine (the ucx_host check lists them)",
                details,
            )
        if exc.errno == errno.EACCES:
            return CheckResult.fail(
                NAME,
                f"--control-port {port}: not allowed to bind on {bind_host}: {exc}",
                "ports below 1024 need privileges: choose --control-port 1024 or above",
                details,
            )
        return CheckResult.fail(
            NAME,
            f"--control-port {port} on {bind_host}: {exc}",
            "a ZMQ endpoint cannot be opened there: check --host and --control-port",
            details,
        )
    except TimeoutError as exc:
        return CheckResult.fail(
            NAME,
            f"--control-port {port}: bound, but {exc}",
            "something between this process and its own port drops traffic: check the "
            f"firewall rules for TCP port {port} on {bind_host}",
            details,
        )
    finally:
        context.term()
    summary = f"{endpoint}: bind, connect and a round trip work"
    ephemeral = ephemeral_range()
    details["ephemeral_port_range"] = list(ephemeral) if ephemeral else None
    if ephemeral and ephemeral[0] <= port <= ephemeral[1]:
        return CheckResult.warn(
            NAME,
            f"{summary}; {port} is in the ephemeral range {ephemeral[0]}-{ephemeral[1]}",
            "outgoing connections may take this port while the worker is down, and then it "
            f"cannot bind it: choose a --control-port below {ephemeral[0]} (or reserve it in "
            "net.ipv4.ip_local_reserved_ports)",
            details,
        )
    return CheckResult.ok(NAME, summary, details)
