"""Operations: their entries, their deadlines, and how results leave the runtime.

An operation answers every key exactly once. ``pending`` is the set of keys not answered
yet; the facade holds the same set object (it was created on the engine thread at submit
time) and reads it, without a lock, to answer ``abort`` at once. Only the runtime removes
keys from it, and only through :meth:`Outbox.answer`.

Memory that a failed operation's transfer may still touch is reported through
``TransferError``: ``uncertain`` (emitted before the ``FAILED`` entries it explains, so the
engine learns of it first) and ``quiesced`` once every transfer of the operation is terminal
(``lifecycle.FRAMEWORK_MEMORY``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

from kvcr.runtime.deadlines import Deadlines
from kvcr.runtime.engine_calls import EngineCalls
from kvcr.runtime.lifecycle import FRAMEWORK_MEMORY, MemoryEvent, MemoryState, RemotePull
from kvcr.runtime.transfers import Xfer
from kvcr.statetable import StrEnum
from kvcr.store.index import Block, Filling
from kvcr.telemetry import SCOPE_LOCAL_DELIVER, SCOPE_LOCAL_FETCH, SCOPE_LOCAL_FILL
from kvcr.tracing import Phase, Tracing
from kvcr.types import BlockKey, MemoryRef, OpEntryResult, OpEntryStatus, OpResult, TransferError

FAILED = OpEntryResult(OpEntryStatus.FAILED)
DROPPED = OpEntryResult(OpEntryStatus.DROPPED)
SUCCESS = OpEntryResult(OpEntryStatus.SUCCESS)


class OpKind(StrEnum):
    DEPOSIT = "deposit"
    FETCH = "fetch"
    DELIVER = "deliver"


@attrs.frozen
class Framework:
    """The engine memory an operation's transfers touch (a deposit's sources, a deliver's
    destinations): reported through ``TransferError`` if the operation fails while a
    transfer may still touch it."""

    sources: tuple[BlockKey, ...] = ()
    # A deliver's destinations, worked out only if a TransferError names them: the engine's
    # call does not build a thousand refs for an error that seldom comes.
    destination_refs: Callable[[], tuple[MemoryRef, ...]] | None = None

    @property
    def destinations(self) -> tuple[MemoryRef, ...]:
        return self.destination_refs() if self.destination_refs is not None else ()

    def __bool__(self) -> bool:
        return bool(self.sources) or self.destination_refs is not None


@attrs.define
class RemotePart:
    """The keys an operation asks of the peer its request's hint names."""

    keys: frozenset[BlockKey] = frozenset()
    request: object = None  # the request whose hint sent them there
    move: bool = False  # the peer drops its copies once the engine has the results
    no_retain: bool = False  # a fetch drops the blocks from local G2 at their release
    failed: bool = False  # the pull got nothing: the request's hint is reported failed
    moved: int = 0  # keys the peer wrote
    xfer: str | None = None  # the id of its last pull (``messages.xfer_id``), for the log
    hint_age: float = 0.0  # seconds from the hint's submission to this operation


@attrs.define(eq=False)
class Operation:
    """One engine call's work: its keys and answers (``pending``, ``ok``, ``failure``),
    its clock, and what its transfers hold (``xfers``, ``filling``, ``framework``). Its
    transfers' own states are their tables' (``lifecycle.py``)."""

    handle: int
    kind: OpKind
    keys: list[BlockKey]
    pending: set[BlockKey]
    clock: Deadlines
    framework: Framework = Framework()
    # When the engine asked (telemetry): the clock restarts after a peer link's setup.
    asked: float = attrs.field(
        default=attrs.Factory(lambda self: self.clock.start, takes_self=True)
    )
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    # In flight -> keys: local transfers, and pulls a peer may still write.
    xfers: dict[Xfer | RemotePull, frozenset[BlockKey]] = attrs.field(factory=dict)
    filling: dict[BlockKey, Block] = attrs.field(factory=dict)  # key -> the block it fills
    fills: list[Filling] = attrs.field(factory=list)  # a deposit's batches being filled
    memory: MemoryState = MemoryState.CLEAR  # what was reported of ``framework``
    remote: RemotePart = attrs.field(factory=RemotePart)
    moved: int = 0  # local keys whose bytes were transferred
    ok: int = 0  # keys answered with success (each key is answered once)
    ok_remote: int = 0  # ... of them, keys the peer was asked for
    failure: str | None = None
    phases: list[Phase] | None = None  # child spans (tracing on only: ``tracing.py``)

    @property
    def deadline(self) -> float:
        return self.clock.deadline

    @property
    def abandon_at(self) -> float:
        return self.clock.abandon_at

    def restart_clock(self, start: float, config: Any) -> None:
        """Measure both deadlines from ``start`` from now on (a peer link's one-time setup
        is bounded on its own; the operation's timeouts then cover its transfer)."""
        self.clock = Deadlines.starting(start, config)
        self.scope.deadline = self.clock.deadline

    def live(self, key: BlockKey) -> bool:
        """Still waiting for an answer (abort answers a key, so withdrawn keys are not)."""
        return key in self.pending


