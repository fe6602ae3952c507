"""A kvcr worker in the test process whose pools are a guard service's pool group."""

from __future__ import annotations

import os

from engine_sim import EngineSim, Recorder, router_hint
from kvcr.config import KVCRBackendConfigs, KVCRGuardConfig
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.testing import open_kvcr
from peer_world import EnginePins, IntKeys, key
from procs import GuardProcess, SourceWorker, free_port

BLOCK = 64 * 1024


class GuardedWorker:
    """A kvcr worker in this process whose pools are group ``index`` of the service."""

    def __init__(
        self, guard: GuardProcess, index: int, channel: object = None, port: int | None = None
    ) -> None:
        self.engine = EngineSim(
            name=f"guarded-{index}-{os.getpid()}",
            layouts=[("", BLOCK)],
            pool_blocks=1,
            region_blocks=32,
            operation_timeout_ms=2000,
            abandon_timeout_ms=4000,
        )
        self.channel = channel or ZmqPeerControlChannel(
            "127.0.0.1", port or free_port(), "127.0.0.1"
        )
        pins = EnginePins(self.engine)
        self.recorder = Recorder()
        opened = open_kvcr(
            self.engine.config,
            self.recorder.bindings(
                framework_control=self.channel,
                key_adapter=IntKeys(),
                request_pin=pins.request_pin,
                poll_pin_results=pins.poll_pin_results,
                release_pin=pins.release_pin,
            ),
            KVCRBackendConfigs(framework_regions=self.engine.backend_configs.framework_regions),
            KVCRGuardConfig(guard.socket_path, index, guard.digest),
        )
        self.kv, self.runtime = opened.kv, opened.runtime

    def pull(self, source: SourceWorker, pairs: list[tuple[int, int]], request: str) -> dict:
        return self.engine.statuses(
            self.engine.wait(self.kv, self.start_pull(source, pairs, request), len(pairs))
        )

    def start_pull(self, source: SourceWorker, pairs: list[tuple[int, int]], request: str) -> int:
        self.kv.submit_hint(router_hint(source.endpoint, [k for k, _ in pairs]), request)
        return self.kv.deliver({key(k): self.engine.refs(e) for k, e in pairs}, request)

    def deliver_local(self, pairs: list[tuple[int, int]]) -> dict:
        handle = self.kv.deliver({key(k): self.engine.refs(e) for k, e in pairs})
        return self.engine.statuses(self.engine.wait(self.kv, handle, len(pairs)))

    def close(self) -> None:
        self.kv.close()
        self.channel.close()
