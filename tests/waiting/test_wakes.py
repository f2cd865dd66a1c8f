"""When the waiter looks, and what it checks: it sleeps until the backend's next completion (a
timer on the real clock, no timer at all on a manual one), is woken early by new work that
ends sooner or by a completion seen on any thread, and then checks only the waits whose work
completed, never polling the others.

The waiter's looks and checks are counted from outside, by what it asks of the backend
(tests/helpers/virtual.py).
"""

from __future__ import annotations

import anyio
import pytest

import aiostream as ais
from aiostream.virtual import VirtualClock
from tests.helpers.virtual import spy_on_waits

pytestmark = pytest.mark.anyio


# ---------------------------------------------------------------------- what a look checks


@pytest.mark.slow  # 10,000 waits: a test at scale
async def test_sweeps_check_one_wait_per_stream(
    clock: VirtualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = spy_on_waits(monkeypatch)
    streams = [ais.Stream() for _ in range(4)]
    events = []
    for _step in range(2500):
        for s in streams:
            ais.delay(0.001, stream=s)
            events.append(s.record_event())
    finished = 0

    async def waiter(e: ais.Event) -> None:
        nonlocal finished
        await e.synchronize()
        finished += 1

    async with anyio.create_task_group() as tg:
        for e in events:
            tg.start_soon(waiter, e)
        await anyio.wait_all_tasks_blocked()
        assert ais.virtual.stats().waits == 10_000
        checks_before = spy.checks
        clock.advance(0.0015)  # one operation of the first stream completes
        await anyio.wait_all_tasks_blocked()
        assert finished == 1
        # at most one failed check per stream, plus one per completed wait
        assert spy.checks - checks_before <= len(streams) + finished
        clock.advance(100.0)
    assert finished == 10_000
    assert ais.virtual.stats().waits == 0


async def test_each_wait_is_checked_once_when_told_and_the_checks_add_up(
    clock: VirtualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two waits on work that completes a second apart, on a clock moved by hand: each is
    checked once, when the backend tells the waiter its work completed."""
    spy = spy_on_waits(monkeypatch)
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    first = s.record_event()
    ais.delay(1.0, stream=s)
    second = s.record_event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(first.synchronize)
        tg.start_soon(second.synchronize)
        await anyio.wait_all_tasks_blocked()
        assert spy.checks == 0
        clock.advance(1.0)
        await anyio.wait_all_tasks_blocked()
        assert spy.checks == 1
        clock.advance(1.0)
    assert spy.checks == 2


# ---------------------------------------------------------------------- when the waiter looks


async def test_waiting_on_a_manual_clock_does_not_poll(
    clock: VirtualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = spy_on_waits(monkeypatch)
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    async with anyio.create_task_group() as tg:
        tg.start_soon(s.synchronize)
        await anyio.wait_all_tasks_blocked()
        checks = spy.checks
        await anyio.sleep(0.05)  # real time passes; device time does not
        assert spy.checks == checks
        clock.advance(1.0)


async def test_the_waiter_looks_when_a_wait_begins_and_when_told_nothing_more(
    clock: VirtualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a clock that moves only when told, the waiter wakes exactly twice for one wait:
    once when the wait begins (the backend has told it nothing yet: it checks nothing and
    sleeps, with no timer), once when the backend tells it the work completed, and checks
    that wait then; no poll in between, however long the wait."""
    spy = spy_on_waits(monkeypatch)
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    e = s.record_event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(e.synchronize)
        await anyio.wait_all_tasks_blocked()
        assert (spy.wakes, spy.checks) == (1, 0)
        for _ in range(10):
            await anyio.sleep(0.01)  # real time goes by; the device's time does not
        assert (spy.wakes, spy.checks) == (1, 0)
        clock.advance(1.0)
    assert (spy.wakes, spy.checks) == (2, 1)  # the wait checked once: when told


async def test_real_time_waits_sleep_until_the_completion(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = spy_on_waits(monkeypatch)
    s = ais.Stream()
    ais.delay(0.05, stream=s)
    e = s.record_event()

    async def waiter() -> None:
        await e.synchronize()
        assert e.query()  # resumed no earlier than the completion

    with anyio.fail_after(60):  # 50 ms of work
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
    # a timer set for the completion, not polling: one look when the wait began, one when the
    # timer fired, and a few spare for timers that fire a hair early (libuv's, under uvloop,
    # count whole milliseconds: on a busy machine one fired early twice); polling would look
    # 25 times or more in 50 ms. The wait is checked once, when the backend told it complete
    assert 2 <= spy.wakes <= 6
    assert spy.checks == 1


# ---------------------------------------------------------------------- woken early


async def test_a_wait_on_shorter_work_submitted_while_the_waiter_sleeps_resumes_promptly() -> None:
    """Real time: the waiter sleeps toward the end of an hour of work when 1 ms of work is
    submitted and awaited; that wait resumes after about 1 ms, not when the waiter's timer
    for the long work fires."""
    long, short = ais.Stream(), ais.Stream()
    ais.virtual.submit(long, 3600.0, engine="h2d")
    async with anyio.create_task_group() as tg:
        tg.start_soon(long.synchronize)
        await anyio.wait_all_tasks_blocked()  # the waiter sleeps until the long work's end
        start = anyio.current_time()
        ais.delay(0.001, stream=short)
        with anyio.fail_after(60):  # a waiter left asleep would take an hour
            await short.synchronize()
        late = anyio.current_time() - start
        assert long.query() is False
        tg.cancel_scope.cancel()
    assert late < 30, late  # about 1 ms; the long work's end is an hour away
    assert ais.virtual.stats().waits == 0


async def test_work_submitted_while_the_waiter_sleeps_behind_a_stall_resumes_its_wait() -> None:
    """Real time: the only running work is held by a stalled engine, so the waiter sleeps
    until told; work then submitted to another engine runs, and a wait on it resumes when it
    completes, not when the stall is released."""
    held, free = ais.Stream(), ais.Stream()
    stall = ais.virtual.stall("compute")
    ais.delay(0.001, stream=held)
    resumed = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(held.synchronize)
        await anyio.wait_all_tasks_blocked()  # the waiter: nothing runs, sleep until told
        ais.virtual.submit(free, 0.001, engine="h2d")

        async def wait_free() -> None:
            await free.synchronize()
            resumed.set()

        tg.start_soon(wait_free)
        with anyio.move_on_after(30):  # about 1 ms; left asleep, it would wait for the stall
            await resumed.wait()
        assert resumed.is_set()
        assert held.query() is False
        stall.release()
    assert held.query() is True
    assert ais.virtual.stats().waits == 0


async def test_a_completion_seen_on_the_loop_s_thread_wakes_the_sleeping_waiter() -> None:
    """A clock callable advanced from a task: the next call into aiostream on the loop's own
    thread (here a query) processes the completion, and that wakes the waiting task at once,
    not when the waiter's timer for the old reading of the clock fires (an hour)."""
    now = [0.0]
    ais.virtual.reset(clock=lambda: now[0])
    s = ais.Stream()
    ais.delay(3600.0, stream=s)
    resumed = anyio.Event()

    async def waiter() -> None:
        await s.synchronize()
        resumed.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()  # the waiter sleeps for an hour
        now[0] = 3600.0  # the clock moves; nothing has looked at it yet
        assert not resumed.is_set()
        assert s.query() is True  # this call completes the work, on the loop's thread
        with anyio.move_on_after(30):  # at once; a waiter left asleep would take an hour
            await resumed.wait()
        tg.cancel_scope.cancel()
    assert resumed.is_set()
    assert ais.virtual.stats().waits == 0


async def test_a_completion_between_sweep_and_hint_is_not_slept_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The work completes while the waiter is between its checks (just after it asked the
    backend when to wake, before it sleeps): it must still wake."""
    now = [0.0]
    ais.virtual.reset(clock=lambda: now[0])
    spy = spy_on_waits(monkeypatch)
    s = ais.Stream()
    ais.delay(0.001, stream=s)
    wake_hint = spy.backend.wake_hint

    def hint_then_time_passes(index: int) -> float | None:
        delay: float | None = wake_hint(index)
        now[0] = 1.0  # the last operation is due the moment the waiter has its answer
        return delay

    monkeypatch.setattr(spy.backend, "wake_hint", hint_then_time_passes)
    with anyio.fail_after(5):
        await s.synchronize()
    assert ais.virtual.stats().waits == 0
    assert spy.checks >= 1  # checked once told, after the time passed