class Outbox:
    """Results and resilience events on their way to the engine thread (``poll_completed``).
    Events go out as engine calls (``on_resilience_event``), each one before the results it
    explains."""

    def __init__(self, open_ops: dict[int, set[BlockKey]], calls: EngineCalls) -> None:
        self.results: deque[OpResult] = deque()
        self.failed_hints: deque[object] = deque()  # request ids whose hint failed
        self._open_ops = open_ops
        self._calls = calls

    def report(self, error: TransferError) -> None:
        self._calls.resilience(error)

    def pending_set(self, handle: int) -> set[BlockKey]:
        """The pending set the facade created when the operation was submitted."""
        return self._open_ops.get(handle, set())

    def answer_empty(self, handle: int) -> None:
        self._open_ops.pop(handle, None)
        self.results.append((handle, {}))

    def answer_all(self, op: Operation, keys: Sequence[BlockKey], entry: OpEntryResult) -> int:
        """:meth:`answer` with one entry for all ``keys``, as most answers are; returns how
        many were still pending (answered now)."""
        pending = op.pending
        live = keys if pending.issuperset(keys) else [k for k in keys if k in pending]
        if live:
            self._answered(op, dict.fromkeys(live, entry), entry)
        return len(live)

    def answer(self, op: Operation, entries: Mapping[BlockKey, OpEntryResult]) -> None:
        fresh = {k: v for k, v in entries.items() if k in op.pending}
        if not fresh:
            return
        if len(set(map(id, fresh.values()))) == 1:  # one answer for all, as usual
            self._answered(op, fresh, next(iter(fresh.values())))
        else:
            self._answered(op, fresh, None)

    def _answered(
        self, op: Operation, fresh: dict[BlockKey, OpEntryResult], entry: OpEntryResult | None
    ) -> None:
        """Send ``fresh`` (pending keys' answers; ``entry``: the one they all have)."""
        failed: list[BlockKey] = []
        if entry is not None:
            ok = list(fresh) if entry.success and op.remote.keys else None
            if entry.success:
                op.ok += len(fresh)
            elif entry.status is OpEntryStatus.FAILED:
                failed = list(fresh)
        else:
            ok = []
            for key, each in fresh.items():
                if each.success:
                    ok.append(key)
                elif each.status is OpEntryStatus.FAILED:
                    failed.append(key)
            op.ok += len(ok)
        if ok and op.remote.keys:
            op.ok_remote += len(op.remote.keys.intersection(ok))
        if failed and any(not keys.isdisjoint(failed) for keys in op.xfers.values()):
            self._report_uncertain(op)
        op.pending.difference_update(fresh)
        self.results.append((op.handle, fresh))
        if not op.pending:
            self._open_ops.pop(op.handle, None)

    def fail_pending(self, op: Operation, reason: str) -> None:
        if not op.pending:  # all answered: ``reason`` (say "closed") would be a false one
            return
        op.failure = op.failure or reason
        self.answer(op, dict.fromkeys(list(op.pending), FAILED))

    def xfer_terminal(self, op: Operation, xfer: Xfer | RemotePull) -> None:
        op.xfers.pop(xfer, None)
        if op.memory is MemoryState.UNCERTAIN and not op.xfers:
            self._report(op, MemoryEvent.TRANSFERS_OVER)

    def _report_uncertain(self, op: Operation) -> None:
        if op.memory is MemoryState.CLEAR and op.framework:
            self._report(op, MemoryEvent.MAY_TOUCH)

    def _report(self, op: Operation, event: MemoryEvent) -> None:
        op.memory = FRAMEWORK_MEMORY.move(op.memory, event, f"{op.kind} op {op.handle}")
        self.report(self._transfer_error(op, op.memory))

    @staticmethod
    def _transfer_error(op: Operation, state: MemoryState) -> TransferError:
        verb = "may still touch" if state is MemoryState.UNCERTAIN else "no longer touches"
        message = (
            f"{op.kind} op {op.handle}: {op.failure or 'failed'}; a transfer {verb} "
            "framework memory"
        )
        sources, destinations = op.framework.sources, op.framework.destinations
        return TransferError(
            message,
            op.handle,
            state=state.value,
            source_blocks=sources or None,
            source_owners=("framework",) if sources else None,
            destination_regions=destinations or None,
            destination_owner="framework" if destinations else None,
        )


