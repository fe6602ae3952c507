"""Telemetry: metric names, scopes, and the recorder the runtime writes through.

The engine supplies ``stats_factory``; each ``get_stats()`` hands back the current interval's
stats object and starts a fresh one. The runtime thread records samples into a deque; the
engine's thread applies them to the stats object, so a sample is never recorded into an
interval that was already handed out, and the engine's object is never called from a
thread of kvcr's.

Labels are bounded categories (scope, result, resource): never keys, request ids or
endpoints.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from kvcr.engine_protocols import TelemetryStats
from kvcr.tracing import Tracing

DURATION_METRIC = "kvcr_duration_seconds"
TRANSFER_BYTES_METRIC = "kvcr_transfer_bytes"
TRANSFER_BLOCKS_METRIC = "kvcr_transfer_blocks"
STATE_METRIC = "kvcr_state"

SCOPE_LOCAL_FILL = "local_fill"
SCOPE_LOCAL_DELIVER = "local_deliver"
SCOPE_LOCAL_FETCH = "local_fetch"
SCOPE_G3_STORE = "g3_store"
SCOPE_G3_FILL = "g3_fill"
SCOPE_G3_DELIVER = "g3_deliver"
SCOPE_G3_SERVE = "g3_serve"  # G3 blocks read into bounce slots for a peer's pull

# The block funnel of a peer pull, counted in kvcr_transfer_blocks by stage (the contract
# gives that counter the one label ``scope``, so the stage is in it): the destination
# counts what it planned (the keys it asked for), what the source reported written
# (completed) and what it answered the engine with (published); the source counts what it
# found (resident: in G2, in G3, or pinned by its engine), what it held for the write
# (claimed, staged from G3 or pinned) and what it submitted in the write.
FUNNEL_PLANNED = "peer_planned"
FUNNEL_RESIDENT = "peer_resident"
FUNNEL_HELD = "peer_held"
FUNNEL_SUBMITTED = "peer_submitted"
FUNNEL_COMPLETED = "peer_completed"
FUNNEL_PUBLISHED = "peer_published"
FUNNEL = (
    FUNNEL_PLANNED,
    FUNNEL_RESIDENT,
    FUNNEL_HELD,
    FUNNEL_SUBMITTED,
    FUNNEL_COMPLETED,
    FUNNEL_PUBLISHED,
)

RESULT_SUCCESS = "success"
RESULT_PARTIAL = "partial"
RESULT_FAILED = "failed"

Number = int | float


def result_label(succeeded: int, total: int) -> str:
    if total and succeeded == total:
        return RESULT_SUCCESS
    return RESULT_PARTIAL if succeeded else RESULT_FAILED


class Telemetry:
    """Records into the current interval's stats object; a no-op when disabled.

    The stats object is the engine's (``stats_factory``), so only the engine's thread calls
    it (contract section 4): the runtime appends samples to a deque, and the engine's own
    calls (``poll_completed``, ``get_stats``) apply them (``flush``) and swap the interval
    (``snapshot``), one caller at a time (``EngineSide.serve``).
    """

    def __init__(
        self,
        factory: Callable[[], TelemetryStats] | None,
        gauges: Callable[[], Mapping[str, Number]],
        log: Any = None,
        tracing: Tracing | None = None,
    ) -> None:
        """``tracing``: spans for ended operations, where the process has OpenTelemetry
        (``tracing.py``); None otherwise, and always when telemetry is off."""
        self.tracing = tracing
        self._factory = factory
        self._gauges = gauges
        self._log = log
        # (scope, seconds or None for a count alone, result, blocks, bytes)
        self._samples: deque[tuple[str, float | None, str, int, int]] = deque()
        self._stats: TelemetryStats | None = factory() if factory is not None else None

    @property
    def enabled(self) -> bool:
        return self._stats is not None

    def operation(
        self, scope: str, seconds: float, succeeded: int, total: int, blocks: int, nbytes: int
    ) -> None:
        """One finished operation: its duration by result, and what it moved."""
        if self._stats is not None:
            result = result_label(succeeded, total)
            self._samples.append((scope, seconds, result, blocks, nbytes))

    def record(
        self, scope: str, seconds: float, result: str, blocks: int = 0, nbytes: int = 0
    ) -> None:
        """One finished step with an explicit result label (peer setup, pin waits, writes)."""
        if self._stats is not None:
            self._samples.append((scope, seconds, result, blocks, nbytes))

    def count(self, scope: str, blocks: int) -> None:
        """Blocks that reached a stage (``FUNNEL``): a count, no duration."""
        if self._stats is not None and blocks:
            self._samples.append((scope, None, "", blocks, 0))

    def pending(self) -> bool:
        """Whether samples wait for :meth:`flush` (any thread: one read)."""
        return bool(self._samples)

    def flush(self) -> None:
        """On the engine's thread: apply the samples recorded since the last flush."""
        stats, samples = self._stats, self._samples
        if stats is None or not samples:
            return
        try:
            while samples:
                scope, seconds, result, blocks, nbytes = samples.popleft()
                if seconds is None:
                    stats.increase_counter(TRANSFER_BLOCKS_METRIC, blocks, (scope,))
                    continue
                stats.observe_histogram(DURATION_METRIC, seconds, (scope, result))
                if blocks:
                    stats.increase_counter(TRANSFER_BLOCKS_METRIC, blocks, (scope,))
                    stats.increase_counter(TRANSFER_BYTES_METRIC, nbytes, (scope,))
        except Exception as exc:
            self._failed("stats", exc)

    def snapshot(self) -> TelemetryStats | None:
        """On the engine's thread: set the state gauges on the current interval, return
        it, start a fresh one."""
        if self._stats is None or self._factory is None:
            return None
        self.flush()
        try:
            fresh = self._factory()
        except Exception as exc:
            self._failed("stats_factory", exc)
            return None
        current, self._stats = self._stats, fresh
        try:
            for resource, value in self._gauges().items():
                current.set_gauge(STATE_METRIC, value, (resource,))
        except Exception as exc:
            self._failed("stats", exc)
        return current

    def _failed(self, callback: str, exc: Exception) -> None:
        if self._log is not None:
            self._log.error("engine_callback_failed", callback=callback, error=repr(exc))


class InMemoryStats:
    """A ready-made ``TelemetryStats``: counters and gauges by (name, labels), histograms as
    lists of observations. Useful for adapters without a metrics library, and for tests."""

    def __init__(self) -> None:
        self.counters: dict[tuple[str, tuple[str, ...]], Number] = {}
        self.gauges: dict[tuple[str, tuple[str, ...]], Number] = {}
        self.histograms: dict[tuple[str, tuple[str, ...]], list[Number]] = {}

    def increase_counter(self, name: str, value: Number, labelvalues: tuple[str, ...] = ()) -> None:
        key = (name, tuple(labelvalues))
        self.counters[key] = self.counters.get(key, 0) + value

    def set_gauge(self, name: str, value: Number, labelvalues: tuple[str, ...] = ()) -> None:
        self.gauges[(name, tuple(labelvalues))] = value

    def observe_histogram(
        self, name: str, value: Number, labelvalues: tuple[str, ...] = ()
    ) -> None:
        self.histograms.setdefault((name, tuple(labelvalues)), []).append(value)

    def reduce(self) -> dict:
        return {
            "counters": dict(self.counters),
            "gauges": dict(self.gauges),
            "histograms": {k: list(v) for k, v in self.histograms.items()},
        }

    def is_empty(self) -> bool:
        return not (self.counters or self.gauges or self.histograms)
