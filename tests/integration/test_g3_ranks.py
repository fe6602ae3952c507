"""G3 on every data-parallel rank: one ``G3Options`` for several live instances, as vLLM's
adapter passes it to each local rank, through ``KVCR(...)`` on real NIXL and real files.
``{agent}`` (and, over a guard, ``{guard_index}``) gives each instance its own file, in
which it spills and from which it serves byte-exact; a path without them is refused to the
second instance, with a message that names them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_sim import EngineSim, Recorder
from kvcr import KVCR, KVCRGuardProtocolError
from kvcr.config import G3Options, KVCRGuardConfig
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.g3.files import G3FileError
from kvcr.logs import capture_events
from kvcr.types import CacheTier, QueryStatus
from procs import GuardProcess, free_port

pytestmark = pytest.mark.integration

BLOCK = 64 * 1024
POOL_BLOCKS = 4
HIT = (QueryStatus.HIT, CacheTier.LOCAL_G2)
IN_G3 = (QueryStatus.FETCHABLE, CacheTier.G3)


def key(i: int) -> bytes:
    return b"blk-%04d" % i


def options(*paths: Path) -> G3Options:
    return G3Options(paths=paths, capacity_bytes_per_file=8 * BLOCK)


class Rank:
    """One data-parallel rank's KVCR: its own pools, or a guard's pool group ``index``
    (whose holders all bind its control ``port``)."""

    def __init__(
        self,
        name: str,
        g3: G3Options,
        guard: GuardProcess | None = None,
        index: int = 0,
        port: int | None = None,
    ) -> None:
        self.engine = EngineSim(name=name, layouts=[("", BLOCK)], pool_blocks=POOL_BLOCKS)
        self.channel = None
        backends = dataclasses.replace(self.engine.backend_configs, g3=g3)
        guard_config = None
        bindings = Recorder().bindings()
        if guard is not None:
            self.channel = ZmqPeerControlChannel("127.0.0.1", port or free_port(), "127.0.0.1")
            backends = dataclasses.replace(backends, local_dram=None)
            guard_config = KVCRGuardConfig(guard.socket_path, index, guard.digest)
            bindings = Recorder().bindings(framework_control=self.channel)
        try:
            self.kv = KVCR(self.engine.config, bindings, backends, guard_config)
        except BaseException:
            if self.channel is not None:
                self.channel.close()
            raise
        self.sums: dict[int, list[int]] = {}

    def spill_and_serve(self, seed: int) -> None:
        """Twice the pool's blocks: the first half spills to G3, and comes back byte-exact."""
        ids = range(2 * POOL_BLOCKS)
        for i in ids:
            self.engine.write(i, seed=seed + i)
            self.sums[i] = self.engine.checksum(i)
        for batch in (ids[:POOL_BLOCKS], ids[POOL_BLOCKS:]):
            handle = self.kv.deposit({key(i): self.engine.refs(i) for i in batch})
            result = self.engine.statuses(self.engine.wait(self.kv, handle, len(batch)))
            assert set(result.values()) == {"SUCCESS"}
        assert self.kv.query([key(i) for i in ids]) == [IN_G3] * 4 + [HIT] * 4
        self.serve_from_g3()

    def serve_from_g3(self) -> None:
        spilled = range(POOL_BLOCKS)
        assert self.kv.query([key(i) for i in spilled]) == [IN_G3] * len(spilled)
        for i in spilled:
            self.engine.clear(20 + i)
        handle = self.kv.deliver({key(i): self.engine.refs(20 + i) for i in spilled})
        result = self.engine.statuses(self.engine.wait(self.kv, handle, len(spilled)))
        assert set(result.values()) == {"SUCCESS"}
        assert [self.engine.checksum(20 + i) for i in spilled] == [self.sums[i] for i in spilled]

    def close(self) -> None:
        self.kv.close()
        if self.channel is not None:
            self.channel.close()


@pytest.fixture
def ranks() -> Iterator[list[Rank]]:
    opened: list[Rank] = []
    yield opened
    for rank in opened:
        rank.close()


def g3_paths_events(events: list[dict]) -> dict[str, dict]:
    return {e["agent"]: e for e in events if e["event"] == "g3_paths"}


