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

import functools
import inspect
import json
import math
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar
from xml.sax.saxutils import escape

from . import _backends, _hooks, _objects, _waiting
from ._backends.base import AnyBackend, Timeline
from ._errors import AiostreamError
from .device import Device
from .device import device as _resolve_device
from .event import Event
from .stream import Stream, stream_name

__all__ = ["Profiler", "Span", "Summary", "profile", "record_function"]

F = TypeVar("F", bound=Callable[..., Any])

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


def _check_str(value: object, name: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {value!r}")


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


def _check_seconds(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")


def _check_args(args: object) -> None:
    if not isinstance(args, dict):
        raise TypeError(f"args must be a dict of values shown with the span, got {args!r}")


def _check_stream(stream: object) -> None:
    if not isinstance(stream, Stream):
        raise TypeError(f"stream must be an aiostream.Stream, got {stream!r}")


@dataclass(frozen=True)
class Span:
    """One interval of the profile, in seconds of the profiler's clock."""

    kind: str
    """``"host"`` (a record_function range), ``"await"`` (a task suspended on an event or
    stream), ``"device"`` (an operation on a device) or ``"range"`` (a record_function range
    on a stream)."""
    name: str
    track: str
    """The task (host, await) or ``"<device> stream <id>"`` (device, range)."""
    start: float
    end: float
    engine: str | None = None
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


def _task_name() -> str:
    try:
        return _waiting.task_name()
    except RuntimeError:  # no event loop in this thread (sniffio's error is a RuntimeError)
        return threading.current_thread().name


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        elif b > a:
            merged.append((a, b))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(
    x: list[tuple[float, float]], y: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(
    x: list[tuple[float, float]], y: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    out = []
    for a, b in x:
        pieces = [(a, b)]
        for c, d in y:
            pieces = [p for s, e in pieces for p in ((s, min(e, c)), (max(s, d), e)) if p[0] < p[1]]
        out.extend(pieces)
    return out


@dataclass(frozen=True)
class Summary:
    """Where the time went; ``str()`` prints it as a table."""

    wall: float
    """Seconds the profile was active."""
    spans: dict[str, tuple[int, float]]
    """Per span name (host ranges and device operations): count and total seconds."""
    engine_busy: dict[str, float]
    """Per device engine (``"virtual:0 compute"``): seconds with an operation running."""
    device_busy: float
    """Seconds with any device operation running."""
    host_busy: float
    """Seconds inside host ranges, less the time their task was suspended in an await."""
    overlap: float
    """Seconds both host and device were busy, over device busy time (0 without device work)."""

    def __post_init__(self) -> None:
        for name in ("wall", "device_busy", "host_busy", "overlap"):
            _check_seconds(getattr(self, name), name)
        if not isinstance(self.spans, dict):
            raise TypeError(f"spans must be a dict, got {self.spans!r}")
        for key, entry in self.spans.items():
            _check_str(key, "a span name")
            if not (
                isinstance(entry, tuple)
                and len(entry) == 2
                and isinstance(entry[0], int)
                and not isinstance(entry[0], bool)
            ):
                raise TypeError(f"spans[{key!r}] must be (count, total seconds), got {entry!r}")
            _check_seconds(entry[1], f"spans[{key!r}]'s total")
        if not isinstance(self.engine_busy, dict):
            raise TypeError(f"engine_busy must be a dict, got {self.engine_busy!r}")
        for key, busy in self.engine_busy.items():
            _check_str(key, "an engine name")
            _check_seconds(busy, f"engine_busy[{key!r}]")

    def __str__(self) -> str:
        w = 40  # the name column; the figures line up under their headings below it
        lines = [f"{'span':{w}} {'count':>7} {'total ms':>11} {'mean ms':>10}"]
        for name, (count, total) in sorted(self.spans.items(), key=lambda kv: -kv[1][1]):
            mean = (total / count if count else 0.0) * 1e3
            lines.append(f"{name[:w]:{w}} {count:7d} {total * 1e3:11.3f} {mean:10.3f}")
        lines.append("")
        rows = [(f"device busy: {e}", busy) for e, busy in sorted(self.engine_busy.items())]
        rows += [
            ("device busy: any engine", self.device_busy),
            ("host busy (in host ranges, less awaits)", self.host_busy),
            ("wall", self.wall),
        ]
        lines += [f"{label[:w]:{w}} {'':7} {sec * 1e3:11.3f}" for label, sec in rows]
        lines.append(
            f"host/device overlap: {self.overlap:.3f} (time both were busy / device busy time)"
        )
        return "\n".join(lines)


class Profiler:
    """Collects spans while active; see :func:`profile`.

    It runs once, as ``with aiostream.profile() as prof:``. Its results (:attr:`spans`,
    :meth:`summary`, :meth:`to_svg`, the exports) are read inside the block or after it; before
    it they raise ``AiostreamError``, and ``str()`` says that it has not run.

    :meth:`now`, :meth:`on_await`, :meth:`mark`, :meth:`native_timeline`, :meth:`add_host` and
    :meth:`add_device_range` are the observer hooks that aiostream's instrumentation calls while
    the profile is active (``record_function``, awaits, device work). They check their arguments
    (``TypeError``, ``ValueError``), so that a wrong value fails at the call, never later in the
    results.
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
        if _hooks.observer is not None:
            raise AiostreamError("a profiler is already active; profiles do not nest")
        if self.start is not None:
            raise AiostreamError("a profiler runs once; make a new one with aiostream.profile()")
        self.start = self.now()
        _hooks.install(self)
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
        _hooks.uninstall(self)
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
            _check_str(task, "task")
            _check_str(subject, "subject")
            _check_str(device, "device")
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
            _check_str(name, "name")
            _check_str(task, "task")
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
        _check_str(name, "name")
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
        return _summarize(self.spans, start, self.end if self.end is not None else self.now())

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
        events = _trace_events(self.spans, t0, self._names)
        other = {"source": "aiostream", "device": f"{self.device} ({self.device_name()})"}
        doc = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
        text = json.dumps(doc, indent=0, allow_nan=False)  # before the file is opened
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)

    def export_svg(self, path: str | os.PathLike[str]) -> None:
        """Draw the timeline as a self-contained SVG: tasks and streams as lanes, spans as bars,
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
        return _svg(self.spans, t0, self.end, self._names)


def _summarize(spans: list[Span], start: float, end: float) -> Summary:
    """Time per span name, device busy per engine, host busy, and the overlap ratio."""
    per_name: dict[str, list[float]] = defaultdict(list)
    per_engine: dict[str, list[tuple[float, float]]] = defaultdict(list)
    host: dict[str, list[tuple[float, float]]] = defaultdict(list)
    awaits: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s in spans:
        if s.kind in ("host", "device"):
            per_name[s.name].append(s.duration)
        elif s.kind == "range":  # record_function(..., stream=s): its work's time on the device
            per_name[f"{s.name} (device)"].append(s.duration)
        if s.kind == "device" and s.engine is not None:
            device = s.track.split(" ")[0]
            per_engine[f"{device} {s.engine}"].append((s.start, s.end))
        elif s.kind == "device":
            per_engine[s.track].append((s.start, s.end))
        elif s.kind == "host":
            host[s.track].append((s.start, s.end))
        elif s.kind == "await":
            awaits[s.track].append((s.start, s.end))
    busy_host = _union(
        iv for task, ivs in host.items() for iv in _subtract(_union(ivs), _union(awaits[task]))
    )
    busy_device = _union(iv for ivs in per_engine.values() for iv in ivs)
    device_busy = _length(busy_device)
    return Summary(
        wall=end - start,
        spans={n: (len(d), sum(d)) for n, d in per_name.items()},
        engine_busy={e: _length(_union(ivs)) for e, ivs in per_engine.items()},
        device_busy=device_busy,
        host_busy=_length(busy_host),
        overlap=_length(_intersect(busy_host, busy_device)) / device_busy if device_busy else 0.0,
    )


def _tracks(spans: list[Span]) -> tuple[list[str], list[str]]:
    """The tasks (in order of their first span) and the streams (by device, then id)."""
    tasks = list(dict.fromkeys(s.track for s in spans if s.kind in ("host", "await")))
    streams = sorted(
        {s.track for s in spans if s.kind in ("device", "range")},
        key=lambda t: (t.split(" ")[0], int(t.rsplit(" ", 1)[1])),
    )
    return tasks, streams


def task_label(task: str) -> str:
    """A task's name as a person reads it: anyio names a task by its function's qualified
    name, ``__main__._run_demo.<locals>.run``, shown as ``_run_demo.run`` (the last two
    parts, without ``<locals>``); other names as they are."""
    parts = [p for p in task.split(".") if p != "<locals>"]
    return ".".join(parts[-2:]) if len(parts) > 2 else ".".join(parts)


def _more_lane(label: str, lane: int) -> str:
    """The name of a track's lane past its first: where its spans overlap without nesting (a
    device range around work that another range's work overlaps), which one row cannot show."""
    return f"{label}, overlapping spans ({lane + 1})"


def _stream_label(track: str, names: dict[str, str]) -> str:
    name = names.get(track)
    return track if name is None else f"{track} ({name})"


def _trace_events(
    spans: list[Span], t0: float, stream_names: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """The Chrome trace's events: a process per device (the host tasks' first), a thread per
    task or stream, and one more, ``<track>, overlapping spans (2)``, where spans of one
    track overlap without nesting."""
    tasks, streams = _tracks(spans)
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "host tasks"}}
    ]
    devices = list(dict.fromkeys(t.split(" ")[0] for t in streams))
    for i, dev in enumerate(devices):
        events.append(
            {"name": "process_name", "ph": "M", "pid": 2 + i, "tid": 0, "args": {"name": dev}}
        )
    by_track: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_track[s.track].append(s)
    for pid, names in [(1, tasks)] + [
        (2 + i, [t for t in streams if t.split(" ")[0] == dev]) for i, dev in enumerate(devices)
    ]:
        for n, track in enumerate(names):
            for lane, lane_spans in enumerate(_nested_lanes(by_track[track])):
                tid = (n + 1) * 100 + lane
                label = _stream_label(track, stream_names or {}) if pid > 1 else task_label(track)
                events.append(
                    {
                        "name": "thread_name",
                        "ph": "M",
                        "pid": pid,
                        "tid": tid,
                        "args": {"name": label if lane == 0 else _more_lane(label, lane)},
                    }
                )
                events.extend(_begin_end(lane_spans, pid, tid, t0))
    return events


def _svg(
    spans: list[Span], t0: float, end: float | None, names: dict[str, str] | None = None
) -> str:
    """The timeline as SVG: tasks and streams as lanes, spans as bars, awaits hatched."""
    t1 = max([end or t0] + [s.end for s in spans])
    span = max(t1 - t0, 1e-9)
    tasks, streams = _tracks(spans)
    lanes = [("task", t) for t in tasks] + [("stream", t) for t in streams]
    label_w, plot_w, row_h, top = 210, 900, 24, 34
    height = top + row_h * len(lanes) + 30
    width = label_w + plot_w + 20
    colours = {"compute": "#4c78a8", "h2d": "#f58518", "d2h": "#54a24b", None: "#9d755d"}
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#fff"/>'
        '<line x1="0" y1="0" x2="0" y2="6" stroke="#999" stroke-width="2"/></pattern></defs>',
        f'<rect width="{width}" height="{height}" fill="#fff"/>',
        f'<text x="10" y="18" font-size="13" font-weight="bold">aiostream profile: '
        f"{escape(f'{span * 1e3:.3f}')} ms</text>",
    ]

    legend = [
        ("host range", "#e45756", ""),
        ("await", "url(#hatch)", ' stroke="#999"'),
        ("compute", colours["compute"], ""),
        ("h2d copy", colours["h2d"], ""),
        ("d2h copy", colours["d2h"], ""),
        ("stream range", "none", ' stroke="#333" stroke-dasharray="3,2"'),
    ]
    lx = label_w + plot_w - 6 * 92
    for i, (name, fill, extra) in enumerate(legend):
        out.append(f'<rect x="{lx + i * 92}" y="8" width="12" height="12" fill="{fill}"{extra}/>')
        out.append(f'<text x="{lx + i * 92 + 16}" y="18">{name}</text>')

    def x(t: float) -> float:
        return label_w + (t - t0) / span * plot_w

    by_track: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_track[s.track].append(s)
    for row, (kind, track) in enumerate(lanes):
        y = top + row * row_h
        label = task_label(track) if kind == "task" else _stream_label(track, names or {})
        out.append(f'<g class="lane" data-kind="{kind}" data-track="{escape(track)}">')
        out.append(
            f'<rect x="{label_w}" y="{y}" width="{plot_w}" height="{row_h - 4}" fill="#f4f4f4"/>'
        )
        out.append(f'<text x="6" y="{y + 14}">{escape(label)}</text>')
        for s in by_track[track]:
            w = max(x(s.end) - x(s.start), 0.5)
            if s.kind == "await":
                fill, extra = "url(#hatch)", ' stroke="#999"'
            elif s.kind == "range":
                fill, extra = "none", ' stroke="#333" stroke-dasharray="3,2"'
            elif s.kind == "host":
                fill, extra = "#e45756", ""
            else:
                fill, extra = colours.get(s.engine, colours[None]), ""
            title = f"{s.name}: {s.duration * 1e3:.3f} ms from {(s.start - t0) * 1e3:.3f} ms"
            out.append(
                f'<rect class="span {s.kind}" x="{x(s.start):.2f}" y="{y + 2}" '
                f'width="{w:.2f}" height="{row_h - 8}" fill="{fill}"{extra}>'
                f"<title>{escape(title)}</title></rect>"
            )
        out.append("</g>")
    axis_y = top + row_h * len(lanes) + 12
    for k in range(6):
        t = t0 + span * k / 5
        out.append(
            f'<text x="{x(t):.1f}" y="{axis_y}" text-anchor="middle">{(t - t0) * 1e3:.1f} ms</text>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _nested_lanes(spans: list[Span]) -> list[list[Span]]:
    """Split one track's spans into lanes where every two spans nest or are disjoint."""
    lanes: list[list[Span]] = []
    stacks: list[list[Span]] = []
    for s in sorted(spans, key=lambda s: (s.start, -s.end)):
        for lane, stack in zip(lanes, stacks, strict=True):
            while stack and stack[-1].end <= s.start:
                stack.pop()
            if not stack or s.end <= stack[-1].end:
                lane.append(s)
                stack.append(s)
                break
        else:
            lanes.append([s])
            stacks.append([s])
    return lanes


def _json_value(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON holds it: numbers (a numpy scalar too), strings, lists and dicts of
    them; anything else, a number JSON has not (NaN, infinities) or what nests too deep, as its
    ``repr``."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if depth > 16:
        return repr(value)
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "shape", None) == ():  # a numpy scalar or 0-d array
        try:
            return _json_value(item(), depth + 1)
        except Exception:  # noqa: BLE001 - shown as its repr
            return repr(value)
    if isinstance(value, (list, tuple)):
        return [_json_value(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v, depth + 1) for k, v in value.items()}
    return repr(value)


def _begin_end(spans: list[Span], pid: int, tid: int, t0: float) -> list[dict[str, Any]]:
    """B/E events for spans that nest, in an order where every end matches its begin."""
    events: list[dict[str, Any]] = []
    stack: list[Span] = []

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    def close(upto: float | None) -> None:
        while stack and (upto is None or stack[-1].end <= upto):
            s = stack.pop()
            events.append({"name": s.name, "ph": "E", "ts": us(s.end), "pid": pid, "tid": tid})

    for s in sorted(spans, key=lambda s: (s.start, -s.end)):
        close(s.start)
        args = {str(k): _json_value(v) for k, v in s.args.items()}
        if s.engine:
            args["engine"] = s.engine
        events.append(
            {
                "name": s.name,
                "cat": s.kind,
                "ph": "B",
                "ts": us(s.start),
                "pid": pid,
                "tid": tid,
                "args": args,
            }
        )
        stack.append(s)
    close(None)
    return events


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


def _active() -> Profiler | None:
    """The profiler plugged into the hooks, if the observer there is one."""
    obs = _hooks.observer
    return obs if isinstance(obs, Profiler) else None


def _told(stream: Stream | None) -> tuple[float, Event | None]:
    """A region's start for the listeners: the host's time and, on a stream not capturing a
    graph, a timing event recorded there (None if it cannot be: host times only)."""
    t0 = time.monotonic()  # before the record: the device reaches it no sooner
    start = None
    if stream is not None and not _objects.capturing(stream):
        try:
            start = Event(stream.device, enable_timing=True)
            start.record(stream)
        except Exception:  # noqa: BLE001 - the region's device times are lost, not the program
            _hooks.failed("record_function", "a listener's timing event")
            start = None
    return t0, start


def _tell(name: str, stream: Stream | None, told: tuple[float, Event | None]) -> None:
    t0, start = told
    end = None
    if start is not None and stream is not None:
        try:
            end = Event(stream.device, enable_timing=True)
            end.record(stream)
        except Exception:  # noqa: BLE001
            _hooks.failed("record_function", "a listener's timing event")
            start = end = None
    _hooks.region(name, stream, start, end, (t0, time.monotonic()))


#: the NVTX domain of record_function's ranges (Nsight Systems groups them under it)
NVTX_DOMAIN = "aiostream"


class record_function:  # named as torch.profiler.record_function
    """A named range: ``with``, ``async with``, or a decorator of sync and async functions.

    While a profiler is active it records a host span tagged with the task's name and, with
    ``stream=``, a device range bracketing the work submitted to that stream inside it. With
    no profiler it costs about what ``contextlib.nullcontext()`` does. On CUDA, where the
    ``nvtx`` package is installed (the ``nvtx`` extra), it is also an NVTX range in the
    ``aiostream`` domain, so Nsight Systems shows it: a start/end range, not a push/pop one,
    since tasks on one loop thread enter and leave their ranges interleaved across awaits
    (a thread's push/pop stack would end one task's range at another's exit).

    Args:
        name: the range's name.
        stream: also time the device work submitted to this stream inside the range.
        **args: extra values shown with the span in traces.
    """

    __slots__ = ("_ev", "_range", "_start", "_told", "args", "name", "stream")

    def __init__(self, name: str, *, stream: Stream | None = None, **args: Any) -> None:
        if type(name) is not str:
            raise TypeError(f"name must be a str, got {name!r}")
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"stream must be an aiostream.Stream or None, got {stream!r}")
        self.name = name
        self.stream = stream
        self.args = args

    def __enter__(self) -> record_function:
        if _hooks.observer is None and _hooks.nvtx is None and not _hooks.listeners:
            return self  # the cost with no profiler: this check, and the one in __exit__
        if _hooks.listeners:
            self._told = _told(self.stream)
        prof = _active()
        if _hooks.nvtx is not None:
            try:
                self._range = _hooks.nvtx.start_range(message=self.name, domain=NVTX_DOMAIN)
            except Exception:  # NVTX's failure never becomes the user's
                _hooks.nvtx_failed("start_range")
        if prof is not None:
            try:
                self._start = prof.now()
                if self.stream is not None:
                    self._ev = prof.mark(self.stream)
            except Exception:  # the profiler's failure never becomes the user's
                _hooks.failed(prof, "record_function")
                if hasattr(self, "_start"):
                    del self._start  # no range for this one
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if _hooks.observer is None and _hooks.nvtx is None and not _hooks.listeners:
            return
        told = getattr(self, "_told", None)  # unset when the listener came inside the range
        if told is not None:
            del self._told
            _tell(self.name, self.stream, told)
        prof = _active()
        if _hooks.nvtx is not None and hasattr(self, "_range"):  # not if NVTX began inside
            try:
                _hooks.nvtx.end_range(self._range)
            except Exception:  # nor replaces the user's exception or result
                _hooks.nvtx_failed("end_range")
            del self._range
        start = getattr(self, "_start", None)  # unset when the profile began inside the range
        if start is None or prof is None:
            return
        del self._start
        try:
            prof.add_host(self.name, _task_name(), start, prof.now(), self.args)
            if self.stream is not None:
                end = prof.mark(self.stream)
                prof.add_device_range(self.name, self.stream, self._ev, end, self.args)
        except Exception:  # the profiler's failure never replaces the user's exception or result
            _hooks.failed(prof, "record_function")

    async def __aenter__(self) -> record_function:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)

    def __call__(self, fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"record_function decorates a function, got {fn!r}")
        name, stream, args = self.name, self.stream, self.args
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*a: Any, **k: Any) -> Any:
                if _hooks.observer is None and _hooks.nvtx is None and not _hooks.listeners:
                    return await fn(*a, **k)
                with record_function(name, stream=stream, **args):
                    return await fn(*a, **k)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            if _hooks.observer is None and _hooks.nvtx is None and not _hooks.listeners:
                return fn(*a, **k)
            with record_function(name, stream=stream, **args):
                return fn(*a, **k)

        return wrapper  # type: ignore[return-value]
