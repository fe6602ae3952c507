"""The guard service serves a dead worker's group inside its own trio loop: the group's
runtime is a task of the supervisor nursery, so serving starts no thread but trio's
``to_thread`` workers and the copy threads of the group's transport, and no ``trio.run``
but the service's own; handing the group back cancels that task (the service run in this
process, the workers in their own)."""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import pytest
import trio

from guard_world import BLOCK
from kvcr.guard.client import KVCRClient
from kvcr.guard.service import GuardService, ServiceConfig
from kvcr.logs import capture_events, get_logger
from kvcr.store import journal
from kvcr.transport.copier import copy_threads
from procs import SourceWorker, free_port, native_threads

pytestmark = pytest.mark.integration

SIZES = (BLOCK, 16, 32)  # block bytes, (unused) own pool blocks, engine region blocks
DIGEST = "digest-serving"


def other_threads() -> list[str]:
    """Threads of this process besides the test's own and trio's worker threads."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t is not threading.main_thread() and not t.name.startswith("Trio thread")
    )


async def states(client: KVCRClient) -> list[str]:
    return [g.state for g in await trio.to_thread.run_sync(client.status)]


async def wait_state(client: KVCRClient, index: int, state: str) -> None:
    with trio.fail_after(30):
        while (await states(client))[index] != state:
            await trio.sleep(0.02)


async def test_a_served_group_runs_in_the_services_loop_and_is_cancelled_at_hand_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[object] = []
    real_run = trio.run
    monkeypatch.setattr(trio, "run", lambda *a, **kw: (runs.append(a), real_run(*a, **kw))[1])
    (tmp_path / "pools").mkdir()
    config = ServiceConfig(
        socket_path=tmp_path / "g.sock",
        pool_dir=tmp_path / "pools",
        guard_count=1,
        pool_sizes=[8 << 20],
        compatibility_digest=DIGEST,
    )
    client = KVCRClient(config.socket_path)
    before, copiers_before = other_threads(), len(native_threads("kvcr-copy-"))
    with capture_events() as events:
        async with trio.open_nursery() as nursery:
            await nursery.start(GuardService(config, get_logger("kvcr.guard")).serve)
            guard, port = (str(config.socket_path), 0, DIGEST), free_port()
            spawn = functools.partial(SourceWorker, "dead", SIZES, port, guard=guard)
            first = await trio.to_thread.run_sync(spawn)
            try:
                await trio.to_thread.run_sync(first, "deposit", [(k, k, 70 + k) for k in range(4)])
                await trio.to_thread.run_sync(first.kill)
                await wait_state(client, 0, "serving")

                # Serving: the runtime's tasks run in this loop; nothing else was started
                # but the copy threads of its transport (the compiled core's pthreads).
                # (Threads of earlier tests' instances may linger, e.g. one that kept its
                # memory for a pull whose source died: only threads started since count.)
                assert set(other_threads()) - set(before) == set()
                assert len(native_threads("kvcr-copy-")) == copiers_before + copy_threads()
                assert runs == []

                heir = await trio.to_thread.run_sync(
                    functools.partial(SourceWorker, "heir", SIZES, port, guard=guard)
                )
                try:
                    await wait_state(client, 0, "held")
                    keys = await trio.to_thread.run_sync(heir, "soak_resident")
                    assert keys == [0, 1, 2, 3]  # handed back with every committed block
                finally:
                    await trio.to_thread.run_sync(heir.stop)
            finally:
                await trio.to_thread.run_sync(first.kill)
            nursery.cancel_scope.cancel()

    names = [e["event"] for e in events]
    assert names.index("serving") < names.index("handed_back")
    assert "group_unusable" not in names and "serving_failed" not in names
    assert set(other_threads()) <= set(before)  # every thread the service started ended


SMALL = 4096  # bytes a block: many blocks in a small pool


async def test_a_takeover_while_the_holder_commits_serves_exactly_what_its_journal_proves(
    tmp_path: Path,
) -> None:
    """The holder commits 10k blocks, then dies with deposits still on their way into the
    journal. The service serves from the index it has been following plus the tail it
    applies after the death: exactly what a replay of the journal from scratch yields,
    with the transport it opened while the group was held."""
    (tmp_path / "pools").mkdir()
    config = ServiceConfig(
        socket_path=tmp_path / "g.sock",
        pool_dir=tmp_path / "pools",
        guard_count=1,
        pool_sizes=[SMALL * 12_000],
        compatibility_digest=DIGEST,
    )
    client = KVCRClient(config.socket_path)
    service = GuardService(config, get_logger("kvcr.guard"))
    with capture_events() as events:
        async with trio.open_nursery() as nursery:
            await nursery.start(service.serve)
            guard, port = (str(config.socket_path), 0, DIGEST), free_port()
            spawn = functools.partial(SourceWorker, "dying", (SMALL, 16, 500), port, guard=guard)
            holder = await trio.to_thread.run_sync(spawn)
            try:
                for first in range(0, 10_000, 500):
                    batch = [(first + i, i, first + i) for i in range(500)]
                    await trio.to_thread.run_sync(holder, "deposit", batch)
                await trio.sleep(0.6)  # the follower has looked at least once
                for first in range(10_000, 11_500, 500):  # on their way when it dies
                    batch = [(first + i, i, first + i) for i in range(500)]
                    await trio.to_thread.run_sync(holder, "deposit_nowait", batch)
                await trio.to_thread.run_sync(holder.kill)
                await wait_state(client, 0, "serving")

                served = service.guards[0].server
                assert served is not None
                index = served.runtime.index
                mapping = service.guards[0].mapping
                offset, size = mapping.layout.journal
                view = memoryview(mapping.mmap)[offset : offset + size]
                try:
                    proven = journal.read(view).state
                finally:
                    view.release()
                assert 10_000 <= len(proven) <= 11_500
                assert {b.key: b.slots for b in index.blocks()} == {
                    k: r.values for k, r in proven.items()
                }
            finally:
                await trio.to_thread.run_sync(holder.kill)
            nursery.cancel_scope.cancel()
    names = [e["event"] for e in events]
    assert "standby_opened" in names and "takeover_failed" not in names
    (recovered,) = [e for e in events if e["event"] == "recovered" and e.get("followed")]
    assert recovered["blocks"] == len(proven)
