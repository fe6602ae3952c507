"""Child program for two-process peer tests: one kvcr worker with a real NIXL agent and a
real ZMQ control channel, driven by its parent over a socketpair.

Run as ``python worker_proc.py FD NAME PORT BLOCK POOL_BLOCKS REGION_BLOCKS [SOCKET INDEX
DIGEST]``; with the last three, the worker runs over a guard service's pool group. The parent
sends pickled ``(command, *args)`` tuples and gets one reply each (an exception comes back
as ``("error", text)``). The worker's engine serves pins from its own region
(``engine_has``) and can hold pin answers back, like a busy engine.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from multiprocessing.connection import Connection

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MEM_EVENTS", "no")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
sys.path.insert(0, os.path.dirname(__file__))

from engine_sim import EngineSim, Recorder
from kvcr import KVCR
from kvcr.config import KVCRBackendConfigs, KVCRGuardConfig
from kvcr.control_channels import ZmqPeerControlChannel
from peer_world import EnginePins, IntKeys, key


def main() -> None:
    fd, name = int(sys.argv[1]), sys.argv[2]
    port, block, pool_blocks, region_blocks = map(int, sys.argv[3:7])
    conn = Connection(fd)
    engine = EngineSim(
        name=name,
        layouts=[("", block)],
        pool_blocks=pool_blocks,
        region_blocks=region_blocks,
        operation_timeout_ms=2000,
        abandon_timeout_ms=4000,
    )
    pins = EnginePins(engine)
    channel = ZmqPeerControlChannel("127.0.0.1", port, "127.0.0.1")
    recorder = Recorder()
    bindings = recorder.bindings(
        request_pin=pins.request_pin,
        poll_pin_results=pins.poll_pin_results,
        release_pin=pins.release_pin,
        cancel_pin_request=pins.cancel_pin_request,
        framework_control=channel,
        key_adapter=IntKeys(),
    )
    guard = None
    if len(sys.argv) > 7:
        guard = KVCRGuardConfig(sys.argv[7], int(sys.argv[8]), sys.argv[9])
    backends = KVCRBackendConfigs(
        framework_regions=engine.backend_configs.framework_regions,
        local_dram=None if guard else engine.backend_configs.local_dram,
    )
    kv = KVCR(engine.config, bindings, backends, guard)

    def deposit(items: list[tuple[int, int, int]]) -> dict[int, tuple[str, list[int]]]:
        for _k, element, seed in items:
            engine.write(element, seed)
        handle = kv.deposit({key(k): engine.refs(element) for k, element, _ in items})
        entries = engine.wait(kv, handle, len(items))
        return {
            k: (entries[key(k)].status.value, engine.checksum(element)) for k, element, _ in items
        }

    def deposit_nowait(items: list[tuple[int, int, int]]) -> dict[int, list[int]]:
        """Start a deposit and return at once with the checksums of what it copies."""
        for _k, element, seed in items:
            engine.write(element, seed)
        kv.deposit({key(k): engine.refs(element) for k, element, _ in items})
        return {k: engine.checksum(element) for k, element, _ in items}

    def engine_has(items: list[tuple[int, int, int]]) -> dict[int, list[int]]:
        for k, element, seed in items:
            engine.write(element, seed)
            pins.engine_has[key(k)] = element
        return {k: engine.checksum(element) for k, element, _ in items}

    def pin_state() -> dict[str, object]:
        return {
            "requests": len(pins.requests),
            "pinned": sorted(pins.pinned),
            "released": list(pins.released),
            "cancelled": list(pins.cancelled),
        }

    commands = {
        "endpoint": lambda: channel.endpoint,
        "deposit": deposit,
        "deposit_nowait": deposit_nowait,
        "engine_has": engine_has,
        "hold_pins": lambda hold: setattr(pins, "hold_back", hold),
        "pin_state": pin_state,
        "claims": lambda k: kv._runtime.index.get(key(k)).claims,
        "query": lambda ks: [status.name for status, _ in kv.query([key(k) for k in ks])],
        "get_stats": lambda: None,
        "dropped": lambda: dict(kv._runtime.peers.dropped),
    }
    try:
        while True:
            if not conn.poll(0.05):
                kv.poll_completed()
                continue
            command, *args = conn.recv()
            if command == "stop":
                kv.close()
                channel.close()
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", commands[command](*args)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        time.sleep(0)


if __name__ == "__main__":
    main()
