"""A profile's spans and what they add up to: :class:`Span`, the algebra of intervals (union,
intersection, difference) and :class:`Summary`, where the time went."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Span", "Summary", "check_str", "summarize"]


def check_str(value: object, name: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {value!r}")


def _check_seconds(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")


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
            check_str(key, "a span name")
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
            check_str(key, "an engine name")
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


def summarize(spans: list[Span], start: float, end: float) -> Summary:
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
