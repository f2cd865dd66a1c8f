"""A profile's spans drawn for people: the Chrome trace event format (JSON, which Perfetto and
chrome://tracing open) and a self-contained SVG timeline."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any
from xml.sax.saxutils import escape

from ._spans import Span

__all__ = ["svg", "task_label", "trace_events"]


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


def _more_level(label: str, level: int) -> str:
    """The name of a track's level past its first: where its spans overlap without nesting (a
    device range around work that another range's work overlaps), which one row cannot show."""
    return f"{label}, overlapping spans ({level + 1})"


def _stream_label(track: str, names: dict[str, str]) -> str:
    name = names.get(track)
    return track if name is None else f"{track} ({name})"


def trace_events(
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
            for level, level_spans in enumerate(_nested_levels(by_track[track])):
                tid = (n + 1) * 100 + level
                label = _stream_label(track, stream_names or {}) if pid > 1 else task_label(track)
                events.append(
                    {
                        "name": "thread_name",
                        "ph": "M",
                        "pid": pid,
                        "tid": tid,
                        "args": {"name": label if level == 0 else _more_level(label, level)},
                    }
                )
                events.extend(_begin_end(level_spans, pid, tid, t0))
    return events


def svg(
    spans: list[Span], t0: float, end: float | None, names: dict[str, str] | None = None
) -> str:
    """The timeline as SVG: tasks and streams as tracks, spans as bars, awaits hatched."""
    t1 = max([end or t0] + [s.end for s in spans])
    span = max(t1 - t0, 1e-9)
    tasks, streams = _tracks(spans)
    rows = [("task", t) for t in tasks] + [("stream", t) for t in streams]
    label_w, plot_w, row_h, top = 210, 900, 24, 34
    height = top + row_h * len(rows) + 30
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
    for row, (kind, track) in enumerate(rows):
        y = top + row * row_h
        label = task_label(track) if kind == "task" else _stream_label(track, names or {})
        out.append(f'<g class="track" data-kind="{kind}" data-track="{escape(track)}">')
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
    axis_y = top + row_h * len(rows) + 12
    for k in range(6):
        t = t0 + span * k / 5
        out.append(
            f'<text x="{x(t):.1f}" y="{axis_y}" text-anchor="middle">{(t - t0) * 1e3:.1f} ms</text>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _nested_levels(spans: list[Span]) -> list[list[Span]]:
    """Split one track's spans into levels where every two spans nest or are disjoint."""
    levels: list[list[Span]] = []
    stacks: list[list[Span]] = []
    for s in sorted(spans, key=lambda s: (s.start, -s.end)):
        for level, stack in zip(levels, stacks, strict=True):
            while stack and stack[-1].end <= s.start:
                stack.pop()
            if not stack or s.end <= stack[-1].end:
                level.append(s)
                stack.append(s)
                break
        else:
            levels.append([s])
            stacks.append([s])
    return levels


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
