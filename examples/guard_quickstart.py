"""A worker whose pools live in the guard service's shared memory.

    uv run python examples/guard_quickstart.py

It starts `kvcr-guard` with two pool groups in a temporary directory (in production the
service runs on its own, before any worker), then runs a KVCR over group 0: the pools come
from the service, and so does the control endpoint, which the service keeps bound when the
worker goes away. `kvcr-guard status` shows who holds what before and after.
"""

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MEM_EVENTS", "no")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvcr import KVCR, KVCRBindings, KVCRClient
from kvcr.config import KVCRBackendConfigs, KVCRConfig, KVCRGuardConfig
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.errors import KVCRSocketError
from kvcr.types import MemoryRef, RegionDescriptor

BLOCK_SIZE = 64 * 1024
DIGEST = "model-abc/tp1/bf16"  # what every worker of this deployment presents


def start_guard(directory: Path) -> tuple[subprocess.Popen, str]:
    socket_path = str(directory / "guard.sock")
    (directory / "pools").mkdir()
    guard = subprocess.Popen(
        [
            *(sys.executable, "-m", "kvcr.kvcr_service"),
            *("--socket-path", socket_path, "--pool-dir", str(directory / "pools")),
            *("--guard-count", "2", "--pool-sizes-gb", "0.0625"),  # 64 MiB per group
            *("--compatibility-digest", DIGEST, "--log-level", "WARNING"),
        ]
    )
    client = KVCRClient(socket_path)
    deadline = time.monotonic() + 30
    while True:  # the socket appears once every pool group exists
        try:
            client.status()
            return guard, socket_path
        except KVCRSocketError:
            if guard.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("kvcr-guard did not start") from None
            time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def show_status(socket_path: str) -> None:
    status = [sys.executable, "-m", "kvcr.kvcr_service", "status", "--socket-path", socket_path]
    print(subprocess.run(status, capture_output=True, text=True, check=True).stdout)


def wait_for(kv: KVCR, handle: int, nkeys: int) -> dict:
    entries: dict = {}
    deadline = time.monotonic() + 10
    while len(entries) < nkeys and time.monotonic() < deadline:
        for op, results in kv.poll_completed():
            if op == handle:
                entries.update(results)
        time.sleep(0.001)
    return entries


with tempfile.TemporaryDirectory() as tmp:
    guard, socket_path = start_guard(Path(tmp))
    try:
        engine = np.random.randint(0, 255, BLOCK_SIZE * 8, dtype=np.uint8)
        # The group's control endpoint: a fixed port per group in production; any free one here.
        channel = ZmqPeerControlChannel("127.0.0.1", free_port(), "127.0.0.1")
        kv = KVCR(
            KVCRConfig("guarded-w0", [("", BLOCK_SIZE)]),
            KVCRBindings(
                request_pin=lambda keys: 0,
                poll_pin_results=lambda: [],
                release_pin=lambda handle: True,
                framework_control=channel,  # adopts the listener the service bound
            ),
            KVCRBackendConfigs(  # no local_dram: the pools come from the guard
                framework_regions=[
                    RegionDescriptor(addr=engine.ctypes.data, size=BLOCK_SIZE, count=8)
                ],
            ),
            KVCRGuardConfig(socket_path, guard_index=0, compatibility_digest=DIGEST),
        )
        try:
            keys = [bytes([i]) for i in range(4)]
            handle = kv.deposit(
                {
                    k: [MemoryRef(end_point_name="guarded-w0", element_index=i)]
                    for i, k in enumerate(keys)
                }
            )
            entries = wait_for(kv, handle, len(keys))
            print("deposited into the guard's pool:", all(e.success for e in entries.values()))
            show_status(socket_path)
        finally:
            kv.close()  # gives the group back
            channel.close()
        show_status(socket_path)
    finally:
        guard.terminate()  # SIGTERM: the service removes its pool files and socket
        guard.wait(30)
