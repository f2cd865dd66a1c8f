"""What the waiter keeps alive: its record of the waits (``waiters.Entry``), counted in the
process. One long wait does not keep every later, finished one (the waiter compacts its
record past ``_COMPACT_MIN`` settled entries), and an error a wait raised keeps none.

Counting the waiter's own records needs its insides: a wait target, which the backend hands
out, outlives its wait in the kept error's traceback, so counting targets cannot tell the
waiter's bookkeeping from that.
"""

from __future__ import annotations

import gc

import anyio
import anyio.lowlevel
import pytest

import aiostream as ais
from aiostream._waiting import waiters
from aiostream.virtual import VirtualClock
from tests.helpers.waits import synchronize_keeping

pytestmark = pytest.mark.anyio


def entries() -> int:
    """How many waits (``waiters.Entry``) are alive in the process, after a collection."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is waiters.Entry)


async def test_a_long_wait_does_not_keep_the_finished_ones_alive(clock: VirtualClock) -> None:
    """One wait pending for the whole program while 300 others come and go: the waiter
    holds on to a bounded number of them, not to every wait since the long one began."""
    before = entries()  # earlier tests' loops may still hold theirs, uncollected
    long, short = ais.Stream(), ais.Stream()
    ais.delay(1000.0, stream=long)
    async with anyio.create_task_group() as tg:
        tg.start_soon(long.synchronize)
        await anyio.wait_all_tasks_blocked()

        async def settle(waits: int) -> None:
            while ais.virtual.stats().waits != waits:
                await anyio.lowlevel.checkpoint()

        for _ in range(300):
            ais.virtual.submit(short, 0.001, engine="h2d")
            tg.start_soon(short.synchronize)
            await settle(2)
            clock.advance(0.001)
            await settle(1)
        alive = entries() - before
        assert ais.virtual.stats().waits == 1
        assert alive <= 2 * 1 + waiters._COMPACT_MIN + 1, alive  # 300 without compaction
        tg.cancel_scope.cancel()


async def test_a_kept_device_error_keeps_no_wait_alive() -> None:
    """A program may keep the errors its waits raised (in a log, a list): each keeps its own
    traceback, never the waiter's bookkeeping nor the other waits, finished long ago."""
    clock = VirtualClock()
    ais.virtual.reset(clock=clock, compute_slots=51)  # every stream's work at once
    before = entries()
    kept: list[ais.DeviceError] = []
    good, bad = [ais.Stream() for _ in range(50)], ais.Stream()  # work of 0.5 s and a failure
    for s in good:
        ais.delay(0.5, stream=s)
    ais.virtual.submit(bad, 1.0, error="boom")
    async with anyio.create_task_group() as tg:
        for s in [*good, bad]:
            tg.start_soon(synchronize_keeping, s, kept)
        await anyio.wait_all_tasks_blocked()
        clock.advance(1.0)  # every wait finishes in one look: the device failed
    assert len(kept) == 51
    assert entries() == before, entries() - before
