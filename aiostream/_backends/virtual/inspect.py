"""What is left on a virtual backend, as lines a person reads (the leak checker's listing)."""

from __future__ import annotations

from collections.abc import Iterable

from .model import RUNNING, Event, Item, Memory, Stream

__all__ = ["leaks"]


def _at(ns: int) -> str:
    return f"t={ns / 1e9:.9f}s"


def leaks(
    waits: Iterable[Item],
    operations: Iterable[Item],
    streams: Iterable[Stream],
    events: Iterable[Event],
    memory: Iterable[Memory],
) -> list[str]:
    """One line per pending wait (given by the item it waits for), pending operation, live
    stream, live event and live buffer; each group in a stable order."""
    lines = [
        f"pending wait on {item.device.name} stream {item.stream.id} "
        f"(for the work up to its {item.name!r}, submitted at {_at(item.submit)})"
        for item in waits
    ]
    for item in operations:
        when = f"running until {_at(item.end)}" if item.state == RUNNING else "not started"
        lines.append(
            f"pending operation {item.name!r} on {item.device.name} stream {item.stream.id}, "
            f"engine {item.engine.name if item.engine else None}, submitted at "
            f"{_at(item.submit)}, {when}"
        )
    for stream in sorted(streams, key=lambda s: (s.device.index, s.id)):
        lines.append(
            f"live stream {stream.device.name} stream {stream.id} (priority {stream.priority})"
        )
    for event in sorted(events, key=lambda e: e.state.id):
        lines.append(f"live event {event.device.name} event {event.state.id}")
    for mem in sorted(memory, key=lambda m: (m.host, len(m.data))):
        where = "host" if mem.host else mem.device.name
        lines.append(f"live buffer of {len(mem.data)} bytes on {where}")
    return lines
