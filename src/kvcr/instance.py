"""One KVCR instance behind the facade: its pools (given, or claimed from the guard
service), its runtime (assembled by ``runtime/build.py``) in a thread of its own, and the
orderly close that hands pins, then pools, back.

The facade (``api.py``) validates engine calls and talks to the runtime only through what
this holds: ``built.shared``, the engine side, the memory map.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import TypeGuard

import trio

from kvcr.bindings import KVCRBindings
from kvcr.config import (
    KVCRBackendConfigs,
    KVCRConfig,
    KVCRGuardConfig,
    for_instance,
    validate_pools_against_layouts,
    validate_setup,
)
from kvcr.control_channels import endpoint_host
from kvcr.engine_protocols import FrameworkControl, SharedListenerControl
from kvcr.errors import KVCRServiceError
from kvcr.guard.client import KVCRClient, KVCRPoolHold
from kvcr.logs import get_logger
from kvcr.runtime.build import Built, build
from kvcr.runtime.commands import Close
from kvcr.runtime.context import Journal
from kvcr.runtime.engine_calls import EngineSide
from kvcr.transport.base import Transport
from kvcr.transport.factory import nixl_factory
from kvcr.types import KVCRStartupError

STARTUP_TIMEOUT_S = 60.0
CLOSE_POLL_S = 0.001  # while close() waits for the runtime, it serves engine calls this often


def adopts_listener(channel: FrameworkControl | None) -> TypeGuard[SharedListenerControl]:
    """Whether ``channel`` has the optional methods a guarded instance needs."""
    return channel is not None and all(
        callable(getattr(channel, m, None)) for m in ("adopt_listener", "control_bind_address")
    )


def unwrap(exc: BaseException) -> BaseException:
    """The error that failed startup, not trio's group around it."""
    inner = getattr(exc, "exceptions", None)  # (Base)ExceptionGroup, or its 3.10 backport
    while isinstance(inner, tuple) and len(inner) == 1:
        exc = inner[0]
        inner = getattr(exc, "exceptions", None)
    return exc


