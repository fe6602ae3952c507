"""The engine-facing facade: ``KVCR`` and ``KVCRBindings`` (contract sections 4 and 5).

Every method validates its input on the calling (engine) thread, then either reads state the
runtime publishes or enqueues a command, and returns in microseconds. The runtime runs in
one thread of its own (``trio.run``); nothing here waits for it, except construction (until
memory is registered) and ``close``. ``poll_completed``, ``get_stats`` and ``close`` also
make the engine calls the runtime queued (``runtime/engine_calls.py``), one thread at a
time: ``get_stats`` and ``close`` wait for another engine thread's turn to end.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeGuard, cast

import attrs
import trio

from kvcr.config import (
    FrameworkControl,
    KeyAdapter,
    KVCRBackendConfigs,
    KVCRConfig,
    KVCRGuardConfig,
    SharedListenerControl,
    TelemetryStats,
    validate_pools_against_layouts,
    validate_setup,
)
from kvcr.control_channels import endpoint_host
from kvcr.errors import KVCRServiceError
from kvcr.guard.client import KVCRClient, KVCRPoolHold
from kvcr.hints import HintBook, RouterHint, parse_router_hint
from kvcr.logs import get_logger
from kvcr.policy import HOOKS as POLICY_HOOKS
from kvcr.policy import G3LRUPolicy, KVCachePolicy, LRUPolicy
from kvcr.runtime.engine_calls import EngineCalls, EngineSide
from kvcr.runtime.inbox import Inbox
from kvcr.runtime.memory import MemoryMap
from kvcr.runtime.runtime import Runtime
from kvcr.telemetry import Telemetry
from kvcr.transport.auth import cluster_key_from_env
from kvcr.transport.base import Transport
from kvcr.types import (
    BlockKey,
    CacheTier,
    KVCRStartupError,
    MemoryRef,
    OpHandle,
    OpResult,
    PinRequestId,
    PinResult,
    QueryStatus,
    ReleaseHandle,
    ReleaseResult,
)

STARTUP_TIMEOUT_S = 60.0
CLOSE_POLL_S = 0.001  # while close() waits for the runtime, it serves engine calls this often
# Bindings that are only told something: without one, nothing is queued for it.
NOTIFIED = ("inventory_sink", "capacity_needed_callback", "on_resilience_event")
MISS = (QueryStatus.MISS, None)
REMOTE = (QueryStatus.FETCHABLE, CacheTier.REMOTE_G2)


def _callable(name: str, value: object, required: bool) -> None:
    if value is None and not required:
        return
    if not callable(value):
        raise ValueError(f"KVCRBindings: {name} must be callable, got {type(value).__name__}")


def _has_methods(name: str, value: object, methods: Sequence[str]) -> None:
    if value is None:
        return
    missing = [m for m in methods if not callable(getattr(value, m, None))]
    if missing:
        raise ValueError(f"KVCRBindings: {name} lacks method(s) {missing}")


@attrs.frozen
class KVCRBindings:
    """The engine's side of the contract (section 4).

    kvcr calls ``request_pin``, ``poll_pin_results``, ``release_pin``, ``cancel_pin_request``,
    ``inventory_sink``, ``capacity_needed_callback``, ``stats_factory`` (and the stats
    object it returns) and ``on_resilience_event`` only on the engine's thread, from inside
    a call the engine makes (``poll_completed``, ``get_stats``, ``close``, construction),
    one at a time: adapters may keep their bookkeeping in plain, unlocked structures.
    ``key_adapter`` may be called from any thread; ``framework_control.send``/``recv`` and
    the ``policy`` hooks run on kvcr's runtime thread, one call at a time.
    """

    request_pin: Callable[[list[BlockKey]], PinRequestId]
    poll_pin_results: Callable[[], Iterable[tuple[PinRequestId, PinResult]]]
    release_pin: Callable[[str], bool]
    cancel_pin_request: Callable[[PinRequestId], None] | None = None
    framework_control: FrameworkControl | None = None
    key_adapter: KeyAdapter | None = None
    inventory_sink: Callable[..., None] | None = None
    capacity_needed_callback: Callable[[list[tuple[str, int]]], None] | None = None
    stats_factory: Callable[[], TelemetryStats] | None = None
    policy: KVCachePolicy | None = None
    on_resilience_event: Callable[[Exception], None] | None = None

    def __attrs_post_init__(self) -> None:
        _callable("request_pin", self.request_pin, True)
        _callable("poll_pin_results", self.poll_pin_results, True)
        _callable("release_pin", self.release_pin, True)
        for name in (
            "cancel_pin_request",
            "inventory_sink",
            "capacity_needed_callback",
            "stats_factory",
            "on_resilience_event",
        ):
            _callable(name, getattr(self, name), False)
        _has_methods("framework_control", self.framework_control, ("send", "recv"))
        _has_methods("key_adapter", self.key_adapter, ("encode", "decode"))
        _has_methods("policy", self.policy, POLICY_HOOKS)


def _adopts_listener(channel: FrameworkControl | None) -> TypeGuard[SharedListenerControl]:
    """Whether ``channel`` has the optional methods a guarded instance needs."""
    return channel is not None and all(
        callable(getattr(channel, m, None)) for m in ("adopt_listener", "control_bind_address")
    )


def _drain(queue: Any) -> Iterator[Any]:
    """Pop until empty; safe when several engine threads drain the same deque."""
    while True:
        try:
            yield queue.popleft()
        except IndexError:
            return


def _unwrap(exc: BaseException) -> BaseException:
    """The error that failed startup, not trio's group around it."""
    inner = getattr(exc, "exceptions", None)  # (Base)ExceptionGroup, or its 3.10 backport
    while isinstance(inner, tuple) and len(inner) == 1:
        exc = inner[0]
        inner = getattr(exc, "exceptions", None)
    return exc


