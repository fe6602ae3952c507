"""Engine pins: asking the framework to hold its own memory while a peer reads it.

``request_pin(keys)`` returns at once with a request id; results come from
``poll_pin_results()``, which the runtime polls only while requests are outstanding. A
result names, per key, the engine refs that hold it. A result counts as a miss unless it
names exactly the requested keys with at least one non-None entry.

``release_pin(handle)`` must be retried until it returns True: False or an exception
means "not now". Releases are retried with backoff by one task, so a pin is never
forgotten, and never released before the transfer reading it is terminal (the caller's job).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import trio

from kvcr.runtime.timer import sleeper
from kvcr.types import BlockKey, MemoryRef, PinHandle, PinRequestId, PinResult

POLL_S = 0.0002  # with the fine timer; trio's own sleep rounds it up to ~1 ms
# A pin granted after its request was given up is still collected and released, for this
# long after the request (engines without cancel_pin_request grant it anyway).
ABANDONED_POLL_S = 30.0
RELEASE_RETRY_FIRST_S = 0.01
RELEASE_RETRY_MAX_S = 1.0


@attrs.define(eq=False)
class Pin:
    """A granted pin: the engine holds ``refs[key]`` until ``handle`` is released."""

    handle: PinHandle
    refs: Mapping[BlockKey, list[MemoryRef] | None]


@attrs.define(eq=False)
class _Waiter:
    keys: tuple[BlockKey, ...]
    done: trio.Event = attrs.field(factory=trio.Event)
    pin: Pin | None = None


class Pins:
    def __init__(
        self,
        request_pin: Callable[[list[BlockKey]], PinRequestId],
        poll_pin_results: Callable[[], Iterable[tuple[PinRequestId, PinResult]]],
        release_pin: Callable[[PinHandle], bool],
        cancel_pin_request: Callable[[PinRequestId], None] | None,
        log: Any,
        fine: bool = False,
    ) -> None:
        self._fine = fine
        self._request = request_pin
        self._poll = poll_pin_results
        self._release = release_pin
        self._cancel = cancel_pin_request
        self._log = log
        self._waiting: dict[PinRequestId, _Waiter] = {}
        self._abandoned: dict[PinRequestId, float] = {}  # request -> poll until (trio time)
        self._to_release: list[PinHandle] = []
        self._work = trio.Event()

    @property
    def outstanding(self) -> int:
        return len(self._waiting) + len(self._to_release)

    async def pin(self, keys: Sequence[BlockKey]) -> Pin | None:
        """Ask the engine to pin ``keys``; None on a miss or a refusal. If the caller is
        cancelled while waiting, the request is cancelled, and a pin granted later is
        released."""
        try:
            request = self._request(list(keys))
        except Exception as exc:
            self._log.warning("request_pin_failed", keys=len(keys), error=repr(exc))
            return None
        waiter = _Waiter(tuple(keys))
        self._waiting[request] = waiter
        self._absorb()  # an engine that answers at once costs no poll period
        if not waiter.done.is_set():
            self._work.set()
        try:
            await waiter.done.wait()
        except BaseException:
            if self._waiting.pop(request, None) is not None:
                self._cancel_request(request)
                self._abandoned[request] = trio.current_time() + ABANDONED_POLL_S
            elif waiter.pin is not None:
                self.release(waiter.pin)
            raise
        return waiter.pin

    def release(self, pin: Pin) -> None:
        """Hand the pin back to the engine, retrying until it accepts."""
        if not self._try_release(pin.handle):
            self._to_release.append(pin.handle)
            self._work.set()

    async def drain(self, timeout: float) -> bool:
        """At close: keep handing pins back until the engine accepts them all, for at most
        ``timeout`` seconds. True if none is left."""
        with trio.move_on_after(timeout):
            while self._to_release:
                pending, self._to_release = self._to_release, []
                for handle in pending:
                    if not self._try_release(handle):
                        self._to_release.append(handle)
                if self._to_release:
                    await trio.sleep(RELEASE_RETRY_FIRST_S)
        if self._to_release:
            self._log.error("pins_not_released", pins=len(self._to_release))
        return not self._to_release

    def _cancel_request(self, request: PinRequestId) -> None:
        if self._cancel is None:
            return
        try:
            self._cancel(request)
        except Exception as exc:
            self._log.warning("cancel_pin_request_failed", error=repr(exc))

    def _try_release(self, handle: PinHandle) -> bool:
        try:
            return self._release(handle) is True
        except Exception as exc:
            self._log.info("release_pin_retry", error=repr(exc))
            return False

    def _absorb(self) -> None:
        try:
            results = list(self._poll())
        except Exception as exc:
            self._log.warning("poll_pin_results_failed", error=repr(exc))
            return
        for item in results:
            try:
                request, result = item
            except (TypeError, ValueError):
                self._log.warning("pin_result_malformed", item=repr(item)[:80])
                continue
            waiter = self._waiting.pop(request, None)
            self._abandoned.pop(request, None)
            pin = _valid(result, waiter.keys) if waiter is not None else None
            handle = result[0] if isinstance(result, tuple) and len(result) == 2 else None
            if pin is None and handle is not None:
                # A miss, an unusable result, or a request nobody waits for any more.
                self._log.info("pin_result_unused", request=request)
                self.release(Pin(handle, {}))
            if waiter is not None:
                waiter.pin = pin
                waiter.done.set()

    def _polling(self) -> bool:
        if self._abandoned:
            now = trio.current_time()
            for request, until in list(self._abandoned.items()):
                if until <= now:
                    del self._abandoned[request]
                    self._log.warning("pin_request_forgotten", request=request)
        return bool(self._waiting or self._abandoned)

    async def run(self) -> None:
        sleep, close = sleeper(self._fine)
        try:
            await self._run(sleep)
        finally:
            close()

    async def _run(self, sleep: Any) -> None:
        retry = RELEASE_RETRY_FIRST_S
        while True:
            if not self._polling() and not self._to_release:
                self._work = trio.Event()
                await self._work.wait()
                retry = RELEASE_RETRY_FIRST_S
            if self._polling():
                await sleep(POLL_S)
                self._absorb()
            if self._to_release:
                if not self._polling():
                    await trio.sleep(retry)
                pending, self._to_release = self._to_release, []
                for handle in pending:
                    if not self._try_release(handle):
                        self._to_release.append(handle)
                retry = (
                    min(retry * 2, RELEASE_RETRY_MAX_S)
                    if self._to_release
                    else RELEASE_RETRY_FIRST_S
                )


def _valid(result: object, keys: Sequence[BlockKey]) -> Pin | None:
    """The pin in ``result`` if it is usable for ``keys``, else None (a miss)."""
    if not isinstance(result, tuple) or len(result) != 2:
        return None
    handle, refs = result
    if handle is None or not isinstance(refs, Mapping) or set(refs) != set(keys):
        return None
    if all(v is None for v in refs.values()):
        return None
    return Pin(handle, dict(refs))