def test_two_ranks_with_one_templated_path_each_spill_to_their_own_file(tmp_path, ranks) -> None:
    template = tmp_path / "g3" / "kv-{agent}.bin"
    shared = options(template)
    with capture_events() as events:
        ranks.append(Rank("dp0", shared))
        ranks.append(Rank("vllm/dp 1", shared))  # made safe for a file name

    files = [tmp_path / "g3" / "kv-dp0.bin", tmp_path / "g3" / "kv-vllm_dp_1.bin"]
    assert sorted((tmp_path / "g3").iterdir()) == files
    logged = g3_paths_events(events)
    assert logged["dp0"]["templates"] == [str(template)]
    assert logged["dp0"]["files"] == [str(files[0])]
    assert logged["vllm/dp 1"]["files"] == [str(files[1])]

    ranks[0].spill_and_serve(seed=100)
    ranks[1].spill_and_serve(seed=200)  # the same keys, other bytes, in the other file
    ranks[0].serve_from_g3()  # still its own bytes: no slot of its file was overwritten


def test_a_plain_path_shared_by_two_live_ranks_refuses_the_second(tmp_path, ranks) -> None:
    shared = options(tmp_path / "g3.bin")
    ranks.append(Rank("dp0", shared))

    with pytest.raises(G3FileError) as caught:
        Rank("dp1", shared)

    text = caught.value.strerror
    assert text.startswith(f"G3 file {tmp_path / 'g3.bin'}: in use by another live KVCR instance")
    assert "put {agent} (the NIXL agent name) or {guard_index}" in text
    example = tmp_path / "g3-{agent}.bin"
    assert f"in paths[0] so that each rank gets its own file, e.g. '{example}'" in text
    # The refused rank let go of everything it had taken; the first one works on, and a
    # templated path opens beside it.
    ranks.append(Rank("dp1", options(tmp_path / "g3-{agent}.bin")))
    ranks[0].spill_and_serve(seed=100)
    ranks[1].spill_and_serve(seed=200)


@pytest.fixture
def guard(tmp_path: Path) -> Iterator[GuardProcess]:
    (tmp_path / "svc").mkdir()
    service = GuardProcess(
        tmp_path / "svc", guard_count=2, pool_sizes_gb=str(POOL_BLOCKS * BLOCK / 2**30)
    )
    yield service
    assert service.stop() == 0, service.log()


def test_over_a_guard_each_rank_gets_the_file_of_its_pool_group(tmp_path, guard, ranks) -> None:
    template = tmp_path / "g3" / "group-{guard_index}.bin"
    shared = options(template)
    with capture_events() as events:
        ranks.append(Rank("dp0", shared, guard, index=1))
        ranks.append(Rank("dp1", shared, guard, index=0))

    files = [tmp_path / "g3" / "group-0.bin", tmp_path / "g3" / "group-1.bin"]
    assert sorted((tmp_path / "g3").iterdir()) == files
    logged = g3_paths_events(events)
    assert logged["dp0"]["files"] == [str(files[1])]
    assert logged["dp1"]["files"] == [str(files[0])]

    ranks[0].spill_and_serve(seed=100)
    ranks[1].spill_and_serve(seed=200)
    ranks[0].serve_from_g3()


def test_the_next_holder_of_a_group_expands_to_the_same_file_and_keeps_its_blocks(
    tmp_path, guard, ranks
) -> None:
    shared = options(tmp_path / "g3" / "group-{guard_index}.bin")
    port = free_port()
    first = Rank("dp0", shared, guard, index=1, port=port)
    first.spill_and_serve(seed=100)
    first.close()

    # The group's G3 files are the expanded ones: a holder whose path expands to another
    # file would start cold from a journal that names slots of the old one, so the guard
    # refuses it (which is why {guard_index}, not {agent}, fits a guard).
    with pytest.raises(KVCRGuardProtocolError, match=r"\(g3_mismatch\).*group-1\.bin"):
        Rank("dp0-restarted", options(tmp_path / "g3" / "{agent}.bin"), guard, 1, port)
    assert sorted((tmp_path / "g3").iterdir()) == [tmp_path / "g3" / "group-1.bin"]

    heir = Rank("dp0-restarted", shared, guard, index=1, port=port)
    ranks.append(heir)
    heir.sums = first.sums
    heir.serve_from_g3()
