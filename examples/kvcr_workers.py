"""What the multi-worker examples share: an engine stand-in, kvcr workers in child processes,
and a guard service to run them over.

A real deployment has an inference engine in each worker process; here a numpy array over
a shared mapping (4 KiB pages, as engines hand kvcr host memory) is the engine's KV memory,
and each block's bytes are derived from its key, so that any copy of a block can be checked
against the original by checksum. A :class:`Worker` is a child process running one KVCR
instance with a real NIXL agent and a real ZMQ control channel on 127.0.0.1; the parent
drives it with commands and can SIGKILL it.
"""

from __future__ import annotations

import os

# Set before kvcr (or NIXL) is imported anywhere in the process: see examples/quickstart.py.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MEM_EVENTS", "no")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import mmap
import multiprocessing
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvcr import KVCR, KVCRBindings, KVCRClient
from kvcr.config import (
    KVCRBackendConfigs,
    KVCRConfig,
    KVCRGuardConfig,
    LocalDramOptions,
)
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.errors import KVCRSocketError
from kvcr.hints import fetch_hint
from kvcr.telemetry import (
    DURATION_METRIC,
    SCOPE_LOCAL_DELIVER,
    SCOPE_LOCAL_FILL,
    TRANSFER_BYTES_METRIC,
    InMemoryStats,
)
from kvcr.types import MemoryRef, QueryStatus, RegionDescriptor

DIGEST = "example-model/tp1/bf16"  # what every worker of a deployment presents to the guard
# An engine calls poll_completed() once per scheduler step and sleeps (or runs the model) in
# between; a loop that spun on it instead would hold the GIL that kvcr's runtime needs.
ENGINE_STEP_S = 0.0005


def wait_for(
    kv: KVCR, handle: int, nkeys: int, timeout_s: float = 10.0, step_s: float = ENGINE_STEP_S
) -> dict:
    """Poll until all ``nkeys`` entries of operation ``handle`` have arrived, once every
    ``step_s`` (the engine's scheduler step).

    An engine calls ``poll_completed()`` from its own loop. One operation's entries may
    arrive over several polls, so collect them until every key is answered. (A real
    adapter also keeps results of other operations that arrive meanwhile; here only one
    operation is in flight at a time.)
    """
    entries: dict = {}
    deadline = time.monotonic() + timeout_s
    while len(entries) < nkeys:
        for op, results in kv.poll_completed():
            if op == handle:
                entries.update(results)
        if time.monotonic() > deadline:
            raise TimeoutError(f"operation {handle}: {len(entries)} of {nkeys} entries arrived")
        time.sleep(step_s)
    return entries


def shared_pages(nbytes: int) -> np.ndarray:
    """Host memory as engines give it to kvcr (vLLM's CPU pool, the guard's /dev/shm pools): a
    shared mapping, so 4 KiB pages (transparent huge pages do not back shared memory unless
    ``shmem_enabled`` says so), every page faulted in now so that no transfer pays for it.
    The mapping lives as long as the array."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    buf = np.frombuffer(mapping, dtype=np.uint8)
    buf.fill(0)
    return buf


_THP_FIELDS = ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:")


def page_kib(address: int = 0, file_suffix: str = "") -> int:
    """The largest page size (KiB) backing the mapping of this process that holds
    ``address`` (or, with ``file_suffix``, maps a file whose name ends so), from
    /proc/self/smaps: a transfer's copy cost depends on it. 0 if none matches."""
    largest, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            field, *rest = line.split()
            if "-" in field and not field.endswith(":"):  # a mapping's header line
                low, high = (int(x, 16) for x in field.split("-"))
                if file_suffix:
                    inside = len(rest) > 4 and rest[-1].endswith(file_suffix)
                else:
                    inside = low <= address < high
            elif inside and field == "KernelPageSize:":
                largest = max(largest, int(rest[0]))
            elif inside and field in _THP_FIELDS and int(rest[0]):
                largest = max(largest, 2048)  # transparent huge pages back part of it
    return largest


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class IntKeys:
    """The engine's key adapter: block hash (an int, as the router knows it) <-> kvcr key."""

    def encode(self, framework_key: int) -> bytes:
        return framework_key.to_bytes(8, "big")

    def decode(self, key: bytes) -> int:
        return int.from_bytes(key, "big")


