"""The engine side of the benchmarks: kvcr instances (over private pools or a guard group, and
the guard service itself), the raw NIXL baselines beside them, and the engine's loop, the one
poll-until-done every script times kvcr with.

The loop: submit an operation, then call ``poll_completed`` until it has returned every entry
of the operation, pausing between polls at the engine's cadence, as a scheduler polls once
per step: ``time.sleep(cadence)`` (0.5-5 ms, 100 µs; ``YIELD``, 0: ``time.sleep(0)``, a
GIL-releasing yield) or, with ``SPIN``, no pause at all (a diagnostic: a Python loop that
holds the GIL). An operation is timed from the engine call until the poll that returned its
last entry.

Scripts import these names through ``common``, which sets NIXL's environment before nixl is
imported; nothing here imports ``common`` at run time.
"""

from __future__ import annotations

import contextlib
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from kvcr import KVCR, KVCRBindings, KVCRClient
from kvcr.config import KVCRBackendConfigs, KVCRConfig, KVCRGuardConfig, LocalDramOptions
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.errors import KVCRSocketError
from kvcr.telemetry import InMemoryStats
from kvcr.testing import Opened, open_kvcr
from kvcr.types import MemoryRef, OpEntryStatus, RegionDescriptor

try:
    from nixl_cu13._api import nixl_agent, nixl_agent_config
except ImportError:  # the meta package's shim
    from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]

__all__ = [
    "SPIN",
    "YIELD",
    "Engine",
    "GuardInstance",
    "GuardService",
    "RawNixl",
    "Worker",
    "all_success",
    "bare_agent",
    "engine_of",
    "free_port",
    "interleaved",
    "make_instance",
    "null_bindings",
    "open_instance",
    "poll_until",
    "pool_service",
    "raw_transfer",
    "runtime_thread",
    "short_switch",
    "succeeded",
]

OP_TIMEOUT_S = 60.0  # an operation not answered by then fails the benchmark
YIELD = 0.0  # cadence: time.sleep(0) between polls
SPIN = None  # cadence: no pause between polls (diagnostic tight spin)


# -- the engine loop ---------------------------------------------------------------------


def all_success(what: str, entries: Mapping[Any, Any], nkeys: int) -> None:
    bad = {k: v.status.name for k, v in entries.items() if v.status is not OpEntryStatus.SUCCESS}
    if bad or len(entries) != nkeys:
        raise RuntimeError(f"{what}: not all {nkeys} entries succeeded: {bad or len(entries)}")


def poll_until(
    kv: Any,
    handle: int,
    nkeys: int,
    cadence: float | None,
    others: dict[int, dict[Any, Any]] | None = None,
    check: Callable[[Mapping[Any, Any]], None] | None = None,
) -> dict[Any, Any]:
    """Poll ``kv`` every ``cadence`` seconds (``SPIN``: without pause) until op ``handle``
    has returned ``nkeys`` entries (an op of none: until it is answered); returns them.
    ``others``: where other ops' results go (and where earlier ones of this op are);
    ``check``: called on every batch of the op's entries as it comes in."""
    got = {} if others is None else others.pop(handle, {})
    seen = bool(got)
    poll, pause, clock = kv.poll_completed, time.sleep, time.perf_counter
    deadline = clock() + OP_TIMEOUT_S
    while True:
        for op, done in poll():
            if op == handle:
                seen = True
                if check is not None:
                    check(done)
                got.update(done)
            elif others is not None:
                others.setdefault(op, {}).update(done)
        if seen and len(got) >= nkeys:
            return got
        if cadence is not None:
            pause(cadence)
        if clock() > deadline:
            raise RuntimeError(f"op {handle}: {len(got)}/{nkeys} entries after timeout")


