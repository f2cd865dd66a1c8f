"""OpenTelemetry spans for aiostream: a span per awaited wait, and for ``record_function``
regions a host span and, on a stream, a span of the device's own times on the host's clock.

Needs the ``opentelemetry-api`` package (``pip install opentelemetry-api``; from aiostream's
checkout, ``pip install -e ".[otel]"``); spans go
wherever the application's tracer provider sends them (an SDK with an exporter: Jaeger, an
OTLP collector, the console). Nothing here runs until :func:`instrument` is called, and
:meth:`Tracing.close` (or leaving its ``with`` block) stops it.

Example:
    >>> import aiostream as ais
    >>> with ais.tracing.instrument():  # doctest: +SKIP
    ...     ...  # every await of device work is a span "aiostream.wait"

Spans:

- ``aiostream.wait``: from the moment a task began to await device work to its end, a child of
  the task's current span, with ``aiostream.subject`` (the stream or event), ``aiostream.device``,
  ``aiostream.strategy`` and ``aiostream.outcome``: ``completed``, ``failed`` (a
  ``DeviceError``: recorded on the span), ``cancelled`` (a timeout or a cancel scope) or
  ``error``; anything but ``completed`` sets the span's status to ERROR. An await of work that
  had completed waits for nothing and makes no span (a span costs the SDK tens of
  microseconds: several times such an await); ``aiostream.metrics`` counts those.
- ``<name>``: a ``record_function`` region, over its host time; with ``stream=``, also
  ``<name> [device]``, a child of it, whose start and end are the device's times of timing
  events recorded around the region's work, converted to the host's clock. The conversion is
  anchored once per device by an event recorded on an idle stream, whose completion lies
  between the host's readings before the record and after the query that saw it complete:
  ``aiostream.clock_error_s`` says half that bracket (0 on virtual devices, whose events
  complete as they are recorded: their spans' durations and offsets are exact, in the
  device's clock, the loop's fake one under ``virtual_time``). The device span is exported
  once its end event completed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .. import _objects
from .._errors import AiostreamError
from ..device import Device
from ..event import Event
from ..stream import Stream
from ._listening import Listening

__all__ = ["Tracing", "instrument"]

_EXTRA = 'pip install opentelemetry-api (from aiostream\'s checkout: pip install -e ".[otel]")'


def _api() -> Any:
    try:
        from opentelemetry import context, trace
    except ImportError:
        raise AiostreamError(
            f"aiostream.tracing needs the OpenTelemetry API, which is not installed: {_EXTRA}"
        ) from None
    return trace, context


class _Anchor:
    """Where a device's clock sits on the host's: (event, host seconds, error bound)."""

    __slots__ = ("error", "event", "host")

    def __init__(self, device: Device) -> None:
        stream = Stream(device)  # a stream of its own: idle, so the record completes at once
        self.event = Event(device, enable_timing=True)
        if device.type == "virtual":  # it completes as it is recorded, on the device's clock
            self.event.record(stream)
            self.host, self.error = time.monotonic(), 0.0
            return
        before = time.monotonic()
        self.event.record(stream)
        while not self.event.query():
            pass
        after = time.monotonic()
        self.host, self.error = (before + after) / 2, (after - before) / 2

    def on_host(self, event: Event) -> float:
        return self.host + self.event.elapsed_time(event) / 1e3


class Tracing(Listening):
    """The OpenTelemetry listener that :func:`instrument` plugs in; see the module's text."""

    def __init__(self, tracer_provider: Any = None) -> None:
        if tracer_provider is not None and not callable(getattr(tracer_provider, "get_tracer", 0)):
            raise TypeError(
                f"tracer_provider must be an OpenTelemetry TracerProvider, got {tracer_provider!r}"
            )
        trace, context = _api()
        from .._distribution import version

        self._trace, self._context = trace, context
        self._tracer = trace.get_tracer("aiostream", version(), tracer_provider=tracer_provider)
        self._status = trace.Status, trace.StatusCode
        # host monotonic seconds -> the epoch nanoseconds spans carry
        self._epoch = time.time_ns() - time.monotonic_ns()
        self._anchors: dict[Device, _Anchor] = {}
        self._lock = threading.Lock()
        self._listen()

    def close(self) -> None:
        """Stop making spans (those begun end as they would; a second close does nothing)."""
        super().close()

    def _stopped(self) -> None:
        with self._lock:
            self._anchors.clear()  # their events go: nothing of the devices' stays held

    def _holds(self) -> list[Any]:
        with self._lock:  # the anchors' events, tracing's own: no leak of the program's
            return [anchor.event for anchor in self._anchors.values()]

    def __enter__(self) -> Tracing:
        return self

    def _ns(self, host: float) -> int:
        return self._epoch + round(host * 1e9)

    # ------------------------------------------------------------------ the listener

    def _wait_began(self, subject: str, device: str, strategy: str) -> object:
        if strategy == "complete":  # the work had completed: nothing waited, no span
            return None
        return self._tracer.start_span(
            "aiostream.wait",
            attributes={
                "aiostream.subject": subject,
                "aiostream.device": device,
                "aiostream.strategy": strategy,
            },
        )

    def _wait_ended(self, token: object, error: BaseException | None, outcome: str) -> None:
        span: Any = token
        if span is None:
            return
        span.set_attribute("aiostream.outcome", outcome)
        if error is not None:
            status, code = self._status
            if outcome == "cancelled":
                span.set_status(status(code.ERROR, "cancelled (a timeout or a cancel scope)"))
            else:  # failed (a DeviceError), or another error
                kind = "DeviceError" if outcome == "failed" else type(error).__name__
                span.record_exception(error)
                span.set_status(status(code.ERROR, f"{kind}: {error}"))
        span.end()

    def _region_began(self, name: str, stream: Stream | None, args: dict[str, Any]) -> object:
        """The host's time and, on a stream not capturing a graph, a timing event recorded
        there (None if it cannot be: host times only)."""
        t0 = time.monotonic()  # before the record: the device reaches it no sooner
        start = None
        if stream is not None and not _objects.capturing(stream):
            try:
                start = Event(stream.device, enable_timing=True)
                start.record(stream)
            except Exception:  # noqa: BLE001 - the region's device times are lost, not the program
                self._failed("a region's timing event")
                start = None
        return name, stream, t0, start

    def _region_ended(self, token: Any) -> None:
        name: str
        stream: Stream | None
        t0: float
        start: Event | None
        name, stream, t0, start = token
        if self.closed:  # closed inside the region: no span
            return
        end = None
        if start is not None and stream is not None:
            try:
                end = Event(stream.device, enable_timing=True)
                end.record(stream)
            except Exception:  # noqa: BLE001
                self._failed("a region's timing event")
                start = end = None
        host = (t0, time.monotonic())
        parent = self._context.get_current()
        span = self._tracer.start_span(name, context=parent, start_time=self._ns(host[0]))
        span.end(end_time=self._ns(host[1]))
        if start is None or end is None or stream is None:
            return
        device = stream.device
        anchor = self._anchor(device, stream)
        ctx = self._trace.set_span_in_context(span, parent)
        first, last = start, end

        def landed() -> None:  # any thread, once the end event completed
            try:
                a, b = anchor.on_host(first), anchor.on_host(last)
                device_span = self._tracer.start_span(
                    f"{name} [device]",
                    context=ctx,
                    start_time=self._ns(a),
                    attributes={
                        "aiostream.device": str(device),
                        "aiostream.stream": stream.stream_id,
                        "aiostream.clock_error_s": anchor.error,
                    },
                )
                device_span.end(end_time=self._ns(b))
            except Exception:  # noqa: BLE001 - a failed device span is logged, once
                self._failed("a device span")

        _objects.when_done(end, landed)

    def _anchor(self, device: Device, stream: Stream) -> _Anchor:
        """The device's anchor, made on first use (in the region's thread: it makes a stream
        and an event), and again when the device's backend was replaced (a virtual reset)."""
        with self._lock:
            anchor = self._anchors.get(device)
            if anchor is None or _objects.backend(anchor.event) is not _objects.backend(stream):
                anchor = self._anchors[device] = _Anchor(device)
            return anchor


def instrument(tracer_provider: Any = None) -> Tracing:
    """Make OpenTelemetry spans of aiostream's waits and ``record_function`` regions, with the
    given tracer provider (default: the global one), until the returned object is closed.

    Raises:
        AiostreamError: the ``opentelemetry-api`` package is not installed (it says what to
            install).
        TypeError: ``tracer_provider`` is not a tracer provider.
    """
    return Tracing(tracer_provider)
