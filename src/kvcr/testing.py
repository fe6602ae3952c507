"""Running KVCR for tests: in the caller's trio loop, or threaded with its runtime at hand.

:func:`kvcr_in_loop` runs an instance's runtime inside the caller's trio loop instead of its
own thread. With the fake transport (``kvcr.transport.fake``) and
``trio.testing.MockClock``, the deadline, abort and fault paths run instantly and the same
way every time. The engine-facing methods behave exactly as in a threaded instance; only
``close`` is replaced by leaving the context. As with a threaded instance, engine callbacks
(pins, inventory, resilience events) are made only inside ``poll_completed`` (and
``get_stats``): a test's engine must poll.

:func:`open_kvcr` is ``KVCR(...)``, but also hands back the runtime, whose state
(``index``, ``peers``, ``audit()``) tests inspect. Read it only while the runtime is quiet:
it belongs to the runtime's thread.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import trio

from kvcr.api import KVCR
from kvcr.bindings import KVCRBindings
from kvcr.config import KVCRBackendConfigs, KVCRConfig, KVCRGuardConfig, validate_setup
from kvcr.instance import Instance
from kvcr.logs import get_logger
from kvcr.runtime.build import build
from kvcr.runtime.commands import Close
from kvcr.runtime.runtime import Runtime
from kvcr.transport.base import Transport

__all__ = ["Opened", "kvcr_in_loop", "open_kvcr"]


@attrs.frozen(eq=False)
class Opened:
    kv: KVCR
    runtime: Runtime


@asynccontextmanager
async def kvcr_in_loop(
    config: KVCRConfig,
    bindings: KVCRBindings,
    backend_configs: KVCRBackendConfigs,
    transport_factory: Callable[[], Transport],
) -> AsyncIterator[Opened]:
    validate_setup(config, backend_configs, None)
    log = get_logger("kvcr", agent=config.nixl_agent_name)
    built = build(config, backend_configs, transport_factory, log=log, bindings=bindings)
    instance = Instance(built, bindings, backend_configs)
    kv = KVCR.over(instance)
    runtime: Runtime = built.runtime
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.serve)
        try:
            yield Opened(kv, runtime)
        finally:
            kv.close()  # marks the facade closed; the runtime is stopped here
            built.shared.commands.put(Close())
            # As a threaded close does: the engine calls of the stopping runtime (pin
            # releases, last events) are made here, in the engine's place, every millisecond.
            while not runtime.closed.is_set():
                instance.serve_engine(wait=True)
                with trio.move_on_after(0.001):
                    await runtime.closed.wait()
            with instance.engine.turn(wait=True):
                instance.engine.serve()
                instance.engine.close()
            # Nothing can post to them any more (the instance is closed): give their eventfds
            # back now rather than at the next full garbage collection.
            built.shared.commands.close()
            built.shared.answers.close()


def open_kvcr(
    config: KVCRConfig,
    bindings: KVCRBindings,
    backend_configs: KVCRBackendConfigs,
    guard_config: KVCRGuardConfig | None = None,
) -> Opened:
    """A threaded instance, as ``KVCR(...)`` builds it, and its runtime."""
    instance = Instance.open(config, bindings, backend_configs, guard_config)
    kv = KVCR.over(instance)
    try:
        instance.serve_engine()  # a warm start's inventory, as the constructor delivers it
    except BaseException:
        kv.close()
        raise
    return Opened(kv, instance.runtime)