@attrs.define
class Engine:
    """The engine side of one instance: submits, and polls at ``cadence`` (``YIELD`` by
    default) for completions, kept by handle until asked for."""

    kv: Any
    agent: str
    cadence: float | None = YIELD
    results: dict[int, dict[Any, Any]] = attrs.field(factory=dict)

    def at(self, cadence: float | None) -> Engine:
        """The same engine polling at another cadence (results shared)."""
        return Engine(self.kv, self.agent, cadence, self.results)

    def ref(self, element: int) -> list[MemoryRef]:
        return [MemoryRef(end_point_name=self.agent, element_index=element)]

    def wait(self, handle: int, nkeys: int) -> dict[Any, Any]:
        """Poll until the op's ``nkeys`` entries are in; returns them."""
        return poll_until(self.kv, handle, nkeys, self.cadence, self.results)

    def timed(
        self,
        submit: Callable[[], int],
        nkeys: int,
        check: Callable[[Mapping[Any, Any]], None] | None = None,
    ) -> tuple[float, dict[Any, Any]]:
        """Seconds from the engine call ``submit`` until the poll that returned its last
        entry, and the entries."""
        clock = time.perf_counter
        t0 = clock()
        handle = submit()
        got = poll_until(self.kv, handle, nkeys, self.cadence, self.results, check)
        return clock() - t0, got

    def done(self, handle: int, nkeys: int, what: str) -> dict[Any, Any]:
        """:meth:`wait`, then raise unless all ``nkeys`` entries succeeded."""
        entries = self.wait(handle, nkeys)
        all_success(what, entries, nkeys)
        return entries

    def seconds(self, submit: Callable[[], int], nkeys: int, what: str) -> float:
        """:meth:`timed`, then (untimed) raise unless all ``nkeys`` entries succeeded."""
        elapsed, got = self.timed(submit, nkeys)
        all_success(what, got, nkeys)
        return elapsed

    def fill(self, n: int, batch: int = 1000) -> None:
        """Deposit keys 0..n-1 (8 bytes, big-endian), ``batch`` a call, from elements
        0..batch-1."""
        for first in range(0, n, batch):
            count = min(batch, n - first)
            blocks = {(first + i).to_bytes(8, "big"): self.ref(i) for i in range(count)}
            self.done(self.kv.deposit(blocks), count, "fill")


def succeeded(entries: Mapping[Any, Any]) -> None:
    """A ``check`` for :meth:`Engine.timed`: every entry of the batch succeeded."""
    bad = [k for k, v in entries.items() if v.status is not OpEntryStatus.SUCCESS]
    if bad:
        raise RuntimeError(f"{len(bad)} entries failed")


def short_switch(run: Callable[[], float], seconds: float = 0.0002) -> float:
    """``run`` with the GIL changing hands every ``seconds`` (default 5 ms)."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        return run()
    finally:
        sys.setswitchinterval(previous)


def interleaved(
    cases: Mapping[str, Callable[[], float]],
    reps: int,
    warm: int = 2,
    settle: float = 0.0,
    every: Mapping[str, int] | None = None,
) -> dict[str, list[float]]:
    """``warm`` + ``reps`` rounds of every case in turn; each case's ``reps`` timed results.
    ``settle``: seconds asleep after every case (untimed); ``every``: cases run only in every
    Nth round."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(warm + reps):
        for name, run in cases.items():
            if every and rep % every.get(name, 1):
                continue
            elapsed = run()
            if rep >= warm:
                times[name].append(elapsed)
            if settle:
                time.sleep(settle)
    return times


