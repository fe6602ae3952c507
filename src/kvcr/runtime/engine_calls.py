"""Calls into the engine, made on the engine's own thread (contract section 4).

Adapters keep their pin tables and event lists in plain Python structures without locks,
because every framework callback reaches them on the engine's thread, inside a call the
engine is making. So the runtime thread never calls engine code. When it needs the engine,
it appends a request to :class:`EngineCalls` (a deque: one append is atomic under the GIL);
the engine's next ``poll_completed()`` (also ``get_stats()`` and ``close()``) runs
:meth:`EngineSide.serve`, which makes the calls in the order they were asked for, on the
caller's thread, one caller at a time, and hands what the engine answered back to the
runtime through an inbox, in order::

    runtime thread                                 engine thread, inside poll_completed()
    Pins ── RequestPin(ticket, keys) ───────────▶  request_pin(keys) -> request id
         ◀── PinRequestFailed(ticket, why) ─────    (only if it raised or gave no usable id)
                                                   poll_pin_results()  (while any request
         ◀── PinAnswered(ticket, request, result)   made here is unanswered)
         ── CancelPin / ForgetPin(ticket) ──────▶  cancel_pin_request(request) / stop polling
         ── ReleasePin(ticket, handle) ─────────▶  release_pin(handle)
         ◀── Released(ticket, accepted, why) ───
    index, ops ── Notify(binding, value) ───────▶  inventory_sink, capacity_needed_callback,
                                                   on_resilience_event (no answer)

The engine side owns one table, request id -> ticket, of the requests it made whose result
has not come back; it is touched only while serving. The runtime owns every decision
(which result is usable, what to release, when to retry), so nothing here needs the
runtime's state, and the answers it sends are facts: what the engine was asked, and what it
said. A callback that raises or answers nonsense is logged with the binding and the request,
and the call's answer says so; nothing raises out of ``serve``.

Latency: a pin costs one to two of the engine's polls (the request goes out in one, the
engine answers it, the next poll collects the result), the price the contract names.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from kvcr.runtime.inbox import Inbox
from kvcr.types import BlockKey, InventoryEvent, PinHandle

ANSWERED_REMEMBERED = 4096  # request ids whose result came, to tell a repeat from a stranger


# -- what the runtime asks ------------------------------------------------------------------


@attrs.frozen
class RequestPin:
    ticket: int
    keys: tuple[BlockKey, ...]


@attrs.frozen
class CancelPin:
    """The runtime gave up waiting: tell the engine, keep collecting a late result."""

    ticket: int


@attrs.frozen
class ForgetPin:
    """Stop polling for this request (its result never came)."""

    ticket: int


@attrs.frozen
class ReleasePin:
    ticket: int
    handle: PinHandle


@attrs.frozen
class Notify:
    """Call ``binding`` with ``value``; nothing comes back."""

    binding: str  # "inventory_sink" | "capacity_needed_callback" | "on_resilience_event"
    value: object


Call = RequestPin | CancelPin | ForgetPin | ReleasePin | Notify


# -- what the engine answered ---------------------------------------------------------------


@attrs.frozen
class PinRequestFailed:
    """``request_pin`` raised or gave no usable request id: the ticket gets no result."""

    ticket: int
    error: str


@attrs.frozen
class PinAnswered:
    """One item of ``poll_pin_results``. ``ticket`` is None when the request id is not one
    this instance is waiting for; ``repeated`` then says whether it was answered before, and
    ``earlier`` is what that first answer was."""

    ticket: int | None
    request: object
    result: object
    repeated: bool = False
    earlier: object = None


@attrs.frozen
class Released:
    ticket: int
    accepted: bool
    why: str | None = None  # what the engine said instead of True


Answer = PinRequestFailed | PinAnswered | Released


class EngineCalls:
    """The runtime's side: requests for the engine, in order. Only the runtime appends;
    only :class:`EngineSide` pops."""

    def __init__(self, present: frozenset[str], log: Any) -> None:
        self.queue: deque[Call] = deque()
        self._present = present  # optional bindings the engine gave
        self._log = log

    @property
    def can_cancel(self) -> bool:
        """Whether the engine can be told that a pin request was given up."""
        return "cancel_pin_request" in self._present

    def put(self, call: Call) -> None:
        self.queue.append(call)

    @property
    def wants_inventory(self) -> bool:
        """Whether the engine takes inventory events (nobody does in the guard)."""
        return "inventory_sink" in self._present

    def inventory(self, event: InventoryEvent) -> None:
        if "inventory_sink" in self._present:
            self.queue.append(Notify("inventory_sink", event))

    def capacity_needed(self, pools: list[tuple[str, int]]) -> None:
        if "capacity_needed_callback" in self._present:
            self.queue.append(Notify("capacity_needed_callback", pools))

    def resilience(self, error: Exception) -> None:
        if "on_resilience_event" in self._present:
            self.queue.append(Notify("on_resilience_event", error))
        else:  # the contract's default: log it (logging is ours, not the engine's code)
            self._log.warning("resilience_event", error=str(error), kind=type(error).__name__)


class EngineSide:
    """The engine's side: makes the queued calls on the caller's thread (``serve``)."""

    def __init__(
        self,
        bindings: Any,
        calls: EngineCalls,
        answers: Inbox,
        log: Any,
        also: Callable[[], None] = lambda: None,
        also_due: Callable[[], bool] = lambda: False,
    ) -> None:
        self._bindings = bindings
        self._queue = calls.queue
        self._answers = answers
        self._log = log
        self._also = also  # more engine-thread work for every serve (telemetry samples)
        self._also_due = also_due  # whether ``also`` has anything to do
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._waiting: dict[object, int] = {}  # request id -> ticket, result not come yet
        self._requests: dict[int, object] = {}  # ticket -> request id, the same entries
        self._answered: OrderedDict[object, object] = OrderedDict()  # request -> its result
        self._closed = False

    def idle(self) -> bool:
        """Nothing to call, collect or flush (any thread, no lock: three reads). The
        engine polls at every scheduler step and most polls find nothing: such a poll
        skips its turn, which costs a lock and a context manager (~1.5 us)."""
        return not self._queue and not self._waiting and not self._also_due()

    @property
    def polling(self) -> bool:
        """Whether a request made here still waits for its result."""
        return bool(self._waiting)

    @contextlib.contextmanager
    def turn(self, wait: bool = False, nested: bool = False) -> Iterator[bool]:
        """This thread's turn at the engine calls: yields True if it may make them now.
        One thread at a time: while another has the turn, a caller gets False at once
        (``wait=False``) or waits (``get_stats``, ``close``). A callback that calls back
        into KVCR on the same thread gets False (making calls there would reorder them),
        unless ``nested`` (``close`` from a callback must still hand pins back)."""
        me = threading.get_ident()
        if self._owner == me:
            yield nested
            return
        if not self._lock.acquire(blocking=wait):
            yield False
            return
        self._owner = me
        try:
            yield True
        finally:
            self._owner = None
            self._lock.release()

    def serve(self) -> None:
        """Within a turn: make every queued call, collect pin results if any request waits,
        and hand the answers to the runtime. A call interrupted by a BaseException
        (KeyboardInterrupt) is made again at the next serve: at least once, never lost."""
        answers: list[Answer] = []
        try:
            queue = self._queue
            while queue:
                call = queue.popleft()
                try:
                    self._make(call, answers)
                except BaseException:
                    queue.appendleft(call)
                    raise
            if self._waiting:  # right after the requests: an engine that pins at once
                self._collect(answers)  # costs no poll period
            self._also()
        finally:
            if answers and not self._closed:
                self._answers.put(answers)

    def close(self) -> None:
        """Within a turn, once the runtime has stopped: stop polling for results nobody will
        take, and give the answers' eventfd back."""
        self._closed = True
        self._waiting.clear()
        self._requests.clear()
        self._answers.close()

    # -- the calls ---------------------------------------------------------------------------

    def _make(self, call: Call, answers: list[Answer]) -> None:
        if isinstance(call, Notify):
            self._notify(call)
        elif isinstance(call, RequestPin):
            if (failed := self._request(call)) is not None:
                answers.append(failed)
        elif isinstance(call, ReleasePin):
            answers.append(self._release(call))
        elif isinstance(call, CancelPin):
            self._cancel(call.ticket)
        else:
            request = self._requests.pop(call.ticket, None)
            self._waiting.pop(request, None)

    def _notify(self, call: Notify) -> None:
        callback = getattr(self._bindings, call.binding)
        try:
            callback(call.value)
        except Exception as exc:
            self._log.error("engine_callback_failed", callback=call.binding, error=repr(exc))

    def _request(self, call: RequestPin) -> PinRequestFailed | None:
        try:
            request = self._bindings.request_pin(list(call.keys))
        except Exception as exc:
            return PinRequestFailed(call.ticket, f"request_pin raised {exc!r}")
        try:
            why = (
                "None"
                if request is None
                else "an unanswered request has it"
                if request in self._waiting
                else ""
            )
        except TypeError:  # unhashable: it could never be matched to a result
            why = "unhashable"
        if why:
            return PinRequestFailed(
                call.ticket, f"request_pin returned {request!r:.80}, not a new request id ({why})"
            )
        self._waiting[request] = call.ticket
        self._requests[call.ticket] = request
        return None

    def _release(self, call: ReleasePin) -> Released:
        try:
            answer = self._bindings.release_pin(call.handle)
        except Exception as exc:
            return Released(call.ticket, False, f"raised {exc!r}")
        if answer is True:
            return Released(call.ticket, True)
        return Released(call.ticket, False, f"returned {answer!r:.80}")

    def _cancel(self, ticket: int) -> None:
        cancel = self._bindings.cancel_pin_request
        request = self._requests.get(ticket)
        if cancel is None or request is None:
            return
        try:
            cancel(request)
        except Exception as exc:
            self._log.warning("cancel_pin_request_failed", request=request, error=repr(exc))

    def _collect(self, answers: list[Answer]) -> None:
        items: list[Any] = []
        try:
            items.extend(self._bindings.poll_pin_results())
        except Exception as exc:
            self._log.warning("poll_pin_results_failed", error=repr(exc))
        finally:  # what it yielded before it failed (or was interrupted) still counts
            self._take(items, answers)

    def _take(self, items: list[Any], answers: list[Answer]) -> None:
        for item in items:
            try:
                request, result = item
                ticket = self._waiting.pop(request, None)
            except (TypeError, ValueError):
                self._log.warning("pin_result_malformed", item=repr(item)[:80])
                continue
            if ticket is not None:
                del self._requests[ticket]
                self._answered[request] = result
                if len(self._answered) > ANSWERED_REMEMBERED:
                    self._answered.popitem(last=False)
                answers.append(PinAnswered(ticket, request, result))
            elif request in self._answered:
                earlier = self._answered[request]
                answers.append(PinAnswered(None, request, result, True, earlier))
            else:
                answers.append(PinAnswered(None, request, result))