class KVCR:
    def __init__(
        self,
        config: KVCRConfig,
        bindings: KVCRBindings,
        backend_configs: KVCRBackendConfigs,
        guard_config: KVCRGuardConfig | None = None,
    ) -> None:
        self._hold: KVCRPoolHold | None = None
        try:
            self._setup(config, bindings, backend_configs, guard_config, self._nixl_factory)
            self._start_thread()
        except KVCRStartupError:
            raise  # native work may still touch the pools: keep them mapped and held
        except BaseException:
            self._give_back_pools(activated=False)
            raise
        try:
            # A warm start's inventory reaches the engine before construction returns.
            self._serve_engine()
        except BaseException:  # an engine callback interrupted (KeyboardInterrupt, ...)
            self.close()
            raise

    @classmethod
    def _over_journal(
        cls,
        config: KVCRConfig,
        bindings: KVCRBindings,
        backend_configs: KVCRBackendConfigs,
        journal: memoryview,
        group: int,
    ) -> KVCR:
        """An instance whose pools (``backend_configs.local_dram``) belong to a pool group
        whose recovery journal is ``journal``: it starts warm from it and mirrors into it.
        The guard service serves a dead worker's group this way."""
        self = cls.__new__(cls)
        self._setup(
            config, bindings, backend_configs, None, self._nixl_factory, journal=(journal, group)
        )
        self._start_thread()
        return self

    # -- construction ----------------------------------------------------------------------

    def _setup(
        self,
        config: KVCRConfig,
        bindings: KVCRBindings,
        backend_configs: KVCRBackendConfigs,
        guard_config: KVCRGuardConfig | None,
        transport_factory: Callable[[], Transport],
        journal: tuple[memoryview, int] | None = None,
    ) -> None:
        self._closed = True  # until the runtime runs
        self._hold = None
        # A group's journal comes with a guard claim, or (the guard serving a dead worker's
        # group) with ``journal``.
        journal_view, group = journal if journal is not None else (None, None)
        validate_setup(config, backend_configs, guard_config)
        cluster_key = cluster_key_from_env()
        if not isinstance(bindings, KVCRBindings):
            raise ValueError(
                f"KVCR: bindings must be a KVCRBindings, got {type(bindings).__name__}"
            )
        if guard_config is not None:
            backend_configs = self._claim_pools(config, bindings, backend_configs, guard_config)
        self._config = config
        self._bindings = bindings
        self._backend_configs = backend_configs
        policy = bindings.policy
        if policy is None:
            policy = G3LRUPolicy() if backend_configs.g3 is not None else LRUPolicy()
        tiers = {CacheTier.LOCAL_G2} if backend_configs.local_dram is not None else set()
        if backend_configs.g3 is not None:
            tiers.add(CacheTier.G3)
        required = frozenset(getattr(policy, "required_tiers", frozenset()))
        if not required <= tiers:
            missing = sorted(t.name for t in required - tiers)
            raise ValueError(
                f"KVCRBindings: policy {type(policy).__name__} requires tier(s) {missing}, "
                "which this configuration does not have"
            )
        local = backend_configs.local_dram
        pools = local.pools if local is not None else []
        self._memory = MemoryMap(
            config.nixl_agent_name,
            config.pool_layouts,
            pools,
            backend_configs.framework_regions,
        )
        self._log = get_logger("kvcr", agent=config.nixl_agent_name)
        # OpHandles must not repeat across restarts of the process: start from the clock.
        self._op_ids = itertools.count(time.time_ns() // 1000)
        self._open_ops: dict[int, set[BlockKey]] = {}
        self._live_handles: set[int] = set()
        fw_g1 = any(r.mem_type == "VRAM" for r in backend_configs.framework_regions)
        present = frozenset(
            name
            for name in (*NOTIFIED, "cancel_pin_request")
            if getattr(bindings, name) is not None
        )
        calls = EngineCalls(present, self._log)
        answers = Inbox()
        telemetry = Telemetry(
            bindings.stats_factory if config.enable_telemetry else None,
            lambda: self._runtime.gauges(),  # noqa: PLW0108 - _runtime is not built yet
            self._log,
        )
        self._engine = EngineSide(bindings, calls, answers, self._log, also=telemetry.flush)
        self._runtime = Runtime(
            config=config,
            memory=self._memory,
            has_pools=local is not None,
            policy=policy,
            source_tier=CacheTier.FW_G1 if fw_g1 else CacheTier.FW_G2,
            callbacks=calls,
            engine_answers=answers,
            transport_factory=transport_factory,
            telemetry=telemetry,
            open_ops=self._open_ops,
            live_handles=self._live_handles,
            release_ids=itertools.count(time.time_ns() // 1000),
            bindings=bindings,
            remote_options=backend_configs.remote_fw_dram,
            op_ids=lambda: next(self._op_ids),
            log=self._log,
            journal=self._hold.journal_buffer() if self._hold is not None else journal_view,
            group=self._hold.guard_index if self._hold is not None else group,
            g3_options=backend_configs.g3,
            cluster_key=cluster_key,
        )
        self._view = self._runtime.index.view
        self._g3_view = self._runtime.g3_view
        self._outbox = self._runtime.outbox
        self._inbox = self._runtime.inbox
        self._hints = HintBook()
        self._key_adapter = bindings.key_adapter
        self._opportunistic = backend_configs.remote_fw_dram.opportunistic_query
        self._eager_connect = backend_configs.remote_fw_dram.eager_ctrl_connect
        self._greeted: set[str] = set()
        self._close_lock = threading.Lock()
        self._close_asked = False
        self._close_done = False  # an interrupted close() can be called again to finish
        self._thread: threading.Thread | None = None

    def _claim_pools(
        self,
        config: KVCRConfig,
        bindings: KVCRBindings,
        backend_configs: KVCRBackendConfigs,
        guard: KVCRGuardConfig,
    ) -> KVCRBackendConfigs:
        """Claim the pool group from the guard service, adopt its control listener, and
        return the backend configs with the group's pools as local DRAM."""
        channel = bindings.framework_control
        if not _adopts_listener(channel):
            raise ValueError(
                "KVCR: guard_config needs a framework_control that can adopt the pool group's "
                "shared control listener (adopt_listener, control_bind_address), such as "
                f"ZmqPeerControlChannel; got {type(channel).__name__}"
            )
        host, port = channel.control_bind_address()
        endpoint = getattr(channel, "endpoint", None)
        self._hold = KVCRClient(guard.kvcr_service_socket_path)._claim(
            guard.guard_index,
            config.pool_layouts,
            guard.compatibility_digest,
            (host, port),
            g3=backend_configs.g3,
            remote_fw_dram_backend=backend_configs.remote_fw_dram.backend,
            advertise=endpoint_host(endpoint) if isinstance(endpoint, str) else None,
        )
        self._hold.hand_listener_to(channel.adopt_listener)
        validate_pools_against_layouts(config.pool_layouts, self._hold.local_dram)
        return dataclasses.replace(backend_configs, local_dram=self._hold.local_dram)

    def _give_back_pools(self, *, activated: bool) -> None:
        hold, self._hold = self._hold, None
        if hold is None:
            return
        try:
            hold.release(activated=activated)
        except KVCRServiceError as exc:
            # The lease still ends when this process exits; nothing else can be done here.
            get_logger("kvcr").error("guard_release_failed", error=str(exc))

    def _nixl_factory(self) -> Transport:
        from kvcr.transport.nixl import NixlTransport

        # One agent serves the pools and the peers: the pools' backend when there are
        # pools, the peers' otherwise (both are "UCX" for host DRAM).
        local = self._backend_configs.local_dram
        backend = (
            local.backend if local is not None else self._backend_configs.remote_fw_dram.backend
        )
        return NixlTransport(self._config.nixl_agent_name, backend)

    def _start_thread(self) -> None:
        started = threading.Event()
        failure: list[BaseException] = []

        class Started:  # trio's task_status protocol, signalling this thread
            @staticmethod
            def started(value: object = None) -> None:
                started.set()

        def run() -> None:
            try:
                trio.run(functools.partial(self._runtime.serve, task_status=Started()))
            except BaseException as exc:
                failure.append(_unwrap(exc))
            finally:
                started.set()

        self._thread = threading.Thread(
            target=run, name=f"kvcr-{self._config.nixl_agent_name}", daemon=True
        )
        self._thread.start()
        if not started.wait(STARTUP_TIMEOUT_S):
            raise KVCRStartupError(
                f"KVCR: runtime of agent {self._config.nixl_agent_name!r} did not start within "
                f"{STARTUP_TIMEOUT_S:.0f} s and could not be stopped; keep its buffers alive"
            )
        if failure:
            self._thread.join()
            raise failure[0]
        self._closed = False

    @property
    def config(self) -> KVCRConfig:
        return self._config

    # -- engine-facing calls ---------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ValueError(f"{what}: this KVCR instance is closed")

    def _keys(self, what: str, keys: object) -> list[BlockKey]:
        if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
            raise ValueError(
                f"{what}: keys must be a list of bytes keys, got {type(keys).__name__}"
            )
        out = list(keys)
        for position, key in enumerate(out):
            if not isinstance(key, bytes):
                raise ValueError(f"{what}: key #{position} must be bytes, got {type(key).__name__}")
        if len(set(out)) != len(out):
            seen: set[bytes] = set()
            for position, key in enumerate(out):
                if key in seen:
                    raise ValueError(f"{what}: key #{position} ({key!r}) appears twice")
                seen.add(key)
        return out

    def _resolve(self, what: str, blocks: object) -> dict[BlockKey, tuple[int, ...]]:
        if not isinstance(blocks, Mapping):
            raise ValueError(
                f"{what}: blocks must be a mapping of key -> [MemoryRef, ...], got "
                f"{type(blocks).__name__}"
            )
        resolved: dict[BlockKey, tuple[int, ...]] = {}
        for position, (key, refs) in enumerate(blocks.items()):
            if not isinstance(key, bytes):
                raise ValueError(f"{what}: key #{position} must be bytes, got {type(key).__name__}")
            # A checked engine key: bytes are what a BlockKey is.
            resolved[cast("BlockKey", key)] = self._memory.resolve_key(what, position, key, refs)
        return resolved

    def _submit(self, command: tuple, keys: list[BlockKey]) -> OpHandle:
        handle = next(self._op_ids)
        self._open_ops[handle] = set(keys)
        self._inbox.put((command[0], handle, keys, *command[1:]))
        return handle

    def submit_hint(self, hints: Any, request_id: str | None = None) -> None:
        """Remember the router's hint for ``request_id``. A bad hint is a ValueError and
        leaves the instance and any earlier hint of the request as they were."""
        self._check_open("submit_hint")
        hint = parse_router_hint(hints)
        self._hints.submit(request_id, hint)
        self._log.debug(
            "hint_submitted", endpoint=hint.source_control_endpoint, blocks=len(hint.ordered_hashes)
        )
        endpoint = hint.source_control_endpoint
        # Only endpoints not greeted yet; a known link is re-greeted on use when needed.
        eager = self._eager_connect and self._bindings.framework_control is not None
        if eager and endpoint not in self._greeted:
            self._greeted.add(endpoint)
            self._inbox.put(("connect", endpoint))

    def discard_hint(self, request_id: str | None) -> None:
        self._check_open("discard_hint")
        self._hints.discard(request_id)

    def query(
        self, keys: Sequence[BlockKey], request_id: str | None = None
    ) -> list[tuple[QueryStatus, CacheTier | None]]:
        self._check_open("query")
        view = self._view
        answers: list[tuple[QueryStatus, CacheTier | None]] = [view.get(key, MISS) for key in keys]
        g3 = self._g3_view
        if g3:  # the file tier comes after local G2 and before a peer
            for i, answer in enumerate(answers):
                if answer is MISS:
                    answers[i] = g3.get(keys[i], MISS)
        # Without a control channel no peer can be asked: a hint covers nothing.
        hint = self._live_hint(request_id) if self._bindings.framework_control else None
        if hint is not None:
            for i, answer in enumerate(answers):
                if answer is MISS and self._hint_covers(hint, keys[i]):
                    answers[i] = REMOTE
        return answers

    def _live_hint(self, request_id: object) -> RouterHint | None:
        """The request's hint, unless it failed (remote failures arrive from the runtime)."""
        for failed in _drain(self._outbox.failed_hints):
            self._hints.mark_failed(failed)
        if not len(self._hints):
            return None
        hint = self._hints.get(request_id)
        return None if hint is None or self._hints.failed(request_id) else hint

    def _remote(
        self, request_id: object, keys: Iterable[BlockKey]
    ) -> tuple[str, object, frozenset[BlockKey]] | None:
        """Where the request's hint sends keys this instance does not hold, and which."""
        if self._bindings.framework_control is None:
            return None
        hint = self._live_hint(request_id)
        if hint is None:
            return None
        view = self._view
        covered = frozenset(k for k in keys if k not in view and self._hint_covers(hint, k))
        return (hint.source_control_endpoint, request_id, covered) if covered else None

    def _hint_covers(self, hint: RouterHint, key: BlockKey) -> bool:
        if self._opportunistic:
            return True
        if self._key_adapter is None:
            return False
        try:
            return hint.covers(self._key_adapter.decode(key))
        except (ValueError, TypeError) as exc:
            self._log.warning("key_adapter_decode_unusable", error=str(exc))
            return False

    def align_sequence(
        self, ordered_keys: Sequence[BlockKey], use_current_time: bool = False
    ) -> None:
        self._check_open("align_sequence")
        self._inbox.put(("align", list(ordered_keys), bool(use_current_time)))

    def deposit(
        self,
        blocks: Mapping[BlockKey, list[MemoryRef]],
        no_evict: bool = False,
        hints: Mapping[str, Any] | None = None,
    ) -> OpHandle:
        self._check_open("deposit")
        sources = self._resolve("deposit", blocks)
        return self._submit(("deposit", sources, bool(no_evict), hints), list(sources))

    def fetch(
        self,
        keys: Sequence[BlockKey],
        request_id: str | None = None,
        expected_layout: Sequence[tuple[str, int]] | None = None,
        hints: Mapping[str, Any] | None = None,
    ) -> OpHandle:
        self._check_open("fetch")
        key_list = self._keys("fetch", keys)
        if expected_layout is not None and [tuple(x) for x in expected_layout] != [
            tuple(x) for x in self._config.pool_layouts
        ]:
            raise ValueError(
                f"fetch: expected_layout {list(expected_layout)} differs from this instance's "
                f"pool_layouts {self._config.pool_layouts}"
            )
        return self._submit(("fetch", self._remote(request_id, key_list)), key_list)

    def deliver(
        self, blocks: Mapping[BlockKey, list[MemoryRef]], request_id: str | None = None
    ) -> OpHandle:
        self._check_open("deliver")
        destinations = self._resolve("deliver", blocks)
        refs = tuple(ref for key in destinations for ref in blocks[key])
        remote = self._remote(request_id, destinations)
        return self._submit(("deliver", destinations, refs, remote), list(destinations))

    def release(self, handles: Iterable[ReleaseHandle]) -> list[ReleaseResult]:
        self._check_open("release")
        results: list[ReleaseResult] = []
        accepted = []
        for handle in handles:
            try:
                self._live_handles.remove(handle)
            except (KeyError, TypeError):
                results.append((handle, False))
            else:
                accepted.append(handle)
                results.append((handle, True))
        if accepted:
            self._inbox.put(("release", accepted))
        return results

    def poll_completed(self) -> list[OpResult]:
        with self._engine.turn() as mine:
            if not mine:  # another engine thread is making the engine calls right now
                return []
            # Count results before making the engine calls: the runtime queues an
            # operation's inventory and resilience events (uncertain) before its entries,
            # so every result counted here has its events delivered first.
            results = self._outbox.results
            ready = len(results)
            self._engine.serve()
            return [results.popleft() for _ in range(ready)]  # only the turn's holder pops

    def abort(self, op_handle: OpHandle, keys: Sequence[BlockKey] | None = None) -> bool:
        self._check_open("abort")
        pending = self._open_ops.get(op_handle)
        if not pending:
            return False
        key_list = None if keys is None else list(keys)
        if key_list is not None and not any(k in pending for k in key_list):
            return False
        self._inbox.put(("abort", op_handle, key_list))
        return True

    def get_stats(self) -> TelemetryStats | None:
        with self._engine.turn(wait=True) as mine:
            if mine:
                self._engine.serve()
            return self._runtime.telemetry.snapshot()

    def _serve_engine(self, wait: bool = False, nested: bool = False) -> None:
        with self._engine.turn(wait, nested) as mine:
            if mine:
                self._engine.serve()

    def close(self) -> None:
        with self._close_lock:
            if self._thread is None or self._close_done:
                return
            self._closed = True
            if not self._close_asked:
                self._close_asked = True
                self._inbox.put(("close",))
            # The runtime hands pins back and reports events as it stops: on this thread,
            # even when close() is called from inside a callback.
            while self._thread.is_alive():
                self._serve_engine(wait=True, nested=True)
                self._thread.join(CLOSE_POLL_S)
            with self._engine.turn(wait=True, nested=True):
                self._engine.serve()
                self._engine.close()
            self._close_done = True
            if self._runtime.leaked:
                # A transfer may still touch the pools: keep them mapped and the lease held
                # (it ends when the process exits).
                self._log.error("pools_kept", reason="transfers in flight at close")
            elif self._hold is not None:
                # The group's control listener belongs to the group: the next holder (or the
                # guard) accepts on it once the lease is back, so this process must stop
                # accepting first. Closing the channel is idempotent for its owner.
                close_channel = getattr(self._bindings.framework_control, "close", None)
                if callable(close_channel):
                    try:
                        close_channel()
                    except Exception as exc:
                        self._log.warning("control_channel_close_failed", error=repr(exc))
                self._give_back_pools(activated=True)
            self._log.info("closed")

    def __enter__(self) -> KVCR:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
