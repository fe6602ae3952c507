"""Two hosts on one machine: two network namespaces joined by a veth pair.

Each host is a network namespace with one end of the pair, an address in 198.18.0.0/24
(the benchmarking range: never routed anywhere) and its loopback up. A worker started on a
host (``ip netns exec``, which execs it: the pid is the worker's) sees only that host's
interfaces, so UCX must talk TCP over the veth, as between two machines: ``UCX_TLS=tcp,self``
with ``UCX_NET_DEVICES`` naming that host's end (UCX's defaults would still find the peer
"intra-node" and copy with CMA). Control endpoints bind every address and advertise the
host's own.

Faults are the kernel's: a link set down (no packet passes either way; a TCP connection
stalls until it is retransmitted or times out), or a queue on one host's end that passes
packets slowly (``shape``), or none at all while packets towards it still arrive
(``drop_leaving``: its bucket must not hold more than one packet, or the first few hundred
ACKs after the fault still pass and TCP's user timeout starts late).

Set-up takes ~0.1 s. Everything is undone in ``close`` (workers killed by pid, namespaces
deleted, which deletes the veth pair), also when a test fails half-way.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest

from procs import GuardProcess, SourceWorker

_serial = itertools.count()


def _run(*command: str) -> None:
    """An iproute2 command (``ip`` or ``tc``); RuntimeError with its words if it fails."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")


def _ip(*args: str) -> None:
    _run("ip", *args)


def _tc(*args: str) -> None:
    _run("tc", *args)


def why_not() -> str | None:
    """Why two hosts cannot be made here (None: they can)."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"two hosts need iproute2's `{tool}` (not installed)"
    if os.geteuid() != 0:
        return "two hosts need network namespaces: run the suite as root"
    probe = f"kvcr-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as exc:
        return f"`ip netns add` is not permitted here: {exc}"
    _ip("netns", "delete", probe)
    return None


@attrs.define
class Host:
    """One side: its namespace, its end of the veth pair and that end's address."""

    ns: str
    dev: str
    addr: str

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def env(self, **extra: str) -> dict[str, str]:
        """A worker's environment on this host: UCX over TCP on this host's end only,
        control bound to every address and advertised on this one."""
        return {
            "UCX_TLS": "tcp,self",
            "UCX_NET_DEVICES": self.dev,
            "KVCR_TEST_CONTROL_HOST": "0.0.0.0",
            "KVCR_TEST_ADVERTISE_HOST": self.addr,
            **extra,
        }


class TwoHosts:
    def __init__(self) -> None:
        tag = f"{os.getpid() % 10**6}{next(_serial)}"
        self.a = Host(f"kvcr-{tag}-a", f"kv{tag}a", "198.18.0.1")
        self.b = Host(f"kvcr-{tag}-b", f"kv{tag}b", "198.18.0.2")
        self.workers: list[SourceWorker] = []
        self.guards: list[GuardProcess] = []
        self._made: list[str] = []
        try:
            for host in (self.a, self.b):
                _ip("netns", "add", host.ns)
                self._made.append(host.ns)
            _ip("link", "add", self.a.dev, "type", "veth", "peer", "name", self.b.dev)
            for host in (self.a, self.b):
                _ip("link", "set", host.dev, "netns", host.ns)
                _ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", host.dev)
                _ip("-n", host.ns, "link", "set", host.dev, "up")
                _ip("-n", host.ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def worker(
        self,
        host: Host,
        name: str,
        sizes: tuple[int, int, int],
        log: Path | None = None,
        port: int | None = None,
        guard: tuple[str, int, str] | None = None,
        **env: str,
    ) -> SourceWorker:
        """A kvcr worker process (worker_proc.py) on ``host``, its control endpoint on
        ``port`` (a free one by default), over a guard's group with ``guard`` (socket path,
        group index, digest)."""
        worker = SourceWorker(
            name, sizes, port=port, guard=guard, env=host.env(**env), log=log, prefix=host.prefix
        )
        self.workers.append(worker)
        return worker

    def guard(self, host: Host, directory: Path, **kw: Any) -> GuardProcess:
        """A guard service (``python -m kvcr.kvcr_service``) on ``host``; stopped in
        ``close`` if the test did not stop it."""
        guard = GuardProcess(directory, env=host.env(), prefix=host.prefix, **kw)
        self.guards.append(guard)
        return guard

    def link(self, up: bool, host: Host | None = None) -> None:
        """Set ``host``'s end of the pair (both ends by default) down or up: down, no
        packet passes in either direction."""
        for side in (host,) if host is not None else (self.a, self.b):
            _ip("-n", side.ns, "link", "set", side.dev, "up" if up else "down")

    def shape(self, host: Host, rate: str) -> None:
        """Packets leaving ``host`` pass at ``rate`` (tc's units: "100mbit"); the rest are
        dropped after 50 ms in the queue."""
        _tc("-n", host.ns, "qdisc", "replace", "dev", host.dev, "root", "tbf", "rate", rate,
            "burst", "16kb", "latency", "50ms")  # fmt: skip

    def drop_leaving(self, host: Host) -> None:
        """Packets leaving ``host`` are dropped (one may pass: the bucket holds one MTU, and
        refills at 8 bits a second); packets to it still arrive."""
        _tc("-n", host.ns, "qdisc", "replace", "dev", host.dev, "root", "tbf", "rate", "8bit",
            "burst", "1540", "latency", "1ms")  # fmt: skip

    def unshape(self, host: Host) -> None:
        subprocess.run(
            ["tc", "-n", host.ns, "qdisc", "del", "dev", host.dev, "root"],
            capture_output=True,
            timeout=10,
            check=False,  # no qdisc to delete is fine
        )

    def close(self) -> None:
        for worker in self.workers:
            if worker.proc.poll() is None:
                worker.proc.kill()
            worker.proc.wait(10)
            worker.conn.close()
        self.workers.clear()
        for guard in self.guards:
            if guard.proc.poll() is None:
                guard.proc.kill()
            guard.proc.wait(10)
        self.guards.clear()
        for ns in self._made:
            subprocess.run(
                ["ip", "netns", "delete", ns], capture_output=True, timeout=10, check=False
            )
        self._made.clear()


@contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    hosts = TwoHosts()
    try:
        yield hosts
    finally:
        hosts.close()