# -- the guard service ------------------------------------------------------------------------


def wait_for_guard(
    client: KVCRClient, alive: Callable[[], bool] = lambda: True, timeout_s: float = 30
) -> bool:
    """Whether the guard service answers ``client`` within ``timeout_s`` (and while
    ``alive()``): its socket appears once every pool group exists."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.status()
            return True
        except KVCRSocketError:
            if not alive() or time.monotonic() > deadline:
                return False
            time.sleep(0.01)


class Guard:
    """``kvcr-guard`` in a child process, with ``groups`` pool groups of ``size_gb`` each."""

    def __init__(self, directory: Path, groups: int, size_gb: float, wait: bool = True) -> None:
        """``wait=False`` returns once the service is started (workers can start meanwhile:
        they wait for it); :meth:`ready` waits for it."""
        self.socket_path = str(directory / "guard.sock")
        (directory / "pools").mkdir()
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "kvcr.kvcr_service"),
                *("--socket-path", self.socket_path, "--pool-dir", str(directory / "pools")),
                *("--guard-count", str(groups), "--pool-sizes-gb", str(size_gb)),
                *("--compatibility-digest", DIGEST, "--log-level", "WARNING"),
            ]
        )
        self.client = KVCRClient(self.socket_path)
        if wait:
            self.ready()

    def ready(self) -> Guard:
        """Wait until the service answers (once every pool group exists)."""
        if not wait_for_guard(self.client, lambda: self.proc.poll() is None):
            raise RuntimeError("kvcr-guard did not start")
        return self

    def states(self) -> list[str]:
        return [group.state for group in self.client.status()]

    def wait_for_state(self, group: int, state: str, timeout_s: float = 30) -> float:
        """Seconds until group ``group`` is in ``state``."""
        started = time.monotonic()
        while self.states()[group] != state:
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"group {group} is {self.states()[group]}, not {state}")
            time.sleep(0.002)
        return time.monotonic() - started

    def status_table(self) -> str:
        status = [sys.executable, "-m", "kvcr.kvcr_service", "status"]
        return subprocess.run(
            [*status, "--socket-path", self.socket_path], capture_output=True, text=True, check=True
        ).stdout

    def stop(self) -> None:
        self.proc.terminate()  # SIGTERM: the service removes its pool files and socket
        self.proc.wait(30)


# -- workers in child processes ---------------------------------------------------------------


class Worker:
    """One kvcr worker in a child process. ``guard`` = (socket path, group index) runs it over
    the guard's pool group; otherwise it owns a pool of ``pool_blocks`` blocks."""

    def __init__(
        self,
        name: str,
        *,
        block_size: int,
        engine_blocks: int,
        pool_blocks: int = 0,
        guard: tuple[str, int] | None = None,
        port: int | None = None,
        wait: bool = True,
    ) -> None:
        """``wait=False`` returns once the child is started: several workers then import
        and start up side by side, and :meth:`ready` waits for one."""
        # Workers fork from one server process that imported kvcr, numpy, ZMQ and NIXL
        # once: those imports are most of a fresh interpreter's start-up, paid once, not
        # per worker (a replacement starts at once). The server runs no NIXL agent and no
        # kvcr thread (this process may), so forking it is safe.
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
        self.name = name
        self.port = port or free_port()  # a replacement over the same guard group reuses it
        self.conn, theirs = context.Pipe()
        spec = dict(
            name=name,
            block_size=block_size,
            engine_blocks=engine_blocks,
            pool_blocks=pool_blocks,
            guard=guard,
            port=self.port,
        )
        self.proc = context.Process(target=_serve, args=(theirs, spec), daemon=True)
        self.proc.start()
        theirs.close()
        self._endpoint: str | None = None
        if wait:
            self.ready()

    def ready(self) -> Worker:
        """Wait until the child's KVCR is up (imports, pools, NIXL agent, control channel)."""
        if self._endpoint is None:
            self._endpoint = self("endpoint")
        return self

    @property
    def endpoint(self) -> str:
        """The worker's peer control endpoint (its ZMQ listener), where hints point."""
        endpoint = self.ready()._endpoint
        assert endpoint is not None
        return endpoint

    def __call__(self, command: str, *args: Any, timeout_s: float = 60) -> Any:
        self.conn.send((command, *args))
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"worker {self.name}: no answer to {command!r}")
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(f"worker {self.name}: {command} failed:\n{value}")
        return value

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind, as when a worker crashes."""
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            self("stop")
        self.proc.join(30)


# What the fork server imports: installed packages only, as its sys.path is the
# interpreter's (without this directory), and a module it cannot import it skips.
_PRELOAD = ["numpy", "zmq", "trio", "kvcr", "kvcr.control_channels", "kvcr.transport.nixl"]


def block_bytes(key: int, size: int) -> np.ndarray:
    """The bytes of block ``key``: the same wherever they are computed."""
    return np.random.default_rng(key).integers(0, 256, size, dtype=np.uint8)


def _serve(conn: Any, spec: dict) -> None:
    """The child: one engine stand-in and one KVCR, obeying the parent's commands."""
    name, block = spec["name"], spec["block_size"]
    engine = shared_pages(block * spec["engine_blocks"])
    pool = shared_pages(block * max(spec["pool_blocks"], 1))
    keys = IntKeys()
    channel = ZmqPeerControlChannel("127.0.0.1", spec["port"], "127.0.0.1")
    stats = InMemoryStats()
    guard = spec["guard"]
    if guard and not wait_for_guard(KVCRClient(guard[0])):  # started beside this worker
        raise RuntimeError(f"{name}: the guard service at {guard[0]} does not answer")
    started = time.perf_counter()
    kv = KVCR(
        KVCRConfig(name, [("", block)], enable_telemetry=True),
        KVCRBindings(
            # This engine never lends its own memory to peers: they get kvcr's pool copies.
            request_pin=lambda wanted: 0,
            poll_pin_results=lambda: [],
            release_pin=lambda handle: True,
            framework_control=channel,
            key_adapter=keys,
            stats_factory=lambda: stats,
        ),
        KVCRBackendConfigs(
            framework_regions=[
                RegionDescriptor(addr=engine.ctypes.data, size=block, count=spec["engine_blocks"])
            ],
            local_dram=None if guard else LocalDramOptions([("", pool.ctypes.data, pool.nbytes)]),
        ),
        KVCRGuardConfig(guard[0], guard[1], DIGEST) if guard else None,
    )
    startup_seconds = time.perf_counter() - started  # claim, handback, NIXL, warm start

    def view(element: int) -> np.ndarray:
        return engine[element * block : (element + 1) * block]

    def refs(hashes: Sequence[int]) -> dict[bytes, list[MemoryRef]]:
        return {
            keys.encode(h): [MemoryRef(end_point_name=name, element_index=i)]
            for i, h in enumerate(hashes)
        }

    applied: dict[tuple[str, ...], int] = {}  # samples of each (scope, result) taken

    def runtime_seconds(*scopes: str) -> float:
        """kvcr's own duration of the operation that just ended, by its runtime's clock:
        from when the runtime took the command until it queued the results, so without the
        engine's wait for its next poll. (An operation with local and remote keys records
        the same duration under both scopes.)"""
        # The runtime records an operation just after it queues the results: a poll can
        # return them first, so wait for the sample.
        deadline = time.monotonic() + 5
        while True:
            kv.get_stats()  # applies the runtime's samples here, on the engine's thread
            fresh = {
                labels: values[applied.get(labels, 0) :]
                for (metric, labels), values in stats.histograms.items()
                if metric == DURATION_METRIC and labels[0] in scopes
            }
            if any(fresh.values()):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvcr recorded no operation under {scopes}")
            time.sleep(0.0001)
        for labels, values in fresh.items():
            applied[labels] = applied.get(labels, 0) + len(values)
        return float(max(max(values) for values in fresh.values() if values))

    def compute_and_deposit(hashes: Sequence[int]) -> dict:
        """The engine computed these blocks (engine blocks 0..): offer them to kvcr.
        Returns their checksums, the seconds from the deposit call until the poll that
        returned its last entry, and kvcr's runtime's seconds for it."""
        for i, h in enumerate(hashes):
            view(i)[:] = block_bytes(h, block)
        started = time.perf_counter()
        entries = wait_for(kv, kv.deposit(refs(hashes)), len(hashes))
        seconds = time.perf_counter() - started
        failed = {keys.decode(k): e.status.name for k, e in entries.items() if not e.success}
        if failed:
            raise RuntimeError(f"deposit: {len(failed)} of {len(hashes)} blocks failed: {failed}")
        return {
            "crc": {h: zlib.crc32(view(i)) for i, h in enumerate(hashes)},
            "seconds": seconds,
            "runtime_seconds": runtime_seconds(SCOPE_LOCAL_FILL),
        }

    def deliver(hashes: Sequence[int], source: str | None, request: str) -> dict:
        """Place these blocks into engine blocks 0..; with ``source``, the router's hint
        names the worker that has them. Returns statuses, checksums, the seconds from the
        deliver call until the poll that returned its last entry, and kvcr's runtime's
        seconds for it."""
        engine[:] = 0
        if source is not None:
            kv.submit_hint(fetch_hint(source, hashes), request_id=request)
        started = time.perf_counter()
        entries = wait_for(kv, kv.deliver(refs(hashes), request_id=request), len(hashes))
        seconds = time.perf_counter() - started
        kv.discard_hint(request)
        return {
            "status": {h: entries[keys.encode(h)].status.name for h in hashes},
            "crc": {h: zlib.crc32(view(i)) for i, h in enumerate(hashes)},
            "seconds": seconds,
            "runtime_seconds": runtime_seconds(SCOPE_LOCAL_DELIVER, "remote_deliver"),
        }

    def query(hashes: Sequence[int]) -> list[str]:
        return [status.name for status, _ in kv.query([keys.encode(h) for h in hashes])]

    def bytes_moved() -> dict[str, int]:
        kv.get_stats()
        return {
            scope: int(value)
            for (metric, (scope,)), value in stats.counters.items()
            if metric == TRANSFER_BYTES_METRIC
        }

    def pages() -> dict[str, int]:
        """KiB per page of the engine's memory and of kvcr's pool (the guard's group file,
        or the pool this worker gave kvcr)."""
        pool_pages = page_kib(file_suffix=".pool") if guard else page_kib(pool.ctypes.data)
        return {"engine": page_kib(engine.ctypes.data), "pool": pool_pages}

    commands = {
        "endpoint": lambda: channel.endpoint,
        "pages": pages,
        "compute_and_deposit": compute_and_deposit,
        "deliver": deliver,
        "query": query,
        "bytes_moved": bytes_moved,
        "startup_seconds": lambda: startup_seconds,
    }
    try:
        while True:
            command, *args = conn.recv()
            if command == "stop":
                break
            try:
                conn.send((True, commands[command](*args)))
            except Exception as exc:  # the parent shows it; the worker goes on
                conn.send((False, f"{type(exc).__name__}: {exc}"))
    finally:
        kv.close()  # waits until no transfer can touch the engine or pool memory
        channel.close()
    conn.send((True, None))


def hits(statuses: Sequence[str]) -> int:
    return sum(status == QueryStatus.HIT.name for status in statuses)