SCOPES = {
    OpKind.DEPOSIT: SCOPE_LOCAL_FILL,
    OpKind.DELIVER: SCOPE_LOCAL_DELIVER,
    OpKind.FETCH: SCOPE_LOCAL_FETCH,
}
REMOTE_SCOPES = {OpKind.DELIVER: "remote_deliver", OpKind.FETCH: "remote_fetch"}


def record(op: Operation, telemetry: Any, memory: Any, log: Any) -> None:
    """An ended operation's telemetry (local and remote parts apart), and its op_failed
    event when some of its keys failed."""
    seconds = trio.current_time() - op.asked
    pools, per_key = len(memory.block_sizes), memory.bytes_per_key
    remote_keys = op.remote.keys
    local_keys = len(op.keys) - len(remote_keys)
    if local_keys or not remote_keys:
        ok = op.ok - op.ok_remote
        telemetry.operation(
            SCOPES[op.kind], seconds, ok, local_keys, op.moved * pools, op.moved * per_key
        )
    if remote_keys:
        ok, moved = op.ok_remote, op.remote.moved
        telemetry.operation(
            REMOTE_SCOPES[op.kind], seconds, ok, len(remote_keys), moved * pools, moved * per_key
        )
        if op.remote.hint_age:  # measured only with telemetry on
            telemetry.operation("hint_age", op.remote.hint_age, ok, len(remote_keys), 0, 0)
    if telemetry.tracing is not None:
        _trace(op, telemetry.tracing)
    if op.failure and op.ok < len(op.keys):
        log.info(
            "op_failed",
            op=op.handle,
            kind=op.kind.value,
            failed=len(op.keys) - op.ok,
            reason=op.failure,
            **({"xfer": op.remote.xfer} if op.remote.xfer is not None else {}),
        )


def _trace(op: Operation, tracing: Tracing) -> None:
    """The operation's span (``kvcr.deposit``, ``kvcr.deliver``, ``kvcr.fetch``): its
    counts, its last pull's transfer id, and its phases as children."""
    attributes: dict[str, str | int] = {
        "kvcr.op": op.handle,
        "kvcr.keys": len(op.keys),
        "kvcr.succeeded": op.ok,
    }
    if op.remote.keys:
        attributes["kvcr.remote_keys"] = len(op.remote.keys)
        attributes["kvcr.remote_succeeded"] = op.ok_remote
        if op.remote.hint_age:
            attributes["kvcr.hint_age_us"] = int(op.remote.hint_age * 1e6)
    if op.remote.xfer is not None:
        attributes["kvcr.xfer"] = op.remote.xfer
    error = (op.failure or "failed") if op.ok < len(op.keys) else None
    tracing.emit(f"kvcr.{op.kind.value}", op.asked, attributes, op.phases or (), error)
