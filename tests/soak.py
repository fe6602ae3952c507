"""Soak: a guard service and three workers in child processes run random steps for a while,
with the whole system's accounting checked after every step.

    uv run python tests/soak.py --minutes 5 --seed 1     # or: uv run nox -s soak -- --minutes 5

Everything is real: the guard service (``python -m kvcr.kvcr_service``, with
``--heartbeat-timeout-ms``) owns three pool groups in shared memory, each worker
(``worker_proc.py``) holds one of them and moves blocks through real NIXL/UCX and real ZMQ on
127.0.0.1, and a kill is a real SIGKILL, after which the guard serves the dead worker's
blocks on its endpoint until a replacement claims the group and starts warm from the group's
journal. A worker stopped with SIGSTOP for longer than the heartbeat timeout is fenced (the
guard SIGKILLs it) and then served the same way; a shorter pause changes nothing. The
service itself is SIGKILLed and started again: the live workers serve on without it and
re-attach, while the groups it served are lost with it (their server ran inside it; the new
service reclaims their unheld files and creates them empty), so a dead worker's group is then
idle, serves nothing and its next worker starts cold. A pull from such a group that the
service's death cut short stays in flight, its memory held, until a worker answers at that
endpoint again: nothing else proves that the source can no longer write.

Steps, drawn by a seeded generator (every kind is done once first, then by weight):

    deposit          fresh or known keys, sometimes ``no_evict`` (the handle is kept)
    deliver_local    resident keys and a key nobody has, into the engine
    deliver_peer     from another live worker through a router hint: its G2 blocks, blocks
                     only its engine holds (pinned on request) and a key nobody has
    deliver_served   the same from a killed worker's group, which the guard serves
    fetch_peer       into local G2 from a live peer; the release handles are kept
    fetch_served     the same from a served group
    release          some kept handles, and one nobody holds
    engine_hold      the worker's engine computes new blocks it does not deposit
    hint_dead        a hint naming an endpoint nobody listens on: fails within the deadline
    kill_idle        SIGKILL a worker at rest
    kill_mid_pull    SIGKILL a worker while a peer pulls from it
    pause_short      SIGSTOP a worker for 25-40 % of the heartbeat timeout, then SIGCONT:
                     it keeps its claim (same pid, not fenced) and serves a peer byte-exact
    stop_fenced      SIGSTOP a worker and leave it: the guard fences it (SIGKILL) between
                     the timeout and the timeout plus slack, then serves its group
    guard_restart    SIGKILL the guard service (sometimes mid-pull, from a live or a served
                     group), check every live worker notices and serves peers meanwhile,
                     start it again with the same flags: every live worker re-attaches and
                     journals again; dead workers' groups come back idle and empty
    restart          a new worker claims a dead worker's group and port: warm from the
                     journal if the guard served it, cold if a service restart lost it

Block content is derived from the key (``engine.write(element, seed=key)``), so every copy
of key k, wherever it comes from, must have the checksum this driver computes for k.

After each step every live worker is waited on until nothing is in flight (bounded), then
audited (``worker_proc.Soak.audit``) and the guard's group table and resources are read.
The invariants are in :meth:`Soak.check_worker` and :meth:`Soak.check_guard`. A violation
raises :class:`SoakFailure` with the step history.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MEM_EVENTS", "no")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvcr.guard.protocol import GroupStatus
from procs import GuardProcess, SourceWorker, free_port, wait_until

GROUPS = 3
BLOCK = 64 * 1024
POOL_BLOCKS = 64  # small on purpose: deposits keep evicting, so slots are recycled all along
SIZES = (BLOCK, 16, 64)  # block bytes, (unused) own pool blocks, engine region blocks
POOL_GB = f"{POOL_BLOCKS * BLOCK / 2**30:.10f}"
BATCH = 8  # keys per deposit / deliver (the engine stages 16 and lands 32 at most)
MAX_HELD = 24  # claims kept per worker: well under POOL_BLOCKS, so deposits always find room
OPERATION_TIMEOUT_S = 2.0  # worker_proc's operation_timeout_ms
QUIET_TIMEOUT_S = 15.0  # > abandon_timeout_ms (4 s): a pull from a killed source may take that
# The guard's --heartbeat-timeout-ms. Workers beat every 50 ms from their runtime's loop, so
# 1.5 s is 30 missed beats: no live worker is fenced by a busy 2-core machine, and a fence
# still costs a stop_fenced step under two seconds.
HEARTBEAT_TIMEOUT_S = 1.5
PAUSE_SHARE = (0.25, 0.4)  # pause_short stops a worker for this share of the timeout
FENCE_SLACK_S = 1.0  # past the timeout: the guard's turn, SIGKILL, the exit, our poll
# After a restarted service is ready, a worker's next re-attach try comes within its backoff
# cap (lease_link.REATTACH_MAX_S, 4 s); the rest is slack for the claim on a loaded machine.
REATTACH_BOUND_S = 10.0

# Resource bounds over the baseline taken after warm-up (every kind of traffic, a takeover
# and a hand-back have happened once). Generous, because UCX and ZMQ grow pools and
# connection state lazily and the allocator keeps freed memory; meaningful, because a leak
# per step or per restart (an fd or a thread per pull, a mapping or an agent per takeover, a
# block buffer per operation) crosses them within the thousands of steps and hundreds of
# kills of a long soak (some 40 steps and 2 kills a second).
FD_MARGIN = 32
THREAD_MARGIN = 8
RSS_MARGIN_KIB = 128 * 1024

WEIGHTS = {
    "deposit": 20,
    "deliver_local": 14,
    "deliver_peer": 18,
    "deliver_served": 8,
    "fetch_peer": 10,
    "fetch_served": 4,
    "release": 10,
    "engine_hold": 6,
    "hint_dead": 1,  # costs a whole operation timeout
    "kill_idle": 2,
    "kill_mid_pull": 2,
    "restart": 8,
    # Each costs half a second or more (a pause, a fence, a service start and re-attach):
    # rare enough that most of the time still goes to traffic.
    "pause_short": 2,
    "stop_fenced": 1,  # a whole heartbeat timeout
    "guard_restart": 1,
}


_EXPECTED: dict[int, int] = {}


def expected(k: int) -> int:
    """The checksum of key k's block, computed here as engine_sim.EngineSim.write does."""
    if k not in _EXPECTED:
        rng = np.random.default_rng(k * 1000)
        _EXPECTED[k] = zlib.crc32(rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes())
    return _EXPECTED[k]


