"""Spans for OpenTelemetry, where the engine's process has it (vLLM does): one span per
operation (``kvcr.deposit``, ``kvcr.deliver``, ``kvcr.fetch``) and per write a peer asked
of this worker (``kvcr.source_write``), each with its phases as child spans and the pull's
transfer id (``kvcr.xfer``) as an attribute, so that one transfer's spans on two workers
join on it as their logs do (``xfer=``).

Theory of operation:

- kvcr depends on nothing of OpenTelemetry. ``Tracing.find`` imports its API only when
  telemetry is on and ``KVCR_TRACING`` does not say ``off``; without the package it is
  None and every caller skips tracing with one ``is None`` test.
- Spans go to the process's global tracer provider, the one the engine configures (vLLM's
  ``--otlp-traces-endpoint``). Until one is configured, OpenTelemetry hands out spans that
  record nothing: the operation's span is made and dropped, its phases are not.
- Spans are made after the fact, when their operation ends, from phase stamps on kvcr's
  own (trio) clock: nothing is started on a hot path, no context crosses a thread, and the
  times are converted to the epoch nanoseconds OpenTelemetry wants at that one moment.
- A tracer that fails is logged once (``tracing_failed``) and never breaks an operation.
"""

from __future__ import annotations

import importlib.metadata
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

# (phase, start, end, attributes) on the runtime's clock: a child span of its operation.
Phase = tuple[str, float, float, Mapping[str, str | int] | None]

OFF = ("0", "off", "false", "no")


class Tracing:
    def __init__(self, tracer: Any, api: Any, clock: Callable[[], float], log: Any) -> None:
        """``tracer`` and ``api`` (the ``opentelemetry.trace`` module) are OpenTelemetry's;
        ``clock`` is the runtime's (trio's) clock that phase stamps are taken on."""
        self._tracer = tracer
        self._api = api
        self._clock = clock
        self._log = log
        self._failed = False

    @classmethod
    def find(cls, enabled: bool, clock: Callable[[], float], log: Any) -> Tracing | None:
        """Tracing through the process's OpenTelemetry, or None (telemetry off, the
        package absent, or ``KVCR_TRACING=off``)."""
        if not enabled or os.environ.get("KVCR_TRACING", "").strip().lower() in OFF:
            return None
        try:
            from opentelemetry import trace
        except ImportError:
            return None
        try:
            version: str | None = importlib.metadata.version("kvcr")
        except importlib.metadata.PackageNotFoundError:  # run from a source tree
            version = None
        return cls(trace.get_tracer("kvcr", version), trace, clock, log)

    def emit(
        self,
        name: str,
        start: float,
        attributes: Mapping[str, str | int],
        phases: Iterable[Phase] = (),
        error: str | None = None,
    ) -> None:
        """One ended operation's span, from ``start`` to now, with its phases as children;
        ``error`` marks it failed, with the reason."""
        try:
            now, epoch = self._clock(), time.time_ns()

            def ns(t: float) -> int:
                return epoch - int(max(now - t, 0.0) * 1e9)

            span = self._tracer.start_span(name, start_time=ns(start), attributes=attributes)
            if span.is_recording():
                context = self._api.set_span_in_context(span)
                for phase, begun, ended, extra in phases:
                    child = self._tracer.start_span(
                        phase, context=context, start_time=ns(begun), attributes=extra
                    )
                    child.end(end_time=ns(max(ended, begun)))
                if error is not None:
                    span.set_status(self._api.Status(self._api.StatusCode.ERROR, error[:400]))
            span.end(end_time=epoch)
        except Exception as exc:
            if not self._failed:
                self._failed = True
                self._log.warning("tracing_failed", span=name, error=repr(exc))
