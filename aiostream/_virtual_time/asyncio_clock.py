"""Fake time for a running asyncio event loop: time jumps to the next timer when all is blocked.

The loop's ``time()`` is replaced by a clock that starts at 0.0 and moves only by jumps, and its
selector, when asked to wait for I/O until the next timer, first polls without waiting and, if
nothing is ready, jumps the clock to that timer instead of sleeping. Timers that existed before
are shifted onto the fake clock and shifted back afterwards. This is trio's ``MockClock`` with
``autojump_threshold=0``, for asyncio's selector loops (the default on Linux and macOS).

Jumps also happen while a worker thread is busy (as with trio's autojump): a timeout around
``to_thread`` work fires at once. Keep such work out of tests that use fake time.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Iterator
from typing import Any

__all__ = ["FakeLoopTime", "supported"]


def supported(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` is a selector loop whose clock can be faked (uvloop's cannot)."""
    return (
        isinstance(loop, asyncio.BaseEventLoop)
        and hasattr(loop, "_selector")
        and hasattr(loop, "_scheduled")
    )


class FakeLoopTime:
    """The fake clock of one loop, while :meth:`installed` is active."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        if not supported(loop):
            raise TypeError(
                f"cannot fake the clock of {type(loop).__module__}.{type(loop).__name__}"
            )
        self._loop: Any = loop
        self._now = 0.0
        self._real_select: Any = None

    def time(self) -> float:
        """The fake time in seconds: 0.0 when installed, then moved by jumps only."""
        return self._now

    def _select(self, timeout: float | None = None) -> Any:
        if timeout is None:
            return self._real_select(timeout)
        scheduled = self._loop._scheduled
        if timeout <= 0:
            events = self._real_select(timeout)
            if not events and scheduled and scheduled[0]._when <= self._now:
                self._reach(scheduled[0]._when)  # due, yet asyncio may not see it (below)
            return events
        events = self._real_select(0)
        if events:
            return events
        # asyncio computed ``timeout`` from the earliest live timer; land on it exactly
        when = scheduled[0]._when if scheduled else self._now + timeout
        if when > self._now:
            self._reach(when)
        return []

    def _reach(self, when: float) -> None:
        """Move the clock to ``when``, or just past it where asyncio would not run it there.

        asyncio runs a timer once it is earlier than now plus the clock's resolution; past
        2**24 s a float cannot hold that sum (it rounds back to now), so the clock lands one
        float past the timer, else the loop would spin on it forever.
        """
        now = max(when, self._now)
        if not now + self._loop._clock_resolution > when:
            now = math.nextafter(now, math.inf)
        self._now = now

    def _shift_timers(self, delta: float) -> None:
        for handle in self._loop._scheduled:  # a uniform shift keeps the heap ordered
            handle._when += delta

    @contextlib.contextmanager
    def installed(self) -> Iterator[FakeLoopTime]:
        loop = self._loop
        selector = loop._selector
        self._shift_timers(self._now - loop.time())
        self._real_select = selector.select
        loop.time = self.time
        selector.select = self._select
        try:
            yield self
        finally:
            del selector.select
            del loop.time
            self._shift_timers(loop.time() - self._now)
