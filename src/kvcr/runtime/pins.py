"""Engine pins: asking the framework to hold its own memory while a peer reads it.

The runtime decides; the engine is called only on its own thread (``engine_calls``). A pin
is asked for with a ticket (``RequestPin``); the engine's poll makes the ``request_pin``
call and collects ``poll_pin_results`` until the result comes. A result counts as a miss
unless it names exactly the requested keys with at least one non-None entry; the handle of
a result nobody can use (a miss, a late answer to a request given up on, an answer to a
request never made) is released at once, except one naming a pin this instance holds
(an engine answering twice must not make kvcr release memory a write still reads).

``release_pin(handle)`` must be retried until it returns True: False or an exception
means "not now". A refused release is asked again after 10 ms, doubling up to 1 s, until the
engine accepts (at ``close``, until the drain's deadline, then ``pins_not_released`` names
what is left); a pin is never released before the transfer reading it is terminal (the
caller's job).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import trio

from kvcr.runtime.engine_calls import (
    Answer,
    CancelPin,
    EngineCalls,
    ForgetPin,
    PinAnswered,
    PinRequestFailed,
    Released,
    ReleasePin,
    RequestPin,
)
from kvcr.runtime.inbox import Inbox
from kvcr.types import BlockKey, MemoryRef, PinHandle

# A pin granted after its request was given up is still collected and released, for this
# long after the request (engines without cancel_pin_request grant it anyway).
ABANDONED_POLL_S = 30.0
RELEASE_RETRY_FIRST_S = 0.01
RELEASE_RETRY_MAX_S = 1.0
RELEASE_REFUSALS_REPORTED = 10  # a release refused this often is reported (warning)


@attrs.define(eq=False)
class Pin:
    """A granted pin: the engine holds ``refs[key]`` until ``handle`` is released."""

    handle: PinHandle
    refs: Mapping[BlockKey, list[MemoryRef] | None]
    what: str = ""  # the operation it was pinned for, for logs


@attrs.define(eq=False)
class _Waiter:
    keys: tuple[BlockKey, ...]
    what: str
    done: trio.Event = attrs.field(factory=trio.Event)
    pin: Pin | None = None


@attrs.define(eq=False)
class _Release:
    handle: PinHandle
    held: bool  # a pin this instance was granted (else a handle it never used)
    what: str
    asked: bool = True  # waiting for the engine's answer (else: for ``due``)
    due: float = 0.0
    retry: float = RELEASE_RETRY_FIRST_S
    refusals: int = 0


class Pins:
    def __init__(self, calls: EngineCalls, answers: Inbox, log: Any) -> None:
        self._calls = calls
        self._answers = answers
        self._log = log
        self._tickets = itertools.count(1)
        self._waiting: dict[int, _Waiter] = {}
        # ticket -> (collect until, in trio time; the operation it was for)
        self._abandoned: dict[int, tuple[float, str]] = {}
        self._releasing: dict[int, _Release] = {}
        self._held: Counter[PinHandle] = Counter()  # granted, not released yet
        self._changed = trio.Event()
        self._closing = False

    @property
    def abandoned(self) -> int:
        """Requests given up on whose answer may still come (released when it does)."""
        return len(self._abandoned)

    @property
    def outstanding(self) -> int:
        """Requests not answered and releases not accepted yet."""
        return len(self._waiting) + len(self._releasing)

    async def pin(self, keys: Sequence[BlockKey], what: str = "") -> Pin | None:
        """Ask the engine to pin ``keys`` for the operation ``what``; None on a miss or a
        refusal. If the caller is cancelled while waiting, the request is cancelled, and a
        pin granted later is released."""
        ticket = next(self._tickets)
        waiter = _Waiter(tuple(keys), what)
        self._waiting[ticket] = waiter
        self._calls.put(RequestPin(ticket, waiter.keys))
        try:
            await waiter.done.wait()
        except BaseException:
            if self._waiting.pop(ticket, None) is not None:
                self._calls.put(CancelPin(ticket))
                self._abandoned[ticket] = (trio.current_time() + ABANDONED_POLL_S, what)
                self._wake()
            elif waiter.pin is not None:
                self.release(waiter.pin)
            raise
        return waiter.pin

    def release(self, pin: Pin) -> None:
        """Hand the pin back to the engine, retrying until it accepts."""
        self._release(pin.handle, True, pin.what)

    async def drain(self, timeout: float) -> bool:
        """At close: wait until the engine accepted every release, for at most ``timeout``
        seconds (refused ones are asked again every 10 ms meanwhile). True if none is left."""
        self._closing = True
        soon = trio.current_time() + RELEASE_RETRY_FIRST_S
        for release in self._releasing.values():
            release.due, release.retry = min(release.due, soon), RELEASE_RETRY_FIRST_S
        self._wake()
        # An engine that cannot be told a request was given up may still grant it: its
        # answer is waited for too, so that the pin goes back before kvcr stops listening.
        late = () if self._calls.can_cancel else self._abandoned
        with trio.move_on_after(timeout):
            while self._releasing or late:
                await self._changed.wait()
        if self._releasing:
            handles = sorted({str(r.handle) for r in self._releasing.values()})
            self._log.error("pins_not_released", pins=len(self._releasing), handles=handles[:8])
        if late:
            self._log.warning(
                "pin_requests_unanswered",
                requests=len(late),
                reason="given up and not answered by close; a pin granted for them now is not released",
            )
        return not self._releasing

    async def run(self) -> None:
        """Take the engine's answers and keep the schedule: refused releases asked again,
        abandoned requests forgotten."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._take_answers)
            await self._keep_schedule()

    # -- answers -----------------------------------------------------------------------------

    async def _take_answers(self) -> None:
        while True:
            for batch in await self._answers.get_batch():
                for answer in batch:
                    try:
                        self._on_answer(answer)
                    except Exception as exc:  # a bug here must not stop every later pin
                        self._log.exception(
                            "pin_answer_failed", answer=repr(answer)[:120], error=repr(exc)
                        )
            self._wake()

    def _on_answer(self, answer: Answer) -> None:
        if isinstance(answer, PinAnswered):
            self._on_result(answer)
        elif isinstance(answer, Released):
            self._on_released(answer)
        else:
            self._on_request_failed(answer)

    def _on_request_failed(self, answer: PinRequestFailed) -> None:
        waiter = self._waiting.pop(answer.ticket, None)
        self._abandoned.pop(answer.ticket, None)
        self._log.warning(
            "request_pin_failed",
            op=waiter.what if waiter is not None else "",
            keys=len(waiter.keys) if waiter is not None else 0,
            error=answer.error,
        )
        if waiter is not None:
            waiter.done.set()  # a miss

    def _on_result(self, answer: PinAnswered) -> None:
        ticket, request, result = answer.ticket, answer.request, answer.result
        waiter = self._waiting.pop(ticket, None) if ticket is not None else None
        abandoned = self._abandoned.pop(ticket, None) if ticket is not None else None
        what = waiter.what if waiter is not None else abandoned[1] if abandoned else ""
        handle = _handle(result)
        pin = _valid(result, waiter.keys, waiter.what) if waiter is not None else None
        if pin is not None:
            self._held[pin.handle] += 1
        elif handle is not None:
            if self._held[handle] or (answer.repeated and _handle(answer.earlier) == handle):
                # A pin a write may be reading, or the same pin again (an answer repeated):
                # releasing it would free memory under a write, or release one pin twice.
                self._log.warning(
                    "pin_result_repeated", request=request, handle=handle, released=False
                )
            else:
                self._unused(request, ticket, what, abandoned is not None, answer.repeated)
                self._release(handle, False, what)
        elif ticket is None:
            self._log.warning(
                "pin_result_unknown", request=request, repeated=answer.repeated, released=False
            )
        if waiter is not None:
            waiter.pin = pin
            waiter.done.set()

    def _unused(
        self, request: object, ticket: int | None, what: str, late: bool, repeated: bool
    ) -> None:
        if ticket is not None:
            # A miss or an unusable result, or a request nobody waits for any more.
            self._log.info("pin_result_unused", op=what, request=request, late=late)
        else:
            event = "pin_result_repeated" if repeated else "pin_result_unknown"
            self._log.warning(event, request=request, released=True)

    def _on_released(self, answer: Released) -> None:
        release = self._releasing.get(answer.ticket)
        if release is None:
            return
        if answer.accepted:
            del self._releasing[answer.ticket]
            if release.held:
                self._held[release.handle] -= 1
                if not self._held[release.handle]:
                    del self._held[release.handle]
            return
        release.refusals += 1
        release.asked = False
        release.due = trio.current_time() + release.retry
        if not self._closing:  # at close, every 10 ms until the drain's deadline
            release.retry = min(release.retry * 2, RELEASE_RETRY_MAX_S)
        self._log.info(
            "release_pin_retry", op=release.what, handle=release.handle, error=answer.why
        )
        if release.refusals == RELEASE_REFUSALS_REPORTED:
            self._log.warning(
                "pin_release_refused",
                op=release.what,
                handle=release.handle,
                refusals=release.refusals,
                reason=f"release_pin {answer.why}; asked again every {RELEASE_RETRY_MAX_S:g} s",
            )

    # -- schedule ----------------------------------------------------------------------------

    def _release(self, handle: PinHandle, held: bool, what: str) -> None:
        ticket = next(self._tickets)
        self._releasing[ticket] = _Release(handle, held, what)
        self._calls.put(ReleasePin(ticket, handle))

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _keep_schedule(self) -> None:
        while True:
            now = trio.current_time()
            due = [t for t, r in self._releasing.items() if not r.asked and r.due <= now]
            for ticket in due:
                release = self._releasing[ticket]
                release.asked = True
                self._calls.put(ReleasePin(ticket, release.handle))
            for ticket in [t for t, (until, _) in self._abandoned.items() if until <= now]:
                _, what = self._abandoned.pop(ticket)
                self._calls.put(ForgetPin(ticket))
                self._log.warning(
                    "pin_request_forgotten",
                    op=what,
                    reason=f"no result {ABANDONED_POLL_S:g} s after the request was given up",
                )
            times = [r.due for r in self._releasing.values() if not r.asked]
            times.extend(until for until, _ in self._abandoned.values())
            changed = self._changed
            with trio.move_on_at(min(times, default=float("inf"))):
                await changed.wait()


def _handle(result: object) -> PinHandle | None:
    """The handle a pin result carries, if it is one that could be released."""
    if not isinstance(result, tuple) or len(result) != 2 or result[0] is None:
        return None
    try:
        hash(result[0])
    except TypeError:
        return None
    return result[0]  # type: ignore[no-any-return]


def _valid(result: object, keys: Sequence[BlockKey], what: str) -> Pin | None:
    """The pin in ``result`` if it is usable for ``keys``, else None (a miss)."""
    handle = _handle(result)
    if handle is None:
        return None
    refs = result[1]  # type: ignore[index]
    if not isinstance(refs, Mapping) or set(refs) != set(keys):
        return None
    if all(v is None for v in refs.values()):
        return None
    return Pin(handle, dict(refs), what)