class Worker:
    """A thread of its own that runs what the engine thread hands it, while the engine thread
    polls for the result with ``time.sleep(0)``: raw NIXL done this way is the floor of any
    design that copies on a runtime thread (thread wake-up, GIL hand-overs, both cores
    busy)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="bench-worker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            run, out = job
            try:
                out.append(run())
            except BaseException as exc:
                out.append(exc)

    def timed(self, run: Callable[[], object]) -> float:
        """Seconds from the hand-over until the engine thread sees the job done."""
        out: list[object] = []
        clock, pause = time.perf_counter, time.sleep
        t0 = clock()
        self._jobs.put((run, out))
        while not out:
            pause(0)
            if clock() - t0 > OP_TIMEOUT_S:
                raise RuntimeError("worker: job not done after timeout")
        elapsed = clock() - t0
        if isinstance(out[0], BaseException):
            raise out[0]
        return elapsed

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- raw NIXL ----------------------------------------------------------------------------


def bare_agent(name: str) -> Any:
    """A bare NIXL agent with the UCX backend: the raw baseline."""
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {})
    return agent


def raw_transfer(
    agent: Any,
    op: str,
    local: Any,
    local_idx: list[int],
    remote: Any,
    remote_idx: list[int],
    notif: bytes = b"",
) -> float:
    """One prepped ``op`` ("READ" or "WRITE") of a bare agent, polled until it is no longer in
    progress; seconds from make to release."""
    t0 = time.perf_counter()
    handle = agent.make_prepped_xfer(op, local, local_idx, remote, remote_idx, notif)
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    agent.release_xfer_handle(handle)
    elapsed = time.perf_counter() - t0
    if state != "DONE":
        raise RuntimeError(f"raw NIXL {op} ended in state {state}")
    return elapsed


class RawNixl:
    """A bare NIXL agent doing the same loopback READ kvcr does (transport/nixl.py)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.agent = bare_agent(name)
        self._regs: list[Any] = []
        self._dlists: list[Any] = []

    def register(self, *bufs: np.ndarray) -> None:
        for buf in bufs:
            self._regs.append(
                self.agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
            )

    def dlists(self, buf: np.ndarray, block: int, count: int) -> tuple[Any, Any]:
        """(local, loopback) prepped descriptor lists of ``count`` blocks of ``buf``."""
        descs = [(buf.ctypes.data + i * block, block, 0) for i in range(count)]
        local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, "DRAM")
        loopback = self.agent.prep_xfer_dlist(self.name, descs, "DRAM")
        self._dlists += [local, loopback]
        return local, loopback

    def read(self, dst_local: Any, src_loopback: Any, count: int, reverse: bool = False) -> float:
        """Copy ``count`` blocks (dst <- src); seconds from make to release. NIXL merges
        descriptors adjacent on both sides into one copy; ``reverse`` (block i to block
        count - 1 - i) prevents that, as kvcr's pool slots after evictions often do."""
        idx = list(range(count))
        dst_idx = idx[::-1] if reverse else idx
        return raw_transfer(self.agent, "READ", dst_local, dst_idx, src_loopback, idx)

    def __enter__(self) -> RawNixl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.reset()

    def reset(self) -> None:
        """Release every descriptor list and registration (the agent stays)."""
        for dlist in self._dlists:
            dlist.release()
        self._dlists.clear()
        while self._regs:
            self.agent.deregister_memory(self._regs.pop())


# -- kvcr instances ----------------------------------------------------------------------


def null_bindings(stats: bool = False, **more: Any) -> KVCRBindings:
    """Bindings of an engine that pins nothing; ``more``: further KVCRBindings fields."""
    return KVCRBindings(
        request_pin=lambda keys: 0,
        poll_pin_results=lambda: [],
        release_pin=lambda handle: True,
        stats_factory=InMemoryStats if stats else None,
        **more,
    )


