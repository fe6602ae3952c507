"""Two or more KVCR instances in one trio loop, joined by the fake fabric and control hub.

For deterministic peer tests under MockClock: each worker is an ``EngineSim`` with its own
fake NIXL agent and control endpoint; the engine's pin bindings serve keys from the
engine's own region (``engine_has``) and can be told to hold answers back. Each worker's
engine runs a scheduler loop that polls its KVCR every ``STEP_S`` (``step``: by default it
keeps the completions for ``await_op``), so pins are served and events delivered on the
engine's side, as in a real engine; on leaving ``running`` every callback is checked to
have come inside one of those calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import trio

from engine_sim import EngineSim, Recorder, router_hint
from kvcr.config import G3Options, KVCRBackendConfigs, RemoteFWDramOptions
from kvcr.telemetry import InMemoryStats
from kvcr.testing import kvcr_in_loop
from kvcr.transport.fake import FakeControlHub, FakeFabric, FakeTransport
from kvcr.types import BlockKey, MemoryRef

STEP_S = 0.002  # the engine's scheduler cadence (mock time)


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(8, "big"))


class IntKeys:
    def encode(self, framework_key: int) -> BlockKey:
        return key(framework_key)

    def decode(self, k: BlockKey) -> int:
        return int.from_bytes(k, "big")


class EnginePins:
    """The engine side of request_pin / poll_pin_results / release_pin, in plain dicts and
    lists without locks, as an adapter keeps them."""

    def __init__(self, engine: EngineSim) -> None:
        self.engine = engine
        self.engine_has: dict[BlockKey, int] = {}  # key -> element of the engine's regions
        self.hold_back = False
        self.release_refusals = 0
        self.requests: dict[int, list[BlockKey]] = {}
        self.answered: set[int] = set()
        self.cancelled: list[int] = []
        self.pinned: set[str] = set()
        self.released: list[str] = []
        self._next = 1

    def request_pin(self, keys: list[BlockKey]) -> int:
        request = self._next
        self._next += 1
        self.requests[request] = list(keys)
        return request

    def poll_pin_results(self) -> list[tuple[int, Any]]:
        if self.hold_back:
            return []
        out = []
        for request, keys in self.requests.items():
            if request in self.answered or request in self.cancelled:
                continue
            self.answered.add(request)
            refs = {
                k: self.engine.refs(self.engine_has[k]) if k in self.engine_has else None
                for k in keys
            }
            if all(v is None for v in refs.values()):
                out.append((request, None))
                continue
            handle = f"pin-{request}"
            self.pinned.add(handle)
            out.append((request, (handle, refs)))
        return out

    def release_pin(self, handle: str) -> bool:
        if self.release_refusals:
            self.release_refusals -= 1
            return False
        self.pinned.discard(handle)
        self.released.append(handle)
        return True

    def cancel_pin_request(self, request: int) -> None:
        self.cancelled.append(request)


class Worker:
    def __init__(
        self,
        world: World,
        name: str,
        eager: bool = True,
        pools: bool = True,
        g3: G3Options | None = None,  # real files, through NIXL's POSIX backend
        **engine_kw: Any,
    ) -> None:
        self.world = world
        self.pools = pools
        self.g3 = g3
        engine_kw.setdefault("operation_timeout_ms", 1000)
        engine_kw.setdefault("abandon_timeout_ms", 3000)
        self.engine = EngineSim(name=name, **engine_kw)
        self.endpoint = f"tcp://{name}:5555"
        self.recorder = Recorder()
        self.pins = EnginePins(self.engine)
        self.eager = eager
        self.kv: Any = None
        self.runtime: Any = None  # the in-loop runtime, for tests that inspect its state
        self.transport: FakeTransport | None = None
        self.step: Callable[[], None] = lambda: self.engine.absorb(self.kv)

    def bindings(self) -> Any:
        return self.recorder.bindings(
            request_pin=self.pins.request_pin,
            poll_pin_results=self.pins.poll_pin_results,
            release_pin=self.pins.release_pin,
            cancel_pin_request=self.pins.cancel_pin_request,
            framework_control=self.world.hub.channel(self.endpoint),
            key_adapter=IntKeys(),
            stats_factory=InMemoryStats,
        )

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Any]:
        backends = KVCRBackendConfigs(
            framework_regions=self.engine.backend_configs.framework_regions,
            local_dram=self.engine.backend_configs.local_dram if self.pools else None,
            remote_fw_dram=RemoteFWDramOptions(eager_ctrl_connect=self.eager),
            g3=self.g3,
        )

        def transport() -> FakeTransport:
            self.transport = FakeTransport(self.engine.name, trio.current_time, self.world.fabric)
            return self.transport

        async with kvcr_in_loop(self.engine.config, self.bindings(), backends, transport) as opened:
            self.kv = kv = opened.kv
            self.runtime = opened.runtime
            async with trio.open_nursery() as scheduler:
                scheduler.start_soon(self._schedule)
                yield kv
                scheduler.cancel_scope.cancel()
        assert self.recorder.threads.wrong == [], self.recorder.threads.wrong

    async def _schedule(self) -> None:
        """The engine's scheduler loop: one poll of KVCR per step."""
        while True:
            self.step()
            await trio.sleep(STEP_S)

    def refs(self, element: int) -> list[MemoryRef]:
        return self.engine.refs(element)

    def hint(self, source: Worker, keys: list[int]) -> dict:
        return router_hint(source.endpoint, keys)

    async def deposit(self, pairs: list[tuple[int, int]]) -> dict:
        handle = self.kv.deposit({key(k): self.refs(e) for k, e in pairs})
        return self.engine.statuses(await self.engine.await_op(self.kv, handle, len(pairs)))

    async def deliver(self, pairs: list[tuple[int, int]], request_id: str = "r") -> dict:
        handle = self.kv.deliver({key(k): self.refs(e) for k, e in pairs}, request_id=request_id)
        return await self.engine.await_op(self.kv, handle, len(pairs))

    def events(self) -> list[tuple[int, str]]:
        return [(e.op_handle, e.state) for e in self.recorder.resilience]


class World:
    def __init__(self) -> None:
        self.fabric = FakeFabric()
        self.hub = FakeControlHub()

    def sent(self, kind: str) -> list[Any]:
        from kvcr.transport import messages
        from kvcr.transport.auth import unsealed

        out = []
        for _endpoint, raw in self.hub.sent:
            message = messages.decode(unsealed(raw))
            if kind == message.TYPE:
                out.append(message)
        return out


def telemetry_pair() -> tuple[World, Worker, Worker]:
    """A world with a source ``a`` and a destination ``b``, both recording telemetry."""
    world = World()
    return (
        world,
        Worker(world, "a", enable_telemetry=True),
        Worker(world, "b", enable_telemetry=True),
    )


async def share(source: Worker, dest: Worker, keys: list[int], request_id: str = "r") -> None:
    """``source`` computed and deposited ``keys`` (element k holds key k), the router sent
    ``dest`` a hint for them, and the link between the two is set up."""
    for k in keys:
        source.engine.write(k, seed=k)
    await source.deposit([(k, k) for k in keys])
    dest.kv.submit_hint(dest.hint(source, keys), request_id=request_id)
    await trio.sleep(0.01)


async def greet_and_lose(world: World, dest: Worker, name: str = "a") -> None:
    """A source at ``name``'s endpoint is hinted to ``dest``, greeted, and then its process
    is gone (closed); a successor may start at the same endpoint next."""
    source = Worker(world, name)
    async with source.running():
        dest.kv.submit_hint(dest.hint(source, [0]), request_id="r")
        await trio.sleep(0.01)
