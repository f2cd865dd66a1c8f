"""Seeing the overlap: host and device spans, awaits, trace export and a summary.

Example:
    >>> import anyio, aiostream as ais
    >>> async def main():
    ...     with ais.profile() as prof:
    ...         with ais.record_function("step"):
    ...             ais.delay(0.002)
    ...             await ais.current_stream().synchronize()
    ...     print(prof.summary())
    >>> anyio.run(main)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from .. import _backends, _hooks, _objects, _waiting
from .._backends.base import AnyBackend, Timeline
from .._errors import AiostreamError
from ..device import Device
from ..device import device as _resolve_device
from ..event import Event
from ..stream import Stream, stream_name
from . import _export
from ._spans import Span, Summary, check_str, summarize

__all__ = ["Profiler", "Span", "Summary", "profile"]

_NOT_RUN = (
    "this profile has not run: run it as 'with aiostream.profile() as prof:' first (a Profiler "
    "runs once), then read its results inside the block or after it"
)


def _check_path(path: object) -> str | os.PathLike[str]:
    """``path`` if it names a file: a str or an ``os.PathLike`` (open() would take an int as a
    file descriptor, then write to it and close it)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike (a file name), got {path!r}")
    return path


def _check_interval(start: object, end: object) -> None:
    """Finite numbers of the profiler's clock, ``start <= end``."""
    if type(start) is float and type(end) is float and -math.inf < start <= end < math.inf:
        return  # the hooks' every call: no more than this
    for name, t in (("start", start), ("end", end)):
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise TypeError(f"{name} must be a number (seconds of the profiler's clock), got {t!r}")
        if isinstance(t, float) and not math.isfinite(t):
            raise ValueError(f"{name} must be a finite number, got {t!r}")
    if end < start:  # type: ignore[operator]
        raise ValueError(f"the span ends before it starts: start {start!r}, end {end!r}")


def _check_args(args: object) -> None:
    if not isinstance(args, dict):
        raise TypeError(f"args must be a dict of values shown with the span, got {args!r}")


def _check_stream(stream: object) -> None:
    if not isinstance(stream, Stream):
        raise TypeError(f"stream must be an aiostream.Stream, got {stream!r}")


def _task_name() -> str:
    """The current task's name, or the thread's outside an event loop."""
    try:
        return _waiting.task_name()
    except RuntimeError:  # no event loop in this thread (sniffio's error is a RuntimeError)
        return threading.current_thread().name


#: one profile active at a time: entering checks and plugs in under this lock
_entering = threading.Lock()


