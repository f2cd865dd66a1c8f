"""A wait and the tasks around it: it suspends only the task that awaits (README's first
line), waits on one stream resume in the stream's order, and a wait cancelled (or timed
out) goes at once, leaving the other waits watched.
"""

from __future__ import annotations

import threading

import anyio
import anyio.lowlevel
import pytest

import aiostream as ais
from aiostream.virtual import VirtualClock

pytestmark = pytest.mark.anyio


async def test_a_wait_suspends_only_the_calling_task(clock: VirtualClock) -> None:
    """README, first line: the loop runs other tasks, turn after turn, while one awaits. Here
    the other task completes the awaited work on its 20th turn: a wait that held the loop
    would never let it get there (a thread then completes the work, after 30 s)."""
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    turns = 0

    async def other() -> None:
        nonlocal turns
        while not s.query():
            turns += 1
            if turns == 20:
                clock.advance(1.0)
            await anyio.lowlevel.checkpoint()

    rescue = threading.Timer(30, clock.advance, args=(1.0,))
    rescue.start()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            with anyio.fail_after(60):
                await s.synchronize()
            assert s.query()
    finally:
        rescue.cancel()
        rescue.join()
    assert turns >= 20, turns  # a loop held by the wait: the other task ran once or twice


async def test_wait_resumes_other_waits_in_the_same_lane_in_order(clock: VirtualClock) -> None:
    s = ais.Stream()
    order: list[int] = []
    events = []
    for _ in range(5):
        ais.delay(1.0, stream=s)
        events.append(s.record_event())

    async def waiter(i: int) -> None:
        await events[i].synchronize()
        order.append(i)

    async with anyio.create_task_group() as tg:
        for i in reversed(range(5)):  # registered out of order
            tg.start_soon(waiter, i)
        await anyio.wait_all_tasks_blocked()
        for _ in range(5):
            clock.advance(1.0)
            await anyio.wait_all_tasks_blocked()
    assert order == [0, 1, 2, 3, 4]


async def test_a_wait_cancelled_as_it_finishes_leaves_the_others_watched(
    clock: VirtualClock,
) -> None:
    """A task cancelled right after its wait finished (the completion and the cancellation
    in the same turn of the loop) discards a wait already finished: that changes nothing, and
    the wait still pending behind it finishes when its work does."""
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    first = s.record_event()
    ais.delay(1.0, stream=s)
    second = s.record_event()
    scope, finished = anyio.CancelScope(), []

    async def cancelled_wait() -> None:
        with scope:
            await first.synchronize()

    async def wait() -> None:
        await second.synchronize()
        finished.append(second)

    async with anyio.create_task_group() as tg:
        tg.start_soon(cancelled_wait)
        tg.start_soon(wait)
        await anyio.wait_all_tasks_blocked()
        clock.advance(1.0)
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        assert ais.pending_waits() and not finished
        clock.advance(1.0)
        await anyio.wait_all_tasks_blocked()
        assert finished == [second] and not ais.pending_waits()


async def test_timeout_around_a_wait_returns_promptly() -> None:
    s = ais.Stream()
    ais.delay(3600.0, stream=s)
    start = anyio.current_time()
    with anyio.fail_after(60):  # a guard against a hang: the bound is below
        with anyio.move_on_after(0.01) as scope:
            await s.synchronize()
    assert scope.cancelled_caught
    # it returns in about 10 ms; a wait deaf to its cancellation would take an hour
    assert anyio.current_time() - start < 30
    assert ais.virtual.stats().waits == 0
