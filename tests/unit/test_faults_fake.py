"""Fault injection on the fake transport under MockClock: every path that moves memory,
every fault kind, and the same invariants after each (issue #7).

Paths: ``deposit`` (engine -> local G2), ``local_deliver`` (local G2 -> engine), and the four
peer pulls: from the source's G2 or from its engine memory (pins), into the destination's
engine memory (``deliver``) or its G2 (``fetch``). Faults: the path's transfer is refused,
fails, lands and then fails, never finishes, or finishes late (within or past the deadline);
a peer write's notification or one control message (Hello, HelloAck, Pull, Over, Probe,
ProbeAck) is dropped, delayed (within or past the deadline), duplicated (the copy comes
late) or reordered.

Every case runs two operations at once (A takes the fault, B runs beside it), runs until
quiet, and checks:

* each operation handle is answered exactly once per key, with a definite result, and the
  bytes of every success are right;
* memory is accounted for (``Runtime.audit``): no slot held without a record, no claim
  without a release handle, no transfer, pull, source job or engine pin left; every engine
  pin released exactly once, never under a write that reads it;
* no transfer touched memory that was not its to touch at that moment (``Ledger.touch``):
  engine memory after it was handed back to the engine (on success, on failure without
  ``uncertain``, or on ``quiesced``), a free G2 slot, or a committed block;
* every ``uncertain`` is followed by ``quiesced``;
* the instance still serves a fresh operation.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import pytest
import trio

from engine_sim import EngineSim
from kvcr.store.records import BlockState
from kvcr.transport.fake import NEVER, Behavior, FakeTransport, Fault, FaultPlan
from kvcr.types import BlockKey, OpEntryResult, OpEntryStatus, TransferError
from peer_world import EnginePins, Worker, World, key

BLOCK = 4096
QUIET_LIMIT_S = 15.0  # mock time; every single fault here is over well before that
FINISH_STUCK_AT_S = 6.0  # local transfers that never end are finished by hand here


# -- the engine's side: what KVCR may touch, and what it answered ----------------------------


@attrs.define
class Op:
    kind: str
    keys: list[BlockKey]
    elements: dict[BlockKey, int]  # engine element lent per key (deposit source, deliver dst)
    answers: dict[BlockKey, OpEntryResult] = attrs.field(factory=dict)
    uncertain: bool = False
    quiesced: bool = False
    held: list[int] = attrs.field(factory=list)  # elements kept back until quiesced


class Ledger:
    """One worker's engine: which of its elements KVCR may read or write right now, every
    answer it got, and every memory touch that was not KVCR's to make (``violations``).
    Violations are recorded, not raised: the transport's poll runs inside the runtime,
    which would swallow an exception as a failed transfer."""

    def __init__(self, worker: Worker, expected: dict[BlockKey, list[int]]) -> None:
        self.worker = worker
        self.engine: EngineSim = worker.engine
        self.expected = expected
        self.readable: Counter[int] = Counter()  # deposit sources and pinned elements
        self.writable: Counter[int] = Counter()  # deliver destinations
        self.ops: dict[int, Op] = {}
        self.violations: list[str] = []

    @property
    def kv(self) -> Any:
        return self.worker.kv

    @property
    def runtime(self) -> Any:
        return self.worker.runtime

    def attach(self) -> None:
        transport = self.worker.transport
        assert transport is not None
        transport.watch = self.touch
        self.worker.step = self.poll  # the engine's scheduler polls through this ledger

    # -- memory touches --------------------------------------------------------------------

    def locate(self, addr: int) -> tuple[str, int] | None:
        region, pool = self.engine.regions[0], self.engine.pools[0]
        for name, buf in (("element", region), ("slot", pool)):
            offset = addr - buf.ctypes.data
            if 0 <= offset < buf.nbytes:
                return name, offset // BLOCK
        return None

    def touch(self, access: str, addr: int, nbytes: int) -> None:
        where = self.locate(addr)
        if where is None:
            self.violations.append(f"{access} outside this engine's memory at {addr:#x}")
            return
        what, index = where
        if what == "element":
            lent = self.readable if access == "read" else self.writable
            if not lent[index]:
                self.violations.append(f"{access} of engine element {index}: not lent")
            return
        free = self.runtime.index.pools[0].free_slots
        owner = next((b for b in self.runtime.index.blocks() if b.slots[0] == index), None)
        if index in free:
            self.violations.append(f"{access} of free G2 slot {index}")
        elif access == "read" and (owner is None or owner.state is not BlockState.READY):
            self.violations.append(f"read of G2 slot {index}: not a committed block")
        elif access == "read" and not owner.claims:
            self.violations.append(f"read of G2 slot {index}: the block is not claimed")
        elif access == "write" and owner is not None and owner.state is BlockState.READY:
            self.violations.append(f"write into committed G2 slot {index} ({owner.key!r})")

    # -- operations ------------------------------------------------------------------------

    def deposit(self, pairs: list[tuple[int, int]]) -> int:
        """Deposit key k from element e for each (k, e)."""
        blocks = {key(k): self.engine.refs(e) for k, e in pairs}
        handle = self.kv.deposit(blocks)
        self._lend(handle, "deposit", self.readable, pairs)
        return handle

    def deliver(self, pairs: list[tuple[int, int]], request_id: str | None = None) -> int:
        """Deliver key k into element e for each (k, e)."""
        blocks = {key(k): self.engine.refs(e) for k, e in pairs}
        handle = self.kv.deliver(blocks, request_id=request_id)
        self._lend(handle, "deliver", self.writable, pairs)
        return handle

    def fetch(self, keys: list[int], request_id: str | None = None) -> int:
        handle = self.kv.fetch([key(k) for k in keys], request_id=request_id)
        self.ops[handle] = Op("fetch", [key(k) for k in keys], {})
        return handle

    def _lend(self, handle: int, kind: str, lent: Counter[int], pairs: list[tuple[int, int]]):
        self.ops[handle] = Op(kind, [key(k) for k, _ in pairs], {key(k): e for k, e in pairs})
        for _, element in pairs:
            lent[element] += 1

    def _give_back(self, op: Op, element: int) -> None:
        lent = self.readable if op.kind == "deposit" else self.writable
        lent[element] -= 1

    # -- completions -----------------------------------------------------------------------

    def poll(self) -> None:
        """poll_completed, as an engine does it: events first, then results."""
        recorder = self.worker.recorder
        seen = len(recorder.resilience)
        results = self.kv.poll_completed()
        for event in recorder.resilience[seen:]:
            self._on_event(event)
        for handle, entries in results:
            self._on_result(handle, entries)

    def _on_event(self, event: Exception) -> None:
        assert isinstance(event, TransferError), event
        op = self.ops.get(event.op_handle)
        if op is None:
            return  # a source-side event (the source's pinned memory): not one of ours
        if event.state == "uncertain":
            assert not op.uncertain and not op.quiesced, f"op {event.op_handle}: 2nd uncertain"
            op.uncertain = True
        else:
            assert event.state == "quiesced", event.state
            assert op.uncertain and not op.quiesced, f"op {event.op_handle}: stray quiesced"
            op.quiesced = True
            for element in op.held:
                self._give_back(op, element)
            op.held.clear()

    def _on_result(self, handle: int, entries: Any) -> None:
        op = self.ops[handle]
        for k, entry in entries.items():
            assert k in op.keys, f"op {handle}: answered {k!r}, not one of its keys"
            assert k not in op.answers, f"op {handle}: {k!r} answered twice"
            assert entry.status in (OpEntryStatus.SUCCESS, OpEntryStatus.FAILED), entry
            op.answers[k] = entry
            if entry.success:
                self._check_success(op, k, entry)
            if k in op.elements:
                if entry.success or not op.uncertain or op.quiesced:
                    self._give_back(op, op.elements[k])
                else:
                    op.held.append(op.elements[k])

    def _check_success(self, op: Op, k: BlockKey, entry: OpEntryResult) -> None:
        if op.kind == "deliver":
            got = self.engine.checksum(op.elements[k])
            assert got == self.expected[k], f"deliver of {k!r}: wrong bytes"
        elif op.kind == "fetch":
            assert entry.descriptors is not None and entry.release_handle is not None
            slot = entry.descriptors[0].element_index
            assert self.slot_crc(slot) == self.expected[k], f"fetch of {k!r}: wrong bytes"
            # The engine has read the block; it lets go of it as an adapter would.
            assert self.kv.release([entry.release_handle]) == [(entry.release_handle, True)]

    def slot_crc(self, slot: int) -> list[int]:
        return [zlib.crc32(self.engine.pools[0][slot * BLOCK : (slot + 1) * BLOCK].tobytes())]

    def answered(self) -> bool:
        return all(len(op.answers) == len(op.keys) for op in self.ops.values())

    def settled(self) -> bool:
        return all(not op.uncertain or op.quiesced for op in self.ops.values())

    def statuses(self, handle: int) -> set[str]:
        return {e.status.value for e in self.ops[handle].answers.values()}

    def check_committed_bytes(self) -> None:
        """Every committed block in G2 holds exactly the bytes of its key."""
        for block in self.runtime.index.blocks():
            expected = self.expected[block.key]
            assert self.slot_crc(block.slots[0]) == expected, f"G2 {block.key!r}: wrong bytes"

    async def wait(self, handle: int) -> set[str]:
        while len(self.ops[handle].answers) < len(self.ops[handle].keys):
            self.poll()
            await trio.sleep(0.01)
        return self.statuses(handle)


class LedgerPins(EnginePins):
    """Engine pins that open the pinned elements to reads, and check every release: exactly
    once, for a pin that was granted, and never while a write still reads its memory."""

    def __init__(self, engine: EngineSim, ledger: Ledger) -> None:
        super().__init__(engine)
        self.ledger = ledger
        self.granted: dict[str, list[int]] = {}  # handle -> pinned elements

    def poll_pin_results(self) -> list[tuple[int, Any]]:
        out = super().poll_pin_results()
        for _request, result in out:
            if result is not None:
                handle, refs = result
                elements = [r[0].element_index for r in refs.values() if r is not None]
                self.granted[handle] = elements
                for element in elements:
                    self.ledger.readable[element] += 1
        return out

    def release_pin(self, handle: str) -> bool:
        ledger = self.ledger
        if handle not in self.granted:
            ledger.violations.append(f"release_pin({handle!r}): never granted")
        elif handle in self.released:
            ledger.violations.append(f"release_pin({handle!r}): released twice")
        else:
            transport = ledger.worker.transport
            assert transport is not None
            reading = {
                where[1]
                for xfer in transport.in_flight()
                for _, src, _ in xfer.pairs
                if (where := ledger.locate(src)) is not None and where[0] == "element"
            }
            if reading & set(self.granted[handle]):
                ledger.violations.append(f"release_pin({handle!r}) while a write reads it")
            for element in self.granted[handle]:
                ledger.readable[element] -= 1
        return super().release_pin(handle)


# -- the matrix ------------------------------------------------------------------------------

LOCAL_PATHS = ("deposit", "local_deliver")
PEER_PATHS = ("pull_g2_deliver", "pull_g2_fetch", "pull_pin_deliver", "pull_pin_fetch")

# Transfer faults, on the path's transfer (the local copy, or the source's peer write), with
# what operation A must end with (None: the path decides, see ``expected_a``).
TRANSFER_FAULTS: dict[str, tuple[Behavior, str | None]] = {
    "refused": (Behavior(refuse=True), "FAILED"),
    "fails": (Behavior(delay=0.1, fail=True), "FAILED"),
    "lands_then_fails": (Behavior(delay=0.1, fail=True, lands=True), None),
    "never_finishes": (NEVER, "FAILED"),
    "late_within_deadline": (Behavior(delay=0.5), "SUCCESS"),
    "late_past_deadline": (Behavior(delay=1.5), "FAILED"),
}

MESSAGE_FAULTS: dict[str, Fault] = {
    "dropped": Fault("drop"),
    "delayed_within_deadline": Fault("delay", 0.3),
    "delayed_past_deadline": Fault("delay", 1.5),
    "duplicated_late": Fault("duplicate", 1.5),
    "reordered": Fault("reorder", 0.5),
}

# Messages, and what A must end with per fault kind. The source
# answers a Pull with Over only when it writes nothing, and a Probe comes only when a pull
# outlives the destination's deadline: those cases add a trigger (A asks for keys the source
# does not have; the source's write is late).
MESSAGES: dict[str, dict[str, str]] = {
    "hello": dict.fromkeys(MESSAGE_FAULTS, "SUCCESS"),  # greeted again until acknowledged
    "hello_ack": dict.fromkeys(MESSAGE_FAULTS, "SUCCESS"),
    "pull": {
        "dropped": "FAILED",
        "delayed_within_deadline": "SUCCESS",
        "delayed_past_deadline": "FAILED",
        "duplicated_late": "SUCCESS",
        "reordered": "SUCCESS",
    },
    "written": {
        "dropped": "FAILED",
        "delayed_within_deadline": "SUCCESS",
        "delayed_past_deadline": "FAILED",
        "duplicated_late": "SUCCESS",
        "reordered": "SUCCESS",
    },
    "over": dict.fromkeys(MESSAGE_FAULTS, "FAILED"),  # trigger: A's keys are missing
    "probe": dict.fromkeys(MESSAGE_FAULTS, "FAILED"),  # trigger: the write lands at 1.5 s
    "probe_ack": dict.fromkeys(MESSAGE_FAULTS, "FAILED"),
}
PROBE_TRIGGER = Behavior(delay=1.5)


@attrs.frozen
class Case:
    path: str
    transfer: Behavior | None = None
    message: tuple[str, Fault] | None = None
    missing: bool = False  # A asks the source for keys it does not have
    expect_a: str | None = None

    @property
    def injected(self) -> int:
        return (self.transfer is not None) + (self.message is not None)


def expected_a(path: str, expect: str | None) -> str | None:
    if expect is not None or path in LOCAL_PATHS:
        return expect or "FAILED"  # locally the transfer's ERR decides
    # From a peer, bytes that landed before the error come with the notification naming them
    # (success) and the source's Over (the write failed): whichever the destination reads
    # first decides, and both are right; the keys of one pull share the answer.
    return None


def cases() -> list[Any]:
    out = []
    for path in LOCAL_PATHS + PEER_PATHS:
        for name, (behavior, expect) in TRANSFER_FAULTS.items():
            case = Case(path, transfer=behavior, expect_a=expected_a(path, expect))
            out.append(pytest.param(case, id=f"{path}-transfer_{name}"))
    for path in PEER_PATHS:
        for message, expects in MESSAGES.items():
            for name, fault in MESSAGE_FAULTS.items():
                case = Case(
                    path,
                    transfer=PROBE_TRIGGER if message.startswith("probe") else None,
                    message=(message, fault),
                    missing=message == "over",
                    expect_a=expects[name],
                )
                out.append(pytest.param(case, id=f"{path}-{message}_{name}"))
    return out


CASES = cases()


def injected_faults() -> int:
    """How many faults the matrix injects (each case checks that all of its own fired)."""
    return sum(param.values[0].injected for param in CASES)


# -- running a case ----------------------------------------------------------------------------


class Scene:
    """Source ``a`` and destination ``b`` on one fabric, with ledgers and a fault plan."""

    def __init__(self) -> None:
        self.world = World()
        self.plan = FaultPlan()
        self.world.fabric.plan = self.world.hub.plan = self.plan
        self.a, self.b = Worker(self.world, "a"), Worker(self.world, "b")
        self.expected: dict[BlockKey, list[int]] = {}
        for k in range(8):
            self.a.engine.write(k, seed=100 + k)  # engine element k of a holds key k
            self.expected[key(k)] = self.a.engine.checksum(k)
        self.la = Ledger(self.a, self.expected)
        self.lb = Ledger(self.b, self.expected)
        for worker, ledger in ((self.a, self.la), (self.b, self.lb)):
            worker.pins = LedgerPins(worker.engine, ledger)

    @property
    def ledgers(self) -> tuple[Ledger, Ledger]:
        return self.la, self.lb

    def transports(self) -> list[FakeTransport]:
        return [t for t in (self.a.transport, self.b.transport) if t is not None]

    def quiet(self) -> bool:
        return (
            all(ledger.answered() and ledger.settled() for ledger in self.ledgers)
            and self.plan.pending == 0
            and not any(t.in_flight() for t in self.transports())
            and not any(ledger.runtime.audit() for ledger in self.ledgers)
        )

    async def until_quiet(self, on_stuck: Callable[[], None] | None = None) -> None:
        start = trio.current_time()
        while True:
            for ledger in self.ledgers:
                ledger.poll()
            if self.quiet():
                return
            elapsed = trio.current_time() - start
            if on_stuck is not None and elapsed >= FINISH_STUCK_AT_S:
                on_stuck()
                on_stuck = None
            assert elapsed < QUIET_LIMIT_S, self.diagnose()
            await trio.sleep(0.05)

    def diagnose(self) -> str:
        return (
            f"not quiet after {QUIET_LIMIT_S} s: "
            f"a={self.la.runtime.audit()} b={self.lb.runtime.audit()} "
            f"plan pending={self.plan.pending} "
            f"in flight={[len(t.in_flight()) for t in self.transports()]} "
            f"ops a={self.la.ops} b={self.lb.ops}"
        )


async def start_ops(scene: Scene, case: Case) -> tuple[Ledger, int, int]:
    """Submit A (two keys) and, as soon as the fault has hit A, B (one key) beside it;
    returns the ledger of the worker that runs them. (Trio runs tasks that are ready at the
    same moment in a random order, so without the wait the fault could hit B.)"""
    a, b, la, lb = scene.a, scene.b, scene.la, scene.lb
    keys_a = [6, 7] if case.missing else [0, 1]
    ledger: Ledger = la
    submit_a: Callable[[], int]
    submit_b: Callable[[], int]
    if case.path == "deposit":
        submit_a = partial(la.deposit, [(k, k) for k in keys_a])
        submit_b = partial(la.deposit, [(2, 2)])
    elif case.path == "local_deliver":
        submit_a = partial(la.deliver, [(0, 10), (1, 11)])
        submit_b = partial(la.deliver, [(2, 12)])
    else:
        # The hint arrives just before the operations, so the greeting is part of them (and
        # under the plan's faults too). B is another request with its own hint: A's failure
        # marks only A's hint failed.
        ledger = lb
        b.kv.submit_hint(b.hint(a, [0, 1, 6, 7]), request_id="r")
        b.kv.submit_hint(b.hint(a, [2]), request_id="rb")
        if case.path.endswith("deliver"):
            submit_a = partial(lb.deliver, [(keys_a[0], 10), (keys_a[1], 11)], "r")
            submit_b = partial(lb.deliver, [(2, 12)], "rb")
        else:
            submit_a = partial(lb.fetch, keys_a, "r")
            submit_b = partial(lb.fetch, [2], "rb")
    op_a = submit_a()
    assert a.transport is not None
    while a.transport.script if case.transfer is not None else not scene.plan.applied:
        await trio.sleep(0.0001)
    return ledger, op_a, submit_b()


async def fresh_op(scene: Scene, case: Case) -> set[str]:
    """A new operation of the same path after the fault, with no fault: it must succeed."""
    a, b, la, lb = scene.a, scene.b, scene.la, scene.lb
    if case.path == "deposit":
        return await la.wait(la.deposit([(5, 5)]))
    if case.path == "local_deliver":
        return await la.wait(la.deliver([(3, 13)]))
    # A failed remote operation marks its request's hint failed: a new request, a new hint.
    b.kv.submit_hint(b.hint(a, [4]), request_id="fresh")
    if case.path.endswith("deliver"):
        return await lb.wait(lb.deliver([(4, 14)], request_id="fresh"))
    return await lb.wait(lb.fetch([4], request_id="fresh"))


def finish_stuck(scene: Scene) -> Callable[[], None]:
    """Finish (successfully: the bytes land late) every local transfer that never ends, once
    its operation was answered with the memory reported uncertain and still held."""

    def finish() -> None:
        for ledger, transport in ((scene.la, scene.a.transport), (scene.lb, scene.b.transport)):
            assert transport is not None
            stuck = [x for x in transport.in_flight() if x.behavior.delay is None]
            if not stuck:
                continue
            assert ledger.answered()
            assert any(op.uncertain and not op.quiesced for op in ledger.ops.values())
            assert ledger.runtime.index.audit()["quarantined"] or any(
                b.claims for b in ledger.runtime.index.blocks()
            ), "memory under a live transfer must stay held"
            for xfer in stuck:
                transport.finish(xfer)

    return finish


@pytest.mark.parametrize("case", CASES)
async def test_an_injected_fault_ends_cleanly(case: Case, autojump_clock: Any) -> None:
    scene = Scene()
    a, la = scene.a, scene.la
    async with trio.open_nursery() as nursery:
        await nursery.start(scene.plan.run)
        async with a.running(), scene.b.running():
            for ledger in scene.ledgers:
                ledger.attach()
            # Setup, fault-free: the source's G2 holds keys 0-4 (G2 paths and local
            # deliver); its engine can pin keys 0-5 (pin paths).
            if case.path in ("local_deliver", "pull_g2_deliver", "pull_g2_fetch"):
                assert await la.wait(la.deposit([(k, k) for k in range(5)])) == {"SUCCESS"}
            if case.path.startswith("pull_pin"):
                a.pins.engine_has = {key(k): k for k in range(6)}

            if case.transfer is not None:
                a.transport.script.append(case.transfer)
            if case.message is not None:
                scene.plan.add(case.message[0], case.message[1])
            ledger, op_a, op_b = await start_ops(scene, case)
            await scene.until_quiet(finish_stuck(scene))

            # Every fault fired, and each operation got a definite answer.
            assert not a.transport.script and scene.plan.armed == 0
            assert len(scene.plan.applied) == (case.message is not None)
            if case.expect_a is not None:
                assert ledger.statuses(op_a) == {case.expect_a}
            else:
                assert ledger.statuses(op_a) in ({"SUCCESS"}, {"FAILED"})
            assert ledger.statuses(op_b) == {"SUCCESS"}
            for each in scene.ledgers:
                each.check_committed_bytes()

            assert await fresh_op(scene, case) == {"SUCCESS"}
            await scene.until_quiet()
            for each in scene.ledgers:
                each.check_committed_bytes()
        nursery.cancel_scope.cancel()

    for worker, each in ((scene.a, scene.la), (scene.b, scene.lb)):
        assert each.violations == [], each.violations
        assert not each.runtime.leaked and worker.transport.closed
        pins = worker.pins
        assert isinstance(pins, LedgerPins)
        assert sorted(pins.released) == sorted(pins.granted) and not pins.pinned


def test_the_matrix_injects_every_kind_on_every_path() -> None:
    kinds = {(c.values[0].path, c.id.split("-", 1)[1]) for c in CASES}
    assert len(kinds) == len(CASES) == 6 * 6 + 4 * 7 * 5
    assert injected_faults() == len(CASES) + 4 * 2 * 5  # probe cases add a late write