class Instance:
    def __init__(
        self,
        built: Built,
        bindings: KVCRBindings,
        backend_configs: KVCRBackendConfigs,
        hold: KVCRPoolHold | None = None,
    ) -> None:
        assert built.engine is not None, "an engine-facing instance has bindings"
        self.built = built
        self.runtime = built.runtime
        self.context = built.context
        self.shared = built.shared
        self.engine: EngineSide = built.engine
        self.config = built.context.config
        self.bindings = bindings
        self.backend_configs = backend_configs  # with the guard's pools, when claimed
        self.log = built.context.log
        self.hold = hold
        self.thread: threading.Thread | None = None  # None: run by the caller (kvcr.testing)
        self._close_lock = threading.Lock()
        self._close_asked = False
        self._close_done = False  # an interrupted close() can be called again to finish

    @classmethod
    def open(
        cls,
        config: KVCRConfig,
        bindings: KVCRBindings,
        backend_configs: KVCRBackendConfigs,
        guard_config: KVCRGuardConfig | None,
        transport_factory: Callable[[], Transport] | None = None,
    ) -> Instance:
        """Validate, claim the guard's pools if configured, build, and run the runtime in a
        thread of its own; returns once memory is registered."""
        validate_setup(config, backend_configs, guard_config)
        # Before the claim: the guard ties the group to the files this instance will open.
        guard_index = guard_config.guard_index if guard_config is not None else None
        backend_configs = for_instance(config, backend_configs, guard_index)
        if not isinstance(bindings, KVCRBindings):
            raise ValueError(
                f"KVCR: bindings must be a KVCRBindings, got {type(bindings).__name__}"
            )
        hold = None
        journal = None
        started = False
        try:
            if guard_config is not None:
                hold, backend_configs = claim_pools(config, bindings, backend_configs, guard_config)
                buffer, group = hold.journal_buffer(), hold.guard_index
                assert buffer is not None and group is not None  # a granted hold has both
                journal = Journal(buffer, group, tie=hold.tie)
            log = get_logger("kvcr", agent=config.nixl_agent_name)
            factory = transport_factory or nixl_factory(config, backend_configs)
            built = build(
                config, backend_configs, factory, log=log, bindings=bindings, journal=journal
            )
            instance = cls(built, bindings, backend_configs, hold)
            started = True  # the runtime owns the journal from here on, even if it fails
            instance.start_thread()
        except KVCRStartupError:
            raise  # native work may still touch the pools: keep them mapped and held
        except BaseException:
            if journal is not None and not started:
                journal.buffer.release()  # a live view would keep the group mapped
            give_back(hold, activated=False)
            raise
        return instance

    def start_thread(self) -> None:
        started = threading.Event()
        failure: list[BaseException] = []

        class Started:  # trio's task_status protocol, signalling this thread
            @staticmethod
            def started(value: object = None) -> None:
                started.set()

        def run() -> None:
            try:
                trio.run(functools.partial(self.runtime.serve, task_status=Started()))
            except BaseException as exc:
                failure.append(unwrap(exc))
            finally:
                started.set()

        name = self.config.nixl_agent_name
        self.thread = threading.Thread(target=run, name=f"kvcr-{name}", daemon=True)
        self.thread.start()
        if not started.wait(STARTUP_TIMEOUT_S):
            raise KVCRStartupError(
                f"KVCR: runtime of agent {name!r} did not start within "
                f"{STARTUP_TIMEOUT_S:.0f} s and could not be stopped; keep its buffers alive"
            )
        if failure:
            self.thread.join()
            raise failure[0]

    def serve_engine(self, wait: bool = False, nested: bool = False) -> None:
        """Make the engine calls the runtime queued, if no other engine thread is."""
        with self.engine.turn(wait, nested) as mine:
            if mine:
                self.engine.serve()

    def close(self) -> None:
        """Stop the runtime (serving its last engine calls on this thread meanwhile, even
        from inside a callback), then hand the pools back. Idempotent."""
        with self._close_lock:
            if self.thread is None or self._close_done:
                return
            if not self._close_asked:
                self._close_asked = True
                self.shared.commands.put(Close())
            while self.thread.is_alive():
                self.serve_engine(wait=True, nested=True)
                self.thread.join(CLOSE_POLL_S)
            with self.engine.turn(wait=True, nested=True):
                self.engine.serve()
                self.engine.close()
            self._close_done = True
            self.release_pools()
            self.log.info("closed")

    def release_pools(self) -> None:
        if self.runtime.leaked:
            # A transfer may still touch the pools: keep them mapped and the lease held
            # (it ends when the process exits).
            self.log.error("pools_kept", reason="transfers in flight at close")
            return
        if self.hold is None:
            return
        # The group's control listener belongs to the group: the next holder (or the guard)
        # accepts on it once the lease is back, so this process must stop accepting first.
        # Closing the channel is idempotent for its owner.
        close_channel = getattr(self.bindings.framework_control, "close", None)
        if callable(close_channel):
            try:
                close_channel()
            except Exception as exc:
                self.log.warning("control_channel_close_failed", error=repr(exc))
        hold, self.hold = self.hold, None
        give_back(hold, activated=True)


def claim_pools(
    config: KVCRConfig,
    bindings: KVCRBindings,
    backend_configs: KVCRBackendConfigs,
    guard: KVCRGuardConfig,
) -> tuple[KVCRPoolHold, KVCRBackendConfigs]:
    """Claim the pool group from the guard service, adopt its control listener, and return
    the hold and the backend configs with the group's pools as local DRAM."""
    channel = bindings.framework_control
    if not adopts_listener(channel):
        raise ValueError(
            "KVCR: guard_config needs a framework_control that can adopt the pool group's "
            "shared control listener (adopt_listener, control_bind_address), such as "
            f"ZmqPeerControlChannel; got {type(channel).__name__}"
        )
    host, port = channel.control_bind_address()
    endpoint = getattr(channel, "endpoint", None)
    hold = KVCRClient(guard.kvcr_service_socket_path).claim_advertised(
        guard.guard_index,
        config.pool_layouts,
        guard.compatibility_digest,
        (host, port),
        g3=backend_configs.g3,
        remote_fw_dram_backend=backend_configs.remote_fw_dram.backend,
        advertise=endpoint_host(endpoint) if isinstance(endpoint, str) else None,
    )
    try:
        hold.hand_listener_to(channel.adopt_listener)
        validate_pools_against_layouts(config.pool_layouts, hold.local_dram)
    except BaseException:
        give_back(hold, activated=False)
        raise
    return hold, dataclasses.replace(backend_configs, local_dram=hold.local_dram)


def give_back(hold: KVCRPoolHold | None, *, activated: bool) -> None:
    if hold is None:
        return
    try:
        hold.release(activated=activated)
    except KVCRServiceError as exc:
        # The lease still ends when this process exits; nothing else can be done here.
        get_logger("kvcr").error("guard_release_failed", error=str(exc))