class SoakFailure(AssertionError):
    pass


@dataclasses.dataclass
class Resources:
    fds: int = 0
    threads: int = 0
    rss_kib: int = 0

    def peak(self, other: Resources) -> None:
        self.fds = max(self.fds, other.fds)
        self.threads = max(self.threads, other.threads)
        self.rss_kib = max(self.rss_kib, other.rss_kib)


@dataclasses.dataclass
class Summary:
    seed: int
    seconds: float = 0.0
    steps: int = 0
    by_kind: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds_by_kind: dict[str, float] = dataclasses.field(default_factory=dict)  # warm-up too
    invariant_checks: int = 0
    kills: int = 0
    fences: int = 0
    pauses: int = 0
    guard_restarts: int = 0
    restarts: int = 0
    blocks_verified: int = 0
    bytes_verified: int = 0
    violations: int = 0
    dropped_messages: dict[str, int] = dataclasses.field(default_factory=dict)
    baseline: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    peak: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    def line(self) -> str:
        return (
            f"soak: {self.steps} steps in {self.seconds:.0f} s, {self.invariant_checks} "
            f"invariant checks, {self.kills} kills, {self.fences} fences, {self.pauses} "
            f"pauses, {self.guard_restarts} service restarts, {self.restarts} restarts, "
            f"{self.blocks_verified} blocks ({self.bytes_verified / 2**20:.0f} MiB) verified, "
            f"{self.violations} violations"
        )


@dataclasses.dataclass
class Group:
    """One pool group and the worker process that holds it (None once that worker died)."""

    index: int
    port: int
    endpoint: str = ""
    worker: SourceWorker | None = None
    generation: int = 0
    # While the worker is dead: whether the guard serves the group (it took it over), and
    # what it serves, which is what a replacement finds. A service restart empties both.
    served: bool = False
    resident_at_death: list[int] = dataclasses.field(default_factory=list)
    engine_held: list[int] = dataclasses.field(default_factory=list)
    held: int = 0  # release handles the worker keeps
    # Groups whose served endpoint went silent (the service died) while this worker pulled
    # from it: such a pull's memory stays held, `uncertain`, until a worker answers there
    # again, since nothing else proves the source can no longer write. Then the ops of
    # `uncertain` must see their `quiesced`.
    stranded: set[int] = dataclasses.field(default_factory=set)
    uncertain: set[int] = dataclasses.field(default_factory=set)

    @property
    def name(self) -> str:
        return f"g{self.index}"


def resources_of(pid: int) -> Resources:
    with open(f"/proc/{pid}/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return Resources(len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task")), rss)


