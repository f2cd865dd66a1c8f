"""``aiostream.tracing``: OpenTelemetry spans of waits (children of the caller's span, with
their outcome) and of ``record_function`` regions with the device's own times, checked with the
SDK's in-memory exporter, on every loop and backend."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import aiostream as ais
import aiostream.tracing
from tests.helpers import gate
from tests.helpers.deadlines import until

pytestmark = pytest.mark.anyio

SHORT = 0.05  # seconds of device work, pending when awaited


class Spans:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name == name]


@pytest.fixture
def spans() -> Iterator[Spans]:
    made = Spans()
    with aiostream.tracing.instrument(made.provider):
        yield made


async def test_each_await_is_a_span_under_the_callers_span(
    aiostream_device: ais.Device, spans: Spans
) -> None:
    """A wait on pending work: a span, child of the task's current span, naming what was
    awaited, where, how, and that it completed; an await of completed work: none."""
    s = ais.Stream(aiostream_device)
    tracer = spans.provider.get_tracer("app")
    virtual = aiostream_device.type == "virtual"
    # pending however late the await: a stalled virtual device, a gated CUDA stream
    release = ais.virtual.stall("compute").release if virtual else gate.gate(s)

    async def release_once_waiting() -> None:
        await until(lambda: ais.pending_waits() != [], "the wait to begin")
        release()

    try:
        with tracer.start_as_current_span("request") as request:
            ais.delay(SHORT, stream=s)
            async with anyio.create_task_group() as tg:
                tg.start_soon(release_once_waiting)
                await s
            await s  # its work complete by now: nothing waited
    finally:
        release()
    if not virtual:
        gate.sweep()  # the device passed the gate: its word goes now, not at the exit
    (pending,) = spans.named("aiostream.wait")
    for span in (pending,):
        assert span.parent is not None
        assert span.parent.span_id == request.get_span_context().span_id
        assert span.attributes is not None
        assert span.attributes["aiostream.device"] == str(aiostream_device)
        assert span.attributes["aiostream.subject"] == f"stream {s.stream_id}"
        assert span.attributes["aiostream.outcome"] == "completed"
        assert span.status.status_code == StatusCode.UNSET
    assert pending.attributes["aiostream.strategy"] == ais.get_wait_strategy()  # type: ignore[index]
    assert pending.end_time > pending.start_time  # type: ignore[operator]


async def test_a_timeout_and_a_device_error_set_the_span_status(
    aiostream_device: ais.Device, spans: Spans
) -> None:
    s = ais.Stream(aiostream_device)
    virtual = aiostream_device.type == "virtual"
    # the work waits meanwhile: a stalled virtual device, a gated CUDA stream
    release = ais.virtual.stall("compute").release if virtual else gate.gate(s)
    try:
        ais.delay(SHORT, stream=s)
        with anyio.move_on_after(SHORT):
            await s
        (cancelled,) = spans.named("aiostream.wait")
        assert cancelled.attributes["aiostream.outcome"] == "cancelled"  # type: ignore[index]
        assert cancelled.status.status_code == StatusCode.ERROR
    finally:
        release()
    await s
    if not virtual:
        gate.sweep()  # the device passed the gate: its word goes now, not at the exit
    if virtual:  # faults are injected on virtual devices
        failing = ais.Stream(aiostream_device)
        ais.virtual.submit(failing, 0.001, error="boom")
        with pytest.raises(ais.DeviceError, match="boom"):
            await failing
        failed = spans.named("aiostream.wait")[-1]
        assert failed.attributes["aiostream.outcome"] == "failed"  # type: ignore[index]
        assert failed.status.status_code == StatusCode.ERROR
        assert "boom" in (failed.status.description or "")
        assert [e.name for e in failed.events] == ["exception"]


async def test_a_region_on_a_stream_has_its_device_time_as_a_span(
    aiostream_device: ais.Device, spans: Spans
) -> None:
    """record_function with stream=: a host span over the region, and its child with the
    device's times of the work inside, on the host's clock, within the stated error."""
    s = ais.Stream(aiostream_device)
    with ais.record_function("model", stream=s):
        ais.delay(SHORT, stream=s)
    await s
    await until(lambda: spans.named("model [device]") != [], "the device span's export")
    (host,) = spans.named("model")
    (device,) = spans.named("model [device]")
    assert device.parent is not None and device.parent.span_id == host.context.span_id
    attributes: Any = device.attributes
    error_ns = attributes["aiostream.clock_error_s"] * 1e9
    took = device.end_time - device.start_time  # type: ignore[operator]
    # the work's time, and the submission's after the start's record (real time, on a busy
    # machine too); exact in virtual time (below)
    assert SHORT * 1e9 <= took < (SHORT + 0.5) * 1e9
    if aiostream_device.type == "virtual":  # the device's clock is the host's own
        assert error_ns == 0
    # it began within the region, on the host's clock (the region's host span: a moment)
    assert host.start_time - error_ns - 1e6 <= device.start_time <= host.end_time + error_ns  # type: ignore[operator]
    assert attributes["aiostream.stream"] == s.stream_id


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_in_virtual_time_a_regions_device_span_is_exact(
    virtual_time: Any, spans: Spans, anyio_backend: str
) -> None:
    s = ais.Stream()
    with ais.record_function("model", stream=s):
        ais.delay(0.25, stream=s)
        ais.delay(0.5, stream=s)
    await s
    (device,) = spans.named("model [device]")
    assert device.end_time - device.start_time == 750_000_000  # type: ignore[operator]


async def test_a_region_without_a_stream_is_a_host_span_alone(spans: Spans) -> None:
    async with ais.record_function("prepare"):
        await anyio.sleep(0.001)
    (host,) = spans.named("prepare")
    assert host.end_time - host.start_time >= 1e6  # type: ignore[operator]
    assert spans.named("prepare [device]") == []


async def test_a_broken_tracer_never_breaks_a_wait(caplog: pytest.LogCaptureFixture) -> None:
    """A tracer that raises: every wait completes, and the failure is logged once."""

    class Broken:
        def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
            return self

        def start_span(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("exporter down")

    with aiostream.tracing.instrument(Broken()), caplog.at_level(logging.ERROR, "aiostream"):
        for _ in range(3):
            await a_pending_wait()
    failures = [r for r in caplog.records if "wait_began" in r.getMessage()]
    assert len(failures) == 1 and "exporter down" in (failures[0].exc_text or "")


async def test_closed_it_makes_no_more_spans(spans: Spans) -> None:
    closed = Spans()
    aiostream.tracing.instrument(closed.provider).close()
    await a_pending_wait()
    assert len(spans.named("aiostream.wait")) == 1
    assert closed.named("aiostream.wait") == []


async def a_pending_wait() -> None:
    """An await of work that is pending when it begins (its engine held meanwhile)."""
    s = ais.Stream()
    held = ais.virtual.stall("compute")
    ais.delay(0.001, stream=s)
    async with anyio.create_task_group() as tg:
        tg.start_soon(s.synchronize)
        await until(lambda: ais.pending_waits() != [], "the wait to begin")
        held.release()


def test_without_the_api_it_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    with pytest.raises(ais.AiostreamError, match=r"pip install opentelemetry-api .*\[otel\]"):
        aiostream.tracing.instrument()
