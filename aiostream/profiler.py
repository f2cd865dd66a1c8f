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
from .stream import Stream

__all__ = ["Profiler", "Span", "Summary", "profile", "record_function"]

F = TypeVar("F", bound=Callable[..., Any])


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

    def __str__(self) -> str:
        lines = [f"{'span':32} {'count':>7} {'total ms':>11} {'mean ms':>10}"]
        for name, (count, total) in sorted(self.spans.items(), key=lambda kv: -kv[1][1]):
            lines.append(
                f"{name[:32]:32} {count:7d} {total * 1e3:11.3f} {total / count * 1e3:10.3f}"
            )
        lines.append("")
        for engine, busy in sorted(self.engine_busy.items()):
            lines.append(f"device busy, {engine:24} {busy * 1e3:11.3f} ms")
        lines.append(f"device busy, any engine{'':9} {self.device_busy * 1e3:11.3f} ms")
        lines.append(f"host busy{'':23} {self.host_busy * 1e3:11.3f} ms")
        lines.append(f"wall{'':28} {self.wall * 1e3:11.3f} ms")
        lines.append(f"overlap (host and device busy / device busy): {self.overlap:.3f}")
        return "\n".join(lines)


class Profiler:
    """Collects spans while active; see :func:`profile`."""

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
        self.start: float | None = None
        self.end: float | None = None
        self.unfinished = 0
        """Device ranges whose work had not completed when the profile ended (not shown)."""

    # ------------------------------------------------------------------ collection

    def now(self) -> float:
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
        self.end = self.now()
        _hooks.uninstall(self)
        self._collect_device()

    def native_timeline(self, stream: Stream) -> bool:
        backend = _objects.backend(stream)
        native = self._native.get(backend)
        if native is None:  # an isinstance() on a Protocol costs microseconds: once per backend
            native = self._native[backend] = isinstance(backend, Timeline)
        return native

    def on_await(self, task: str, subject: str, device: str, start: float, end: float) -> None:
        with self._lock:
            self._spans.append(
                Span("await", f"await {subject}", task, start, end, args={"device": device})
            )

    def add_host(
        self, name: str, task: str, start: float, end: float, args: dict[str, Any]
    ) -> None:
        with self._lock:
            self._spans.append(Span("host", name, task, start, end, args=args))

    def mark(self, stream: Stream) -> Event:
        """A timing event recorded on ``stream`` now."""
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
                    args = {"error": r.error} if r.error else {}
                    spans.append(Span("device", r.name, track, r.start, r.end, r.engine, args))
        for name, stream, ev0, ev1, args, op in self._ranges:
            if not (ev0.query() and ev1.query()):
                self.unfinished += 1
                continue
            ref, t = self._refs[stream.device]
            a = t + ref.elapsed_time(ev0) / 1000
            b = t + ref.elapsed_time(ev1) / 1000
            track = f"{stream.device} stream {stream.stream_id}"
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
        """Time per span name, device busy per engine, host busy, and the overlap ratio."""
        spans = self.spans
        per_name: dict[str, list[float]] = defaultdict(list)
        per_engine: dict[str, list[tuple[float, float]]] = defaultdict(list)
        host: dict[str, list[tuple[float, float]]] = defaultdict(list)
        awaits: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for s in spans:
            if s.kind in ("host", "device"):
                per_name[s.name].append(s.duration)
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
        assert self.start is not None
        end = self.end if self.end is not None else self.now()
        return Summary(
            wall=end - self.start,
            spans={n: (len(d), sum(d)) for n, d in per_name.items()},
            engine_busy={e: _length(_union(ivs)) for e, ivs in per_engine.items()},
            device_busy=device_busy,
            host_busy=_length(busy_host),
            overlap=_length(_intersect(busy_host, busy_device)) / device_busy
            if device_busy
            else 0.0,
        )

    def __str__(self) -> str:
        return str(self.summary())

    def _tracks(self) -> tuple[list[str], list[str]]:
        spans = self.spans
        tasks = list(dict.fromkeys(s.track for s in spans if s.kind in ("host", "await")))
        streams = sorted(
            {s.track for s in spans if s.kind in ("device", "range")},
            key=lambda t: (t.split(" ")[0], int(t.rsplit(" ", 1)[1])),
        )
        return tasks, streams

    def export_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the Chrome trace event format (JSON), which Perfetto and chrome://tracing open:
        one track per host task, one per device stream; times in microseconds from the start."""
        assert self.start is not None
        t0 = self.start
        tasks, streams = self._tracks()
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "host tasks"}}
        ]
        devices = list(dict.fromkeys(t.split(" ")[0] for t in streams))
        for i, dev in enumerate(devices):
            events.append(
                {"name": "process_name", "ph": "M", "pid": 2 + i, "tid": 0, "args": {"name": dev}}
            )
        by_track: dict[str, list[Span]] = defaultdict(list)
        for s in self.spans:
            by_track[s.track].append(s)
        for pid, names in [(1, tasks)] + [
            (2 + i, [t for t in streams if t.split(" ")[0] == dev]) for i, dev in enumerate(devices)
        ]:
            for n, track in enumerate(names):
                for lane, lane_spans in enumerate(_nested_lanes(by_track[track])):
                    tid = (n + 1) * 100 + lane
                    label = track if pid > 1 else f"task {track}"
                    events.append(
                        {
                            "name": "thread_name",
                            "ph": "M",
                            "pid": pid,
                            "tid": tid,
                            "args": {"name": label if lane == 0 else f"{label} ({lane + 1})"},
                        }
                    )
                    events.extend(_begin_end(lane_spans, pid, tid, t0))
        doc = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"source": "aiostream"}}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=0)

    def export_svg(self, path: str | os.PathLike[str]) -> None:
        """Draw the timeline as a self-contained SVG: tasks and streams as lanes, spans as bars,
        awaits as hatched gaps."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_svg())

    def to_svg(self) -> str:
        assert self.start is not None
        t0 = self.start
        t1 = max([self.end or t0] + [s.end for s in self.spans])
        span = max(t1 - t0, 1e-9)
        tasks, streams = self._tracks()
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
            out.append(
                f'<rect x="{lx + i * 92}" y="8" width="12" height="12" fill="{fill}"{extra}/>'
            )
            out.append(f'<text x="{lx + i * 92 + 16}" y="18">{name}</text>')

        def x(t: float) -> float:
            return label_w + (t - t0) / span * plot_w

        by_track: dict[str, list[Span]] = defaultdict(list)
        for s in self.spans:
            by_track[s.track].append(s)
        for row, (kind, track) in enumerate(lanes):
            y = top + row * row_h
            label = f"task {track}" if kind == "task" else track
            out.append(f'<g class="lane" data-kind="{kind}" data-track="{escape(track)}">')
            out.append(
                f'<rect x="{label_w}" y="{y}" width="{plot_w}" height="{row_h - 4}" '
                'fill="#f4f4f4"/>'
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
                f'<text x="{x(t):.1f}" y="{axis_y}" text-anchor="middle">'
                f"{(t - t0) * 1e3:.1f} ms</text>"
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
        args = dict(s.args)
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


class record_function:  # named as torch.profiler.record_function
    """A named range: ``with``, ``async with``, or a decorator of sync and async functions.

    While a profiler is active it records a host span tagged with the task's name and, with
    ``stream=``, a device range bracketing the work submitted to that stream inside it. With
    no profiler it costs about what ``contextlib.nullcontext()`` does. On CUDA, where the
    ``nvtx`` package is installed, it also pushes an NVTX range, so Nsight shows it.

    Args:
        name: the range's name.
        stream: also time the device work submitted to this stream inside the range.
        **args: extra values shown with the span in traces.
    """

    __slots__ = ("_ev", "_start", "args", "name", "stream")

    def __init__(self, name: str, *, stream: Stream | None = None, **args: Any) -> None:
        if type(name) is not str:
            raise TypeError(f"name must be a str, got {name!r}")
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"stream must be an aiostream.Stream or None, got {stream!r}")
        self.name = name
        self.stream = stream
        self.args = args

    def __enter__(self) -> record_function:
        if _hooks.observer is None and _hooks.nvtx is None:
            return self  # the cost with no profiler: this check, and the one in __exit__
        prof = _active()
        if _hooks.nvtx is not None:
            _hooks.nvtx.push_range(self.name)
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
        if _hooks.observer is None and _hooks.nvtx is None:
            return
        prof = _active()
        if _hooks.nvtx is not None:
            _hooks.nvtx.pop_range()
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
        name, stream, args = self.name, self.stream, self.args
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*a: Any, **k: Any) -> Any:
                if _hooks.observer is None and _hooks.nvtx is None:
                    return await fn(*a, **k)
                with record_function(name, stream=stream, **args):
                    return await fn(*a, **k)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            if _hooks.observer is None and _hooks.nvtx is None:
                return fn(*a, **k)
            with record_function(name, stream=stream, **args):
                return fn(*a, **k)

        return wrapper  # type: ignore[return-value]
