"""Bad kvcr input through vLLM: a tier config with a wrong type or a missing field (through
vLLM's config dict), a guard socket that is missing, a control port already in use, a
compatibility digest other than the guard's. Each engine fails to start with kvcr's error
naming the field or the resource, and leaves nothing behind: its processes end by
themselves, the port is free again, the guard lends the group to the next claimant, and
``/dev/shm`` holds nothing new (the ``engines`` fixture checks that).

The engines start side by side: each start costs ~40 s of imports and model set-up before
the tier is built, on a 2-core machine."""

from __future__ import annotations

import shutil
import socket
import uuid

import pytest
from tiny_model import BLOCK_BYTES
from vllm_harness import SHM, kvcr_tier, port_is_free

from procs import GuardProcess, free_port

pytestmark = pytest.mark.vllm


def test_bad_tier_configs_fail_the_start_with_kvcrs_error(engines, tmp_path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy_port = taken.getsockname()[1]
    cases = {
        "wrong type": (
            kvcr_tier([free_port()], secondary_g2_slots=16, operation_timeout_ms="1000"),
            "operation_timeout_ms must be a positive int, got '1000'",
        ),
        "missing field": (
            kvcr_tier(
                [free_port()],
                secondary_g2_slots=16,
                g3={"paths": [str(tmp_path / "{agent}.g3")], "backend": "POSIX"},
            ),
            "capacity_bytes_per_file",
        ),
        "missing guard socket": (
            kvcr_tier(
                [free_port()],
                kvcr_service_socket_path=str(tmp_path / "no-guard" / "guard.sock"),
                compatibility_digest="d",
            ),
            str(tmp_path / "no-guard" / "guard.sock"),
        ),
        "port in use": (kvcr_tier([busy_port]), f"tcp://127.0.0.1:{busy_port}"),
    }
    try:
        started = {
            name: engines(tier, name=name.replace(" ", "-"), gpu_blocks=24)
            for name, (tier, _) in cases.items()
        }
        for name, engine in started.items():
            engine.wait_failed()
            code, all_gone = engine.wait_exit()
            assert code == 1 and all_gone, f"{name}: exit {code}, processes left: {not all_gone}"
            expected = cases[name][1]
            assert expected in engine.log(tail=100_000), f"{name}: no {expected!r} in its log"
            port = cases[name][0]["control_ports"][0]
            if port != busy_port:
                assert port_is_free(port), f"{name}: control port {port} still bound"
    finally:
        taken.close()


def test_a_digest_other_than_the_guards_is_refused_and_the_group_stays_free(engines) -> None:
    directory = SHM / f"kvcr-test-guard-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    guard = GuardProcess(
        directory, guard_count=2, pool_sizes_gb=repr(64 * BLOCK_BYTES / 2**30), extra=()
    )
    try:
        ports = [free_port(), free_port()]
        good = kvcr_tier(
            ports, kvcr_service_socket_path=guard.socket_path, compatibility_digest=guard.digest
        )
        bad = {**good, "compatibility_digest": "another-model"}
        rank_0 = engines(good, name="rank0", rank_local=0)
        rank_1 = engines(bad, name="rank1", rank_local=1)
        rank_0.wait_ready()
        rank_1.wait_failed()
        code, all_gone = rank_1.wait_exit()
        assert code == 1 and all_gone
        assert "another-model" in rank_1.log(tail=100_000)
        # Rank 0 keeps its group; rank 1's stays free for a claimant with the right digest.
        assert [state for state, _ in guard.states()] == ["held", "idle"]
        assert port_is_free(ports[1])
        rank_0.end()
        assert guard.stop() == 0, guard.log()
    finally:
        guard.stop()
        shutil.rmtree(directory)
