"""OpenTelemetry spans (tracing.py) on two workers of the fake fabric under MockClock.

The spans go to an SDK tracer provider with an in-memory exporter: ``opentelemetry.trace``'s
``get_tracer`` is pointed at it for the test, as an engine's configured global provider
would be (the global one can be set only once per process). Each pull's spans on both
workers carry its transfer id; the phases are child spans; a failure marks the span.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
import trio
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvcr.logs import capture_events
from kvcr.tracing import Tracing
from peer_world import key, share, telemetry_pair


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer", provider.get_tracer)
    monkeypatch.delenv("KVCR_TRACING", raising=False)
    yield exporter
    provider.shutdown()


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def children(exporter: InMemorySpanExporter, parent: ReadableSpan) -> dict[str, ReadableSpan]:
    assert parent.context is not None
    found = {
        s.name: s
        for s in exporter.get_finished_spans()
        if s.parent is not None and s.parent.span_id == parent.context.span_id
    }
    for child in found.values():  # on the parent's trace, inside its time
        assert child.context is not None and child.context.trace_id == parent.context.trace_id
        assert child.start_time is not None and child.end_time is not None
        assert child.start_time <= child.end_time
    return found


def test_tracing_is_off_without_telemetry_without_the_package_or_when_said(
    spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert Tracing.find(True, trio.current_time, None) is not None
    assert Tracing.find(False, trio.current_time, None) is None
    monkeypatch.setenv("KVCR_TRACING", "off")
    assert Tracing.find(True, trio.current_time, None) is None
    monkeypatch.delenv("KVCR_TRACING")
    # An engine process without OpenTelemetry: the import fails, nothing else happens.
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    assert Tracing.find(True, trio.current_time, None) is None


async def test_one_pull_is_one_span_on_each_side_joined_by_its_transfer_id(
    autojump_clock: Any, spans: InMemorySpanExporter
) -> None:
    _, a, b = telemetry_pair()
    async with a.running(), b.running():
        await share(a, b, [0, 1])
        a.pins.engine_has = {key(2): 2}
        a.engine.write(2, seed=2)
        b.kv.submit_hint(b.hint(a, [0, 1, 2]), request_id="r2")
        entries = await b.deliver([(0, 10), (1, 11), (2, 12)], request_id="r2")
        assert {v.status.value for v in entries.values()} == {"SUCCESS"}
        await trio.sleep(0.01)

    [deposit] = named(spans, "kvcr.deposit")  # a's local deposit of keys 0 and 1
    assert (deposit.attributes or {})["kvcr.keys"] == 2
    [deliver] = named(spans, "kvcr.deliver")
    [write] = named(spans, "kvcr.source_write")
    attributes, written = dict(deliver.attributes or {}), dict(write.attributes or {})
    assert attributes["kvcr.remote_keys"] == attributes["kvcr.remote_succeeded"] == 3
    assert attributes["kvcr.xfer"] == written["kvcr.xfer"]  # one id on both workers
    assert (written["kvcr.resident"], written["kvcr.held"], written["kvcr.written"]) == (3, 3, 3)
    assert deliver.status.is_ok and write.status.is_ok

    mine = children(spans, deliver)
    assert {"pull", "notification"} <= set(mine)
    assert (mine["pull"].attributes or {})["kvcr.xfer"] == attributes["kvcr.xfer"]
    theirs = children(spans, write)
    assert set(theirs) == {"framework_pin_wait", "transfer_post", "transfer"}
    # The phases in order, each on its own side's clock: the write's post before its
    # transfer ends; the word heard after the pull was sent.
    assert theirs["transfer_post"].start_time <= theirs["transfer"].end_time  # type: ignore[operator]
    assert mine["pull"].start_time <= mine["notification"].end_time  # type: ignore[operator]


async def test_a_failed_write_marks_both_spans_with_the_reason(
    autojump_clock: Any, spans: InMemorySpanExporter
) -> None:
    from kvcr.transport.fake import Behavior

    _, a, b = telemetry_pair()
    async with a.running(), b.running():
        await share(a, b, [0])
        a.transport.script.append(Behavior(delay=0.01, fail=True))
        await b.deliver([(0, 10)], request_id="r")
        await trio.sleep(0.01)

    [deliver] = named(spans, "kvcr.deliver")
    [write] = named(spans, "kvcr.source_write")
    assert not deliver.status.is_ok and not write.status.is_ok
    assert "the write failed" in (write.status.description or "")
    assert "the write failed" in (deliver.status.description or "")
    assert (deliver.attributes or {})["kvcr.xfer"] == (write.attributes or {})["kvcr.xfer"]
    assert (children(spans, deliver)["pull"].attributes or {})["kvcr.written"] == 0
    assert "notification" not in children(spans, deliver)  # the word was Over, not Written
    assert (write.attributes or {})["kvcr.written"] == 0


async def test_a_tracer_that_fails_is_logged_once_and_breaks_nothing(
    autojump_clock: Any, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Broken:
        def start_span(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("exporter down")

    monkeypatch.setattr(trace, "get_tracer", lambda *args: Broken())
    _, a, b = telemetry_pair()
    with capture_events() as events:
        async with a.running(), b.running():
            await share(a, b, [0, 1])
            entries = await b.deliver([(0, 10), (1, 11)], request_id="r")
            assert {v.status.value for v in entries.values()} == {"SUCCESS"}
            await b.deliver([(0, 12)], request_id="r")
    failed = [e for e in events if e["event"] == "tracing_failed"]
    assert len(failed) == 2  # once per worker, not per span
    assert "exporter down" in failed[0]["error"]
