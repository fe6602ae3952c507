"""Run a KVCR instance's runtime inside the caller's trio loop instead of its own thread.

For deterministic tests: with the fake transport and ``trio.testing.MockClock`` the
deadline, abort and fault paths run instantly and the same way every time. The engine-facing
methods behave exactly as in a threaded instance; only ``close`` is replaced by leaving the
context. As with a threaded instance, engine callbacks (pins, inventory, resilience events)
are made only inside ``poll_completed`` (and ``get_stats``): a test's engine must poll.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from kvcr.api import KVCR, KVCRBindings
from kvcr.config import KVCRBackendConfigs, KVCRConfig
from kvcr.transport.base import Transport


@asynccontextmanager
async def kvcr_in_loop(
    config: KVCRConfig,
    bindings: KVCRBindings,
    backend_configs: KVCRBackendConfigs,
    transport_factory: Callable[[], Transport],
) -> AsyncIterator[KVCR]:
    kv = KVCR.__new__(KVCR)
    kv._setup(config, bindings, backend_configs, None, transport_factory)
    async with trio.open_nursery() as nursery:
        await nursery.start(kv._runtime.serve)
        kv._closed = False
        try:
            yield kv
        finally:
            kv._closed = True
            kv._inbox.put(("close",))
            # As close() does: the engine calls of the stopping runtime (pin releases,
            # last events) are made here, in the engine's place, every millisecond.
            while not kv._runtime.closed.is_set():
                kv._serve_engine(wait=True)
                with trio.move_on_after(0.001):
                    await kv._runtime.closed.wait()
            # Nothing can post to them any more (the instance is closed): give their eventfds
            # back now rather than at the next full garbage collection.
            with kv._engine.turn(wait=True):
                kv._engine.serve()
                kv._engine.close()
            kv._runtime.inbox.close()