class Soak:
    def __init__(self, directory: Path, seed: int, log: Callable[[str], None]) -> None:
        self.directory = directory
        self.rng = random.Random(seed)
        self.current = "start"
        self.log = log
        self.summary = Summary(seed=seed)
        self.history: list[str] = []
        self.steps: Counter[str] = Counter()
        self.step_seconds: dict[str, float] = {}
        self.next_key = 1
        self.known: set[int] = set()  # keys whose block was computed somewhere
        self.guard = self.start_guard()
        self.guard_handbacks = 0  # groups the running service took over and handed back
        self.dead_endpoint = f"tcp://127.0.0.1:{free_port()}"  # nobody ever binds it
        self.groups = [Group(i, free_port()) for i in range(GROUPS)]
        self.baseline: dict[str, Resources] = {}
        self.peak: dict[str, Resources] = {}
        for group in self.groups:
            self.start(group)

    # -- helpers ------------------------------------------------------------------------

    def fail(self, what: str) -> NoReturn:
        self.summary.violations += 1
        tail = "\n  ".join([*self.history[-40:], f"(failed) {self.current}"])
        raise SoakFailure(f"{what}\nlast steps:\n  {tail}")

    def check(self, ok: bool, what: str) -> None:
        self.summary.invariant_checks += 1
        if not ok:
            self.fail(what)

    def fresh(self, n: int) -> list[int]:
        keys = list(range(self.next_key, self.next_key + n))
        self.next_key += n
        return keys

    def live(self) -> list[Group]:
        return [g for g in self.groups if g.worker is not None]

    def dead(self) -> list[Group]:
        return [g for g in self.groups if g.worker is None]

    def served(self) -> list[Group]:
        return [g for g in self.dead() if g.served]

    def start_guard(self) -> GuardProcess:
        """The guard service, always with the same flags (a restart must find its groups)."""
        return GuardProcess(
            self.directory,
            guard_count=GROUPS,
            pool_sizes_gb=POOL_GB,
            digest="soak",
            extra=(
                *("--idle-timeout-s", "0.5"),
                *("--heartbeat-timeout-ms", str(round(HEARTBEAT_TIMEOUT_S * 1000))),
            ),
        )

    def status(self, group: Group) -> GroupStatus:
        return self.guard.client.status()[group.index]

    def attached(self, group: Group) -> tuple[float, float]:
        """The worker's runtime gauges (guard_attached, recovery_disabled)."""
        gauges = self.call(group, "gauges")
        return gauges["guard_attached"], gauges["recovery_disabled"]

    def gauges_are(self, group: Group, want: tuple[float, float]) -> bool:
        return self.attached(group) == want

    def journal_holds(self, group: Group, blocks: int) -> bool:
        status = self.status(group)
        return status.journal_blocks == blocks and not status.recovery_disabled

    def holds(self, group: Group, pid: int) -> bool:
        return self.guard.states()[group.index] == ("held", pid)

    def wait(
        self,
        condition: Callable[[], Any],
        what: str,
        timeout: float,
        describe: Callable[[], object] | None = None,
    ) -> Any:
        """:func:`wait_until` whose timeout is a violation naming ``what`` and, with
        ``describe``, what it says then."""
        self.summary.invariant_checks += 1
        try:
            return wait_until(condition, timeout, what)
        except TimeoutError as exc:
            self.fail(f"{exc}: {describe()}" if describe is not None else str(exc))

    def start(self, group: Group) -> None:
        group.generation += 1
        group.worker = SourceWorker(
            f"soak-{group.name}",  # the same agent name every time, like a restarted engine
            SIZES,
            group.port,
            guard=(self.guard.socket_path, group.index, self.guard.digest),
            env={"KVCR_LOG_LEVEL": os.environ.get("KVCR_LOG_LEVEL", "INFO")},
            log=self.directory / f"{group.name}.log",
        )
        group.endpoint = group.worker.endpoint
        group.engine_held = []
        group.held = 0
        group.served = False
        group.stranded = set()
        group.uncertain = set()

    def call(self, group: Group, *command: object, timeout: float = 30) -> Any:
        assert group.worker is not None
        try:
            return group.worker(*command, timeout=timeout)
        except (RuntimeError, TimeoutError, EOFError, OSError) as exc:
            self.fail(f"{group.name} {command[0]}: {exc}")

    def verify(self, where: str, k: int, checksum: int | None) -> None:
        self.check(checksum == expected(k), f"{where}: key {k} arrived with wrong bytes")
        self.summary.blocks_verified += 1
        self.summary.bytes_verified += BLOCK

    def pick(self, pool: list[int], n: int) -> list[int]:
        return self.rng.sample(pool, min(n, len(pool)))

    # -- steps --------------------------------------------------------------------------

    def feasible(self, kind: str) -> bool:
        live, dead = self.live(), self.dead()
        return {
            "deposit": bool(live),
            "deliver_local": bool(live),
            "deliver_peer": len(live) >= 2,
            "deliver_served": bool(live and self.served()),
            "fetch_peer": len(live) >= 2 and bool(self.roomy(live)),
            "fetch_served": bool(self.served() and self.roomy(live)),
            "release": any(g.held for g in live),
            "engine_hold": bool(live),
            "hint_dead": bool(live),
            "kill_idle": len(live) >= 2,
            "kill_mid_pull": len(live) >= 2,
            "pause_short": len(live) >= 2,
            "stop_fenced": len(live) >= 2,
            "guard_restart": len(live) >= 2,
            "restart": bool(dead),
        }[kind]

    def choose(self) -> str:
        todo = [k for k in WEIGHTS if k not in self.steps and self.feasible(k)]
        if todo:  # every kind once first, so that a short run covers them all
            return todo[0]
        kinds = [k for k in WEIGHTS if self.feasible(k)]
        return self.rng.choices(kinds, [WEIGHTS[k] for k in kinds])[0]

    def step(self, kind: str) -> str:
        self.current = kind
        started = time.monotonic()
        try:
            return getattr(self, f"do_{kind}")()  # type: ignore[no-any-return]
        finally:
            took = time.monotonic() - started
            self.step_seconds[kind] = self.step_seconds.get(kind, 0.0) + took

    def do_deposit(self) -> str:
        group = self.rng.choice(self.live())
        n = self.rng.randint(1, BATCH)
        # Mostly new blocks; some the cluster already has (the same bytes again).
        known = self.pick(sorted(self.known), self.rng.randint(0, n // 2))
        keys = known + self.fresh(n - len(known))
        no_evict = group.held + n <= MAX_HELD and self.rng.random() < 0.2
        self.known.update(keys)
        result = self.call(group, "soak_deposit", keys, no_evict)
        self.check(set(result.values()) == {"SUCCESS"}, f"{group.name} deposit: {result}")
        if no_evict:
            group.held += len(keys)
        return f"{group.name} deposit {len(keys)} keys no_evict={no_evict}"

    def deliver_checked(
        self, where: str, dest: Group, keys: list[int], endpoint: str | None, must: set[int]
    ) -> dict[str, Any]:
        """Deliver ``keys``: those in ``must`` succeed, a success is byte-exact, the rest
        fail (they are nowhere the deliver may look)."""
        result = self.call(dest, "soak_deliver", keys, endpoint)
        for k, (status, checksum) in result["entries"].items():
            if status == "SUCCESS":
                self.verify(where, k, checksum)
            self.check(
                (status == "SUCCESS") == (k in must),
                f"{where}: key {k} {status}; present {sorted(must & set(keys))}; got {result}",
            )
        return result

    def do_deliver_local(self) -> str:
        group = self.rng.choice(self.live())
        resident = self.call(group, "soak_resident")
        keys = [*self.pick(resident, BATCH - 1), *self.fresh(1)]  # the fresh key is nowhere
        self.rng.shuffle(keys)
        self.deliver_checked(f"{group.name} deliver_local", group, keys, None, set(resident))
        return f"{group.name} deliver_local {len(keys)} keys"

    def peer_keys(self, source: Group, dest: Group, n: int) -> tuple[list[int], set[int]]:
        """Keys to ask ``source`` for (resident there, held by its engine, one nobody has)
        and which of them must arrive."""
        if source.worker is not None:
            resident = self.call(source, "soak_resident")
        else:
            resident = source.resident_at_death
        engine = [k for k in source.engine_held if k not in resident]
        keys = [*self.pick(resident, n - 3), *self.pick(engine, 2), *self.fresh(1)]
        self.rng.shuffle(keys)
        mine = set(self.call(dest, "soak_resident"))
        return keys, set(resident) | set(engine) | (mine & set(keys))

    def deliver_from(self, source: Group, kind: str) -> str:
        dest = self.rng.choice([g for g in self.live() if g is not source])
        keys, must = self.peer_keys(source, dest, BATCH)
        where = f"{dest.name} {kind} from {source.name}"
        self.deliver_checked(where, dest, keys, source.endpoint, must)
        return f"{where}: {len(keys)} keys, {len(must & set(keys))} present"

    def do_deliver_peer(self) -> str:
        return self.deliver_from(self.rng.choice(self.live()), "deliver_peer")

    def do_deliver_served(self) -> str:
        return self.deliver_from(self.rng.choice(self.served()), "deliver_served")

    def roomy(self, groups: list[Group]) -> list[Group]:
        """Workers that may keep a fetch's claims (every success is one more)."""
        return [g for g in groups if g.held + BATCH <= MAX_HELD]

    def fetch_from(self, source: Group, kind: str) -> str:
        dest = self.rng.choice(self.roomy([g for g in self.live() if g is not source]))
        keys, must = self.peer_keys(source, dest, 6)
        where = f"{dest.name} {kind} from {source.name}"
        result = self.call(dest, "soak_fetch", keys, source.endpoint)
        for k, (status, checksum) in result.items():
            if status == "SUCCESS":
                self.verify(where, k, checksum)
                dest.held += 1
            self.check((status == "SUCCESS") == (k in must), f"{where}: key {k} {status}")
        return f"{where}: {len(keys)} keys, {len(must & set(keys))} present"

    def do_fetch_peer(self) -> str:
        dest = self.rng.choice(self.roomy(self.live()))
        return self.fetch_from(
            self.rng.choice([g for g in self.live() if g is not dest]), "fetch_peer"
        )

    def do_fetch_served(self) -> str:
        return self.fetch_from(self.rng.choice(self.served()), "fetch_served")

    def do_release(self) -> str:
        group = self.rng.choice([g for g in self.live() if g.held])
        count = self.rng.randint(1, group.held)
        result = self.call(group, "soak_release", count)
        self.check(result["released"] == [True] * count, f"{group.name} release: {result}")
        self.check(result["unknown"] is False, f"{group.name} released a handle nobody held")
        group.held -= count
        return f"{group.name} release {count}"

    def do_engine_hold(self) -> str:
        group = self.rng.choice(self.live())
        keys = self.fresh(self.rng.randint(1, 16))
        self.known.update(keys)
        self.call(group, "soak_engine_hold", keys)
        group.engine_held = keys
        return f"{group.name} engine_hold {len(keys)} keys"

    def do_hint_dead(self) -> str:
        group = self.rng.choice(self.live())
        keys = self.fresh(3)
        result = self.call(group, "soak_deliver", keys, self.dead_endpoint)
        statuses = {s for s, _ in result["entries"].values()}
        where = f"{group.name} hint_dead"
        self.check(statuses == {"FAILED"}, f"{where}: {result}")
        # The deadline, plus scheduling slack on a loaded 2-core machine.
        self.check(result["seconds"] < OPERATION_TIMEOUT_S + 1.5, f"{where}: took {result}")
        self.check(set(result["query_after"]) == {"MISS"}, f"{where}: hint not failed: {result}")
        return f"{where} failed in {result['seconds']:.2f} s"

    def bury(self, group: Group, resident: list[int]) -> None:
        """``group``'s worker has exited, with ``resident`` committed: the guard serves
        those from the group's journal once it has taken the group over."""
        assert group.worker is not None
        group.worker.conn.close()
        group.worker = None
        group.engine_held = []
        group.held = 0
        group.stranded = set()
        group.uncertain = set()
        group.served = True
        group.resident_at_death = resident
        # The guard notices the pidfd and serves the group from its journal.
        self.wait(
            lambda: self.guard.states()[group.index] == ("serving", None),
            f"takeover of {group.name}",
            20,
            self.guard.states,
        )

    def kill(self, group: Group) -> None:
        assert group.worker is not None
        resident = self.call(group, "soak_resident")
        group.worker.kill()
        self.summary.kills += 1
        self.bury(group, resident)

    def do_kill_idle(self) -> str:
        group = self.rng.choice(self.live())
        self.kill(group)
        return f"{group.name} kill_idle ({len(group.resident_at_death)} resident)"

    def do_kill_mid_pull(self) -> str:
        source = self.rng.choice(self.live())
        dest = self.rng.choice([g for g in self.live() if g is not source])
        keys, _ = self.peer_keys(source, dest, BATCH)
        handle, request = self.call(dest, "soak_deliver_start", keys, source.endpoint)
        time.sleep(self.rng.uniform(0, 0.005))  # a random kill point, not synchronization
        self.kill(source)
        # Whatever the dead source wrote, the guard wrote, or nobody did: an answer for
        # every key, and every success byte-exact (the source's pinned engine blocks died
        # with it, its G2 blocks are served).
        result = self.call(dest, "soak_deliver_finish", handle, request, keys)
        where = f"{dest.name} pull from killed {source.name}"
        self.check(len(result["entries"]) == len(keys), f"{where}: unanswered keys")
        ok = 0
        for k, (status, checksum) in result["entries"].items():
            if status == "SUCCESS":
                self.verify(where, k, checksum)
                ok += 1
        return f"{where}: {ok}/{len(keys)} arrived"

    def do_pause_short(self) -> str:
        group = self.rng.choice(self.live())
        assert group.worker is not None
        pid = group.worker.proc.pid
        where = f"{group.name} pause_short"
        before = self.status(group)
        pause = self.rng.uniform(*PAUSE_SHARE) * HEARTBEAT_TIMEOUT_S
        os.kill(pid, signal.SIGSTOP)
        time.sleep(pause)  # the fault itself: how long the holder stays silent
        resumed = time.monotonic()
        os.kill(pid, signal.SIGCONT)

        # Once the guard has accepted a beat after the resume, the holder's deadline lies a
        # whole timeout past the pause: from then on the pause can no longer fence it.
        def beat_after_resume() -> GroupStatus | None:
            asked = time.monotonic()
            status = self.status(group)
            if status.last_beat_ms is None or status.holder_pid != pid:
                return status  # the claim is gone: checked below
            # The beat came no earlier than `asked - last_beat_ms` (less the ms rounding).
            return status if asked - status.last_beat_ms / 1000 - 0.001 > resumed else None

        status = self.wait(
            beat_after_resume, f"{where}: a beat accepted after SIGCONT", HEARTBEAT_TIMEOUT_S + 2
        )
        self.check(
            (status.state, status.holder_pid) == ("held", pid),
            f"{where}: paused {pause:.2f} s of a {HEARTBEAT_TIMEOUT_S} s timeout and lost its "
            f"claim: {status}",
        )
        self.check(
            status.fenced == before.fenced,
            f"{where}: fenced count {before.fenced} -> {status.fenced} after a short pause",
        )
        self.check(group.worker.proc.poll() is None, f"{where}: exited {group.worker.proc.poll()}")
        self.check(
            self.attached(group) == (1.0, 0.0),
            f"{where}: (guard_attached, recovery_disabled) {self.attached(group)} after a "
            "short pause, want (1, 0)",
        )
        self.summary.pauses += 1
        # It still serves: a peer pulls from it, every present key byte-exact.
        pulled = self.deliver_from(group, "pull after pause")
        return f"{where} {pause:.2f} s, kept its claim; {pulled}"

    def do_stop_fenced(self) -> str:
        group = self.rng.choice(self.live())
        assert group.worker is not None
        proc = group.worker.proc
        where = f"{group.name} stop_fenced (pid {proc.pid})"
        resident = self.call(group, "soak_resident")
        asked = time.monotonic()
        before = self.status(group)
        self.check(before.last_beat_ms is not None, f"{where}: the holder never beat: {before}")
        assert before.last_beat_ms is not None
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            code = proc.wait(HEARTBEAT_TIMEOUT_S + FENCE_SLACK_S)
        except subprocess.TimeoutExpired:
            self.fail(
                f"{where}: still alive {HEARTBEAT_TIMEOUT_S + FENCE_SLACK_S} s after SIGSTOP "
                f"(heartbeat timeout {HEARTBEAT_TIMEOUT_S} s); guard says {self.status(group)}"
            )
        exited = time.monotonic()
        self.check(code == -signal.SIGKILL, f"{where}: exited {code}, not by SIGKILL")
        # Never before the timeout: the last beat the guard had accepted when asked came no
        # earlier than `asked - last_beat_ms`, and every later one moves the deadline on.
        silent = exited - (asked - before.last_beat_ms / 1000)
        self.check(
            silent >= HEARTBEAT_TIMEOUT_S - 0.001,
            f"{where}: fenced {silent:.3f} s after its last beat, under the "
            f"{HEARTBEAT_TIMEOUT_S} s timeout",
        )
        self.summary.fences += 1
        self.bury(group, resident)
        status = self.status(group)
        self.check(
            status.fenced == before.fenced + 1,
            f"{where}: fenced count {before.fenced} -> {status.fenced}, want one more",
        )
        return f"{where}: fenced {exited - stopped:.2f} s after SIGSTOP ({len(resident)} resident)"

    def do_guard_restart(self) -> str:
        live = self.live()
        dest = self.rng.choice(live)
        # Sometimes a pull is in flight as the service dies: from a live peer, whose serving
        # owes the service nothing, or from a group the dying service itself serves.
        pull = None
        sources = [g for g in self.groups if g is not dest and (g.worker or g.served)]
        if self.rng.random() < 0.5:
            source = self.rng.choice(sources)
            keys, must = self.peer_keys(source, dest, BATCH)
            handle, request = self.call(dest, "soak_deliver_start", keys, source.endpoint)
            pull = (source, source.worker is not None, keys, must, handle, request)
            time.sleep(self.rng.uniform(0, 0.005))  # a random kill point, not synchronization
        code = self.guard.stop(signal.SIGKILL)
        self.check(code == -signal.SIGKILL, f"guard_restart: the service exited {code}")
        self.summary.guard_restarts += 1
        # The groups it served are gone with it: their server ran inside the service.
        lost = self.served()
        for group in lost:
            group.served = False
            group.resident_at_death = []
        done = []
        if pull is not None:
            source, alive, keys, must, handle, request = pull
            where = f"{dest.name} pull from {source.name} as the service died"
            result = self.call(dest, "soak_deliver_finish", handle, request, keys)
            self.check(len(result["entries"]) == len(keys), f"{where}: unanswered keys")
            ok = 0
            if not alive:  # unless the source confirmed before it died
                dest.stranded.add(source.index)
            for k, (status, checksum) in result["entries"].items():
                if status == "SUCCESS":
                    self.verify(where, k, checksum)
                    ok += 1
                if alive:  # a live source serves on: exactly what it has arrives
                    self.check(
                        (status == "SUCCESS") == (k in must),
                        f"{where}: key {k} {status}; present {sorted(must & set(keys))}",
                    )
            done.append(f"{ok}/{len(keys)} arrived from {'live' if alive else 'served'} source")
        # Every live worker notices (its lease's link ends), stops journaling, serves on.
        for group in live:
            self.wait(
                functools.partial(self.gauges_are, group, (0.0, 1.0)),
                f"{group.name}'s gauges (guard_attached, recovery_disabled) at (0, 1) after "
                "the service's death",
                10,
                functools.partial(self.attached, group),
            )
        for taker in live:
            source = self.rng.choice([g for g in live if g is not taker])
            keys, must = self.peer_keys(source, taker, BATCH)
            where = f"{taker.name} pull from {source.name} while the service is down"
            self.deliver_checked(where, taker, keys, source.endpoint, must)
        # Committed while nobody journals: in the snapshot the worker writes on re-attach.
        writer = self.rng.choice(live)
        keys = self.fresh(self.rng.randint(1, BATCH))
        self.known.update(keys)
        result = self.call(writer, "soak_deposit", keys, False)
        self.check(
            set(result.values()) == {"SUCCESS"},
            f"{writer.name} deposit while the service is down: {result}",
        )

        self.guard = self.start_guard()
        states = self.guard.states()
        for group in self.groups:
            if group.worker is None:  # its file unheld: reclaimed and made anew, empty
                self.check(
                    states[group.index] == ("idle", None),
                    f"guard_restart: dead {group.name} is {states[group.index]}, not idle",
                )
            else:  # still mapped by its worker: adopted detached until it re-attaches
                self.check(
                    states[group.index] in (("detached", None), ("held", group.worker.proc.pid)),
                    f"guard_restart: live {group.name} is {states[group.index]}",
                )
        for group in live:
            assert group.worker is not None
            pid = group.worker.proc.pid
            self.wait(
                functools.partial(self.holds, group, pid),
                f"{group.name} (pid {pid}) re-attaching to the restarted service",
                REATTACH_BOUND_S,
                self.guard.states,
            )
            # The grant comes before the runtime's loop hears of it: wait for its gauges.
            self.wait(
                functools.partial(self.gauges_are, group, (1.0, 0.0)),
                f"{group.name}'s gauges (guard_attached, recovery_disabled) at (1, 0) after "
                "its re-attach",
                5,
                functools.partial(self.attached, group),
            )
            # Its fresh snapshot holds every block it has, the deposit made while the
            # service was down among them: the new service's journal follower (every
            # 0.5 s while held) sees them all.
            resident = len(self.call(group, "soak_resident"))
            self.wait(
                functools.partial(self.journal_holds, group, resident),
                f"{group.name}'s journal, as the restarted service reads it, holding its "
                f"{resident} resident blocks with recovery on",
                5,
                functools.partial(self.status, group),
            )
        # A new process: its resources are compared with its own, from its first hand-back.
        for name in [n for n in self.baseline if n.startswith("guard/")]:
            del self.baseline[name]
        self.guard_handbacks = 0
        return (
            f"guard_restart: {len(live)} workers re-attached, {len(lost)} served groups lost; "
            + "; ".join(done)
        )

    def do_restart(self) -> str:
        group = self.rng.choice(self.dead())
        was_served = group.served
        self.start(group)
        assert group.worker is not None
        self.summary.restarts += 1
        where = f"{group.name} restart ({'warm' if was_served else 'cold'})"
        self.check(
            self.guard.states()[group.index] == ("held", group.worker.proc.pid),
            f"{where}: {self.guard.states()}",
        )
        # Warm: exactly what the dead worker held (the guard only served, never stored).
        # Cold, after a service restart lost the group: nothing.
        resident = self.call(group, "soak_resident")
        self.check(
            resident == group.resident_at_death,
            f"{where}: resident {len(resident)} != at death {len(group.resident_at_death)}",
        )
        if was_served:
            self.guard_handbacks += 1
        # A worker answers at the group's endpoint again: pulls stranded there end now (the
        # quiet wait of the next check says within its bound).
        for other in self.live():
            other.stranded.discard(group.index)
        keys = self.pick(resident, BATCH)
        if keys:
            self.deliver_checked(where, group, keys, None, set(keys))
        return f"{where}: {len(resident)} blocks back"

    # -- invariants ---------------------------------------------------------------------

    def check_worker(self, group: Group) -> Resources:
        where = f"{group.name}#{group.generation}"
        stranded = len(group.stranded)
        self.call(group, "soak_quiet", QUIET_TIMEOUT_S, stranded, timeout=QUIET_TIMEOUT_S + 10)
        audit = self.call(group, "soak_audit")
        index, resident, busy = audit["index"], audit["resident"], audit["busy"]
        self.check(
            busy["pulls"] <= stranded and not any(n for k, n in busy.items() if k != "pulls"),
            f"{where}: busy when quiet ({stranded} pulls may be stranded): {busy}",
        )
        self.check(
            not audit["callbacks_off_thread"],
            f"{where}: engine callbacks off the engine's calls: {audit['callbacks_off_thread']}",
        )
        # Slots: each is free or in exactly one record; none quarantined once quiet.
        self.check(index["double"] == 0, f"{where}: slots handed out twice: {index}")
        self.check(index["quarantined"] == 0, f"{where}: slots leaked: {index}")
        self.check(index["filling"] == 0, f"{where}: fills left over: {index}")
        self.check(index["view_mismatch"] == 0, f"{where}: query view disagrees: {index}")
        self.check(
            index["free"] + index["blocks"] == audit["capacity"], f"{where}: slot count: {index}"
        )
        self.check(index["queued"] <= index["blocks"], f"{where}: queued a record twice: {index}")
        # Residency: what the engine was told (inventory) is what is there, and nothing
        # is there that was never computed.
        self.check(audit["inventory"] == resident, f"{where}: inventory != resident")
        self.check(set(resident) <= self.known, f"{where}: phantom keys")
        # Claims: exactly one per handle the engine keeps, nothing else holds a block.
        held = audit["held"]
        self.check(len(held) == group.held, f"{where}: {len(held)} handles, want {group.held}")
        self.check(audit["handles_runtime"] == held, f"{where}: runtime handles != kept")
        self.check(audit["handles_live"] == len(held), f"{where}: live handle set")
        self.check(
            audit["claims"] == dict(Counter(held)),
            f"{where}: claims {audit['claims']} != handles {dict(Counter(held))}",
        )
        # Every `uncertain` was followed by `quiesced` for the same operation.
        # (An op quiesced after the audit that saw it uncertain shows only `quiesced` in the
        # next one.)
        for op, states in audit["resilience"].items():
            if states == ["uncertain"] and group.stranded:
                group.uncertain.add(op)  # a stranded pull's, quiesced once it ends
                continue
            self.check(
                states in (["uncertain", "quiesced"], ["quiesced"]),
                f"{where}: op {op} resilience events {states}",
            )
            group.uncertain.discard(op)
        self.check(
            bool(group.stranded) or not group.uncertain,
            f"{where}: ops {sorted(group.uncertain)} uncertain, never quiesced, though no pull "
            "is stranded any more",
        )
        self.check(audit["links"] <= GROUPS + 1, f"{where}: {audit['links']} peer links")
        for kind, n in audit["dropped"].items():
            self.summary.dropped_messages[kind] = max(self.summary.dropped_messages.get(kind, 0), n)
        return Resources(audit["fds"], audit["threads"], audit["rss_kib"])

    def check_guard(self) -> Resources:
        states = self.guard.states()
        for group in self.groups:
            if group.worker is not None:
                want: tuple[str, int | None] = ("held", group.worker.proc.pid)
            else:
                want = ("serving", None) if group.served else ("idle", None)
            self.check(
                states[group.index] == want,
                f"guard: {group.name} is {states[group.index]}, want {want}",
            )
        self.check(self.guard.proc.poll() is None, "guard: exited")
        return resources_of(self.guard.proc.pid)

    def check_all(self) -> None:
        seen = {g.name: self.check_worker(g) for g in self.live()}
        # Each group the guard serves runs a KVCR of its own (NIXL agent, UCX and ZMQ
        # threads and fds), and a group never claimed since a service restart has neither
        # the control listener nor the standby transport of a held one: the guard is
        # compared with itself serving as many groups with as many idle.
        idle = len(self.dead()) - len(self.served())
        name = f"guard/{len(self.served())}-served" + (f"-{idle}-idle" if idle else "")
        seen[name] = guard = self.check_guard()
        self.peak.setdefault("guard", Resources()).peak(guard)
        for name, now in seen.items():
            self.peak.setdefault(name, Resources()).peak(now)
            base = self.baseline.get(name)
            if base is None:
                # After warm-up: the first time at this served count; for a restarted
                # service, once it has taken a group over and handed it back, so that what
                # a takeover grows lazily is in its baselines as it is in the first one's.
                if self.baseline and (not name.startswith("guard/") or self.guard_handbacks):
                    self.baseline[name] = dataclasses.replace(now)
                continue
            self.check(now.fds <= base.fds + FD_MARGIN, f"{name}: fds {now} over {base}")
            self.check(
                now.threads <= base.threads + THREAD_MARGIN, f"{name}: threads {now} over {base}"
            )
            self.check(
                now.rss_kib <= base.rss_kib + RSS_MARGIN_KIB, f"{name}: RSS {now} over {base}"
            )

    # -- the run ------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Every kind of traffic once (a takeover and a hand-back included), then take the
        resource baselines: lazily grown pools and connections are in them."""
        kinds = ["deposit", "engine_hold", "deliver_peer", "fetch_peer"] * GROUPS
        kinds += ["kill_idle", "deliver_served", "restart", "deliver_peer", "release"]
        for kind in kinds:
            if self.feasible(kind):
                self.record(kind, self.step(kind))
        self.check_all()
        self.baseline = {name: dataclasses.replace(r) for name, r in self.peak.items()}
        del self.baseline["guard"]

    def record(self, kind: str, what: str) -> None:
        self.steps[kind] += 1
        self.summary.steps += 1
        self.history.append(f"#{self.summary.steps} {kind}: {what}")
        del self.history[:-200]

    def run(self, seconds: float) -> Summary:
        started = time.monotonic()
        self.warm_up()
        self.steps.clear()  # warm-up steps count in the total, not as coverage
        last_report = started
        while time.monotonic() - started < seconds:
            kind = self.choose()
            self.record(kind, self.step(kind))
            self.check_all()
            if time.monotonic() - last_report > 30:
                last_report = time.monotonic()
                guard = resources_of(self.guard.proc.pid)
                self.log(f"{self.progress(started)}; guard {guard} serving {len(self.dead())}")
        self.finish(started)
        return self.summary

    def progress(self, started: float) -> str:
        self.summary.seconds = time.monotonic() - started
        self.summary.by_kind = dict(sorted(self.steps.items()))
        self.summary.seconds_by_kind = {
            k: round(v, 1) for k, v in sorted(self.step_seconds.items())
        }
        return self.summary.line()

    def finish(self, started: float) -> None:
        """Bring every group back to a live worker and compare the guard with itself after
        warm-up, closely this time: it has served and handed back every takeover of the run,
        so whatever one of those leaked has piled up. Then stop every worker cleanly: every
        group ends idle (and ``close`` checks that the guard stops cleanly)."""
        while self.dead():
            self.record("restart", self.do_restart())
            self.check_all()
        # A service restarted late in the run may have no baseline yet (no hand-back since):
        # then it has done no takeover that could have leaked.
        base, now = self.baseline.get("guard/0-served"), resources_of(self.guard.proc.pid)
        if base is not None:
            self.check(now.fds <= base.fds + 4, f"guard: fds {now} after the run, {base} before")
            self.check(now.threads <= base.threads + 2, f"guard: threads {now} vs {base} before")
        for group in self.groups:
            assert group.worker is not None
            group.worker.stop()
            group.worker = None
        states = self.guard.states()
        self.check(states == [("idle", None)] * GROUPS, f"guard at the end: {states}")
        self.summary.peak = {n: dataclasses.asdict(r) for n, r in self.peak.items()}
        self.summary.baseline = {n: dataclasses.asdict(r) for n, r in self.baseline.items()}
        self.progress(started)

    def close(self) -> None:
        for group in self.groups:
            if group.worker is not None and group.worker.proc.poll() is None:
                group.worker.proc.kill()
                group.worker.proc.wait(10)
        code = self.guard.stop()
        if code != 0:
            raise SoakFailure(f"guard exited {code}: {self.guard.log()[-4000:]}")
        left = list(self.guard.pool_dir.iterdir())
        if left:
            raise SoakFailure(f"guard left pool files: {left}")


def run(
    seconds: float, seed: int, log: Callable[[str], None] = print, directory: Path | None = None
) -> Summary:
    """Soak for ``seconds`` (plus warm-up and shutdown); raises SoakFailure on a violation.
    The guard's and workers' logs are kept in ``directory`` (a fresh temporary directory by
    default, removed after a clean run)."""
    own = directory is None
    where = Path(tempfile.mkdtemp(prefix="kvcr-soak-")) if directory is None else directory
    soak = Soak(where, seed, log)
    try:
        summary = soak.run(seconds)
    except SoakFailure as exc:
        raise SoakFailure(f"{exc}\nlogs: {where}") from None
    finally:
        soak.close()
    if own:
        shutil.rmtree(where)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    try:
        summary = run(args.minutes * 60, args.seed)
    except SoakFailure as exc:
        print(f"soak FAILED (seed {args.seed}): {exc}", flush=True)
        return 1
    print(summary.line())
    print(json.dumps(dataclasses.asdict(summary), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
