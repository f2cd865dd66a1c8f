"""What the virtual backend reports of itself, read inside: the leak listing the pytest plugin
prints (``VirtualBackend.leaks()``, no protocol method), exactly, and the timeline's bound
(``scheduler.TIMELINE_LIMIT``, patched down: its real 100,000 operations take seconds to
simulate).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import aiostream as ais
from aiostream.virtual import VirtualClock

pytestmark = pytest.mark.anyio


async def test_the_leak_listing_names_each_thing_left(clock: VirtualClock) -> None:
    """What the pytest plugin prints for a leak: each pending wait (with the work it waits
    for), pending operation, live stream, event and buffer, one line each, in a stable order."""
    from aiostream import _backends

    backend: Any = _backends.get("virtual")
    s, other = ais.Stream(), ais.Stream()
    ais.delay(2.0, stream=s)
    later, first = ais.Event(), ais.Event()
    assert (later.event_id, first.event_id) == (0, 0)  # ids come with the first record
    first.record(s)
    clock.advance(0.5)
    later.record(s)
    ais.delay(1.0, stream=other)  # a second pending operation, submitted after the first
    host, big, buf = ais.HostBuffer(8), ais.DeviceBuffer(32), ais.DeviceBuffer(16)
    async with anyio.create_task_group() as tg:
        tg.start_soon(later.synchronize)
        tg.start_soon(first.synchronize)  # waits by their work's submission, not their own
        await anyio.wait_all_tasks_blocked()
        assert backend.leaks() == [
            "pending wait on virtual:0 stream 1 (for the work up to its 'record', submitted at "
            "t=0.000000000s)",
            "pending wait on virtual:0 stream 1 (for the work up to its 'record', submitted at "
            "t=0.500000000s)",
            "pending operation 'delay' on virtual:0 stream 1, engine compute, submitted at "
            "t=0.000000000s, running until t=2.000000000s",
            "pending operation 'delay' on virtual:0 stream 2, engine compute, submitted at "
            "t=0.500000000s, not started",  # by submission
            "live stream virtual:0 stream 1 (priority 0)",  # by device, then id
            "live stream virtual:0 stream 2 (priority 0)",
            "live event virtual:0 event 1",  # by id: the order they were made in
            "live event virtual:0 event 2",
            "live buffer of 16 bytes on virtual:0",  # device memory by size, then the host's
            "live buffer of 32 bytes on virtual:0",
            "live buffer of 8 bytes on host",
        ]
        tg.cancel_scope.cancel()
    del host, big, buf, other


def test_the_timeline_keeps_the_last_operations(monkeypatch: pytest.MonkeyPatch) -> None:
    """The timeline keeps the last ``TIMELINE_LIMIT`` completed operations (100,000; 5 here),
    the earlier ones dropped, so that a long run holds bounded memory."""
    from aiostream._backends.virtual import scheduler

    monkeypatch.setattr(scheduler, "TIMELINE_LIMIT", 5)
    clock = ais.virtual.VirtualClock()
    ais.virtual.reset(clock=clock)
    s = ais.Stream()
    for _ in range(8):
        ais.delay(1.0, stream=s)
    clock.advance(8.0)
    assert [r.end for r in ais.virtual.timeline()] == [4.0, 5.0, 6.0, 7.0, 8.0]