class Profiler(_hooks.Listener):
    """Collects spans while active; see :func:`profile`.

    It runs once, as ``with aiostream.profile() as prof:``. Its results (:attr:`spans`,
    :meth:`summary`, :meth:`to_svg`, the exports) are read inside the block or after it; before
    it they raise ``AiostreamError``, and ``str()`` says that it has not run.

    While the profile is active it listens to aiostream's instrumentation (awaits,
    ``record_function``, device work), and records what it is told through :meth:`now`,
    :meth:`on_await`, :meth:`mark`, :meth:`native_timeline`, :meth:`add_host` and
    :meth:`add_device_range`, which a program may call too. They check their arguments
    (``TypeError``, ``ValueError``), so that a wrong value fails at the call, never later in the
    results; where one raises while listening, the failure is logged and the program goes on.
    """

    def __init__(self, device: Device | str | None = None) -> None:
        self.device = _resolve_device(device)
        backend = _backends.get(self.device.type)
        # a backend that keeps its own timeline (the simulator) shows its device work itself,
        # on its own clock; host spans then use that clock too, so both share one time axis
        self._timeline = backend if isinstance(backend, Timeline) else None
        self._clock: Callable[[], float] = (
            self._timeline.now if self._timeline is not None else time.monotonic
        )
        self._native: dict[AnyBackend, bool] = {}
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self._ranges: list[tuple[str, Stream, Event, Event, dict[str, Any], bool]] = []
        self._refs: dict[Device, tuple[Event, float]] = {}
        self._names: dict[str, str] = {}  # stream track -> the stream's name
        self.start: float | None = None
        self.end: float | None = None
        self.unfinished = 0
        """Device ranges whose work had not completed when the profile ended, or failed (not
        shown)."""

    # ------------------------------------------------------------------ collection

    def now(self) -> float:
        """The profiler's clock, in seconds (the virtual backend's own clock on virtual
        devices)."""
        return self._clock()

    def __enter__(self) -> Profiler:
        with _entering:
            if any(isinstance(x, Profiler) for x in _hooks.listeners):
                raise AiostreamError("a profiler is already active; profiles do not nest")
            if self.start is not None:
                raise AiostreamError(
                    "a profiler runs once; make a new one with aiostream.profile()"
                )
            self.start = self.now()
            _hooks.add_listener(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.start is None:
            raise AiostreamError(_NOT_RUN)
        if self.end is not None:
            raise AiostreamError("this profile has already ended; a Profiler runs once")
        self.end = self.now()
        _hooks.remove_listener(self)
        self._collect_device()

    def _check_ran(self) -> float:
        """The start of the profile; raise if it has not run."""
        if self.start is None:
            raise AiostreamError(_NOT_RUN)
        return self.start

    def native_timeline(self, stream: Stream) -> bool:
        """Whether ``stream``'s backend shows its device work itself (no timing events).

        Asked of each stream work is submitted to while the profile runs: the profiler also
        notes the stream's name then, for streams that are gone when the profile ends."""
        _check_stream(stream)
        if stream.name is not None:
            self._names[f"{stream.device} stream {stream.stream_id}"] = stream.name
        backend = _objects.backend(stream)
        native = self._native.get(backend)
        if native is None:  # an isinstance() on a Protocol costs microseconds: once per backend
            native = self._native[backend] = isinstance(backend, Timeline)
        return native

    def on_await(self, task: str, subject: str, device: str, start: float, end: float) -> None:
        """Record that ``task`` was suspended on ``subject`` from ``start`` to ``end``."""
        if not (type(task) is str and type(subject) is str and type(device) is str):
            check_str(task, "task")
            check_str(subject, "subject")
            check_str(device, "device")
        _check_interval(start, end)
        with self._lock:
            self._spans.append(
                Span("await", f"await {subject}", task, start, end, args={"device": device})
            )

    def add_host(
        self, name: str, task: str, start: float, end: float, args: dict[str, Any]
    ) -> None:
        """Record a host range ``name`` of ``task`` from ``start`` to ``end``."""
        if not (type(name) is str and type(task) is str and type(args) is dict):
            check_str(name, "name")
            check_str(task, "task")
            _check_args(args)
        _check_interval(start, end)
        with self._lock:
            self._spans.append(Span("host", name, task, start, end, args=args))

    def mark(self, stream: Stream) -> Event:
        """A timing event recorded on ``stream`` now."""
        _check_stream(stream)
        if stream.device not in self._refs:
            private = Stream(stream.device)  # idle: the reference completes as it is recorded
            t = self.now()
            self._refs[stream.device] = (
                private.record_event(Event(stream.device, enable_timing=True)),
                t,
            )
        return stream.record_event(Event(stream.device, enable_timing=True))

    def add_device_range(
        self,
        name: str,
        stream: Stream,
        start: Event,
        end: Event,
        args: dict[str, Any],
        *,
        op: bool = False,
    ) -> None:
        """Record the device work submitted to ``stream`` between the marks ``start`` and
        ``end`` (events from :meth:`mark`); it is timed when the profile ends."""
        check_str(name, "name")
        _check_stream(stream)
        for what, event in (("start", start), ("end", end)):
            if not isinstance(event, Event):
                raise TypeError(f"{what} must be an aiostream.Event from mark(), got {event!r}")
            if (
                event.device != stream.device
                or not event.enable_timing
                or stream.device not in self._refs
            ):
                raise ValueError(
                    f"{what} must be an event from mark() on this profiler for the stream's "
                    f"device, got {event!r}"
                )
        _check_args(args)
        if not isinstance(op, bool):
            raise TypeError(f"op must be True or False, got {op!r}")
        with self._lock:
            self._ranges.append((name, stream, start, end, args, op))

    # ------------------------------------------------------------------ the listener

    def _wait_began(self, subject: str, device: str, strategy: str) -> Any:
        try:
            start = self.now()
        except Exception:  # the await's span starts at 0: logged, not raised
            self._failed("now()")
            start = 0.0
        return _task_name(), subject, device, start

    def _wait_ended(self, token: Any, error: BaseException | None, outcome: str) -> None:
        task, subject, device, start = token
        try:
            self.on_await(task, subject, device, start, self.now())
        except Exception:
            self._failed("on_await()")

    def _submit_began(self, name: str, stream: Stream) -> Any:
        """The mark right before an op: on streams whose backend shows its work itself, none."""
        try:
            if self.native_timeline(stream):
                return None
        except Exception:
            self._failed("native_timeline()")
            return None
        try:
            return name, stream, self.mark(stream)
        except Exception:
            self._failed("mark()")
            return None

    def _submit_ended(self, token: Any) -> None:
        if token is None:
            return
        name, stream, start = token
        try:
            self.add_device_range(name, stream, start, self.mark(stream), {}, op=True)
        except Exception:
            self._failed("add_device_range()")

    def _region_began(self, name: str, stream: Stream | None, args: dict[str, Any]) -> Any:
        try:
            return name, stream, args, self.now(), (None if stream is None else self.mark(stream))
        except Exception:  # no span for this region
            self._failed("record_function")
            return None

    def _region_ended(self, token: Any) -> None:
        if token is None or self.end is not None:  # failed, or the profile ended inside it
            return
        name, stream, args, start, mark = token
        try:
            self.add_host(name, _task_name(), start, self.now(), args)
            if stream is not None:
                self.add_device_range(name, stream, mark, self.mark(stream), args)
        except Exception:
            self._failed("record_function")

    def _collect_device(self) -> None:
        assert self.start is not None and self.end is not None
        spans = []
        if self._timeline is not None:
            start = self.start - 1e-9
            for r in self._timeline.timeline():
                if r.submitted >= start:
                    track = f"{self.device.type}:{r.device} stream {r.stream}"
                    name = stream_name(Device(self.device.type, r.device), r.stream)
                    if name is not None:
                        self._names[track] = name
                    args = {"error": r.error} if r.error else {}
                    spans.append(Span("device", r.name, track, r.start, r.end, r.engine, args))
        for name, stream, ev0, ev1, args, op in self._ranges:
            try:
                if not (ev0.query() and ev1.query()):
                    self.unfinished += 1
                    continue
                ref, t = self._refs[stream.device]
                a = t + ref.elapsed_time(ev0) / 1000
                b = t + ref.elapsed_time(ev1) / 1000
            except AiostreamError:  # its work failed, or the backend was replaced (a reset):
                self.unfinished += 1  # the device's error is the user's to see, at their awaits
                continue
            track = f"{stream.device} stream {stream.stream_id}"
            if stream.name is not None:
                self._names[track] = stream.name
            spans.append(Span("device" if op else "range", name, track, a, b, None, args))
        with self._lock:
            self._spans.extend(spans)

    # ------------------------------------------------------------------ results

    @property
    def spans(self) -> list[Span]:
        """Every span, ordered by start."""
        with self._lock:
            return sorted(self._spans, key=lambda s: (s.start, -s.end, s.track))

    def summary(self) -> Summary:
        """Time per span name, device busy per engine, host busy, and the overlap ratio.

        Raises:
            AiostreamError: the profile has not run (no ``with aiostream.profile():`` yet).
        """
        start = self._check_ran()
        return summarize(self.spans, start, self.end if self.end is not None else self.now())

    def __str__(self) -> str:
        """The summary as a table; before the profile ran, a line that says so."""
        if self.start is None:
            return f"aiostream profile of {self.device}: not run yet ({_NOT_RUN})"
        return str(self.summary())

    def __repr__(self) -> str:
        if self.start is None:
            state = "not run"
        elif self.end is None:
            state = f"running, {len(self._spans)} spans so far"
        else:
            state = f"ended, {len(self._spans)} spans over {(self.end - self.start) * 1e3:.3f} ms"
        return f"<aiostream.Profiler of {self.device}: {state}>"

    def device_name(self) -> str:
        """What the profiled device is: the GPU's name, or how a virtual device simulates
        (``"simulated from a profile of NVIDIA H200 (driver ..., cuda:0, ...)"``, where its
        time model comes from a profile measured on another device)."""
        return _backends.get(self.device.type).device_name(self.device.index)

    def export_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the Chrome trace event format (JSON), which Perfetto and chrome://tracing open:
        one track per host task, one per device stream; times in microseconds from the start.

        Raises:
            TypeError: ``path`` is not a str or ``os.PathLike`` (a file descriptor is refused).
            AiostreamError: the profile has not run.
            OSError: the file cannot be written.
        """
        path = _check_path(path)
        t0 = self._check_ran()
        events = _export.trace_events(self.spans, t0, self._names)
        other = {"source": "aiostream", "device": f"{self.device} ({self.device_name()})"}
        doc = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
        text = json.dumps(doc, indent=0, allow_nan=False)  # before the file is opened
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)

    def export_svg(self, path: str | os.PathLike[str]) -> None:
        """Draw the timeline as a self-contained SVG: tasks and streams as tracks, spans as bars,
        awaits as hatched gaps.

        Raises:
            TypeError: ``path`` is not a str or ``os.PathLike`` (a file descriptor is refused).
            AiostreamError: the profile has not run.
            OSError: the file cannot be written.
        """
        path = _check_path(path)
        svg = self.to_svg()  # before the file is opened: an error leaves no empty file
        with open(path, "w", encoding="utf-8") as f:
            f.write(svg)

    def to_svg(self) -> str:
        """The timeline as SVG text (see :meth:`export_svg`).

        Raises:
            AiostreamError: the profile has not run.
        """
        t0 = self._check_ran()
        return _export.svg(self.spans, t0, self.end, self._names)


def profile(device: Device | str | None = None) -> Profiler:
    """Profile what runs inside ``with aiostream.profile() as prof:``.

    It collects host spans of :func:`record_function` (tagged with the task), the device
    operations submitted through aiostream (exact times from the virtual backend; timing events
    on CUDA), ranges on streams, and every await on an event or stream. Await your device work
    before the block ends: work still running then is not shown.

    Args:
        device: whose clock times the profile (the virtual backend's own clock on virtual
            devices, so that host and device spans share it); None for the default device.
    """
    return Profiler(device)