def open_instance(
    name: str,
    block: int,
    region: np.ndarray,
    pool: np.ndarray,
    bindings: KVCRBindings,
    telemetry: bool = False,
    **backends: Any,
) -> Opened:
    """A kvcr instance (and its runtime, for peeks) over the engine ``region`` (elements of
    ``block`` bytes) with ``pool`` as its DRAM pool; ``backends``: further
    KVCRBackendConfigs fields."""
    config = KVCRConfig(
        name,
        [("", block)],
        enable_telemetry=telemetry,
        operation_timeout_ms=20_000,
        abandon_timeout_ms=40_000,
    )
    return open_kvcr(
        config,
        bindings,
        KVCRBackendConfigs(
            framework_regions=[
                RegionDescriptor(addr=region.ctypes.data, size=block, count=region.nbytes // block)
            ],
            local_dram=LocalDramOptions([("", pool.ctypes.data, pool.nbytes)]),
            **backends,
        ),
    )


def make_instance(*args: Any, **kwargs: Any) -> KVCR:
    """:func:`open_instance`'s KVCR alone."""
    return open_instance(*args, **kwargs).kv


@contextlib.contextmanager
def engine_of(
    agent: str,
    block: int,
    region: np.ndarray,
    pool: np.ndarray,
    bindings: KVCRBindings | None = None,
    **more: Any,
) -> Iterator[Engine]:
    """An :class:`Engine` (``YIELD``) over a fresh :func:`make_instance`, closed at exit."""
    kv = make_instance(agent, block, region, pool, bindings or null_bindings(), **more)
    try:
        yield Engine(kv, agent)
    finally:
        kv.close()


def runtime_thread(agent: str) -> threading.Thread:
    """The runtime thread of the kvcr instance named ``agent``."""
    return next(t for t in threading.enumerate() if t.name == f"kvcr-{agent}")


class GuardInstance:
    """A KVCR over group 0 of a guard service (guard_config: pools, endpoint and journal),
    and its engine (``YIELD``)."""

    def __init__(self, service: GuardService, name: str, block: int, region: Any) -> None:
        self.channel = ZmqPeerControlChannel("127.0.0.1", service.port, "127.0.0.1")
        config = KVCRConfig(
            name, [("", block)], operation_timeout_ms=20_000, abandon_timeout_ms=40_000
        )
        regions = [
            RegionDescriptor(addr=region.ctypes.data, size=block, count=region.nbytes // block)
        ]
        opened = open_kvcr(
            config,
            null_bindings(framework_control=self.channel),
            KVCRBackendConfigs(framework_regions=regions),
            KVCRGuardConfig(service.socket_path, 0, service.digest),
        )
        self.kv, self.runtime = opened.kv, opened.runtime
        self.engine = Engine(self.kv, name)

    def close(self) -> None:
        self.kv.close()
        self.channel.close()


# -- the guard service ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


HOLDER = Path(__file__).resolve().parent / "recovery_holder.py"


class GuardService:
    """``kvcr-guard`` in a child process, in a fresh directory in /dev/shm (removed at
    ``stop``), its log in ``service.log``; ``start_s`` is exec until ``status`` answers,
    ``port`` a free port for group endpoints; ``options``: further command-line options of
    the service (e.g. ``--heartbeat-timeout-ms``)."""

    def __init__(
        self,
        sizes_gb: str,
        digest: str,
        groups: int = 1,
        prefix: str = "kvcr-",
        options: Sequence[str] = (),
    ) -> None:
        self.digest = digest
        self.dir = Path(tempfile.mkdtemp(dir="/dev/shm", prefix=prefix))
        self.socket_path = str(self.dir / "g.sock")
        (self.dir / "pools").mkdir()
        started = time.perf_counter()
        with open(self.dir / "service.log", "wb") as log:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "kvcr.kvcr_service", "--socket-path", self.socket_path),
                    *("--pool-dir", str(self.dir / "pools"), "--guard-count", str(groups)),
                    *("--pool-sizes-gb", sizes_gb, "--compatibility-digest", digest),
                    *("--log-level", "INFO"),
                    *options,
                ],
                stderr=log,
            )
        self.client = KVCRClient(self.socket_path)
        self.port = free_port()
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client.status()
                break
            except KVCRSocketError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("kvcr-guard did not start") from None
                time.sleep(0.002)
        self.start_s = time.perf_counter() - started

    def log_lines(self, event: str) -> list[str]:
        """Every ``event`` line the service logged so far."""
        text = (self.dir / "service.log").read_text()
        return [line for line in text.splitlines() if f" {event} " in line]

    def log_seconds(self, event: str) -> list[float]:
        """The ``seconds=`` of every ``event`` line the service logged so far."""
        return [
            float(line.split("seconds=")[1].split()[0])
            for line in self.log_lines(event)
            if "seconds=" in line
        ]

    def start_holder(self, nblocks: int, *extra: str) -> subprocess.Popen[str]:
        """A holder of ``nblocks`` blocks over group 0 (``recovery_holder.py``, with ``extra``
        arguments), once it is ready (its deposits committed)."""
        holder = subprocess.Popen(
            [
                sys.executable,
                str(HOLDER),
                self.socket_path,
                str(self.port),
                str(nblocks),
                self.digest,
                *extra,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "ready":
            raise RuntimeError("the holder did not start")
        return holder

    def kill_a_holder(self, nblocks: int, *extra: str) -> float:
        """Start a holder of ``nblocks`` blocks over group 0 (:meth:`start_holder`), SIGKILL
        it once it is ready: the seconds until ``status`` says the group is served."""
        holder = self.start_holder(nblocks, *extra)
        t0 = time.perf_counter()
        holder.kill()
        while self.state(0) != "serving":
            time.sleep(0.0005)
        elapsed = time.perf_counter() - t0
        holder.wait()
        return elapsed

    def state(self, group: int) -> str:
        return self.client.status()[group].state

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        shutil.rmtree(self.dir, ignore_errors=True)


def pool_service(pool_bytes: int, groups: int = 1, options: Sequence[str] = ()) -> GuardService:
    """A kvcr-guard with ``groups`` groups of one pool of ``pool_bytes`` (recovery, scale,
    fencing); ``options``: further command-line options of the service."""
    return GuardService(
        f"{pool_bytes / 2**30!r}", "recovery-bench", groups, prefix="kvcr-rec-", options=options
    )
