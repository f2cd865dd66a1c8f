"""The virtual device's clocks: a manual ``VirtualClock``, moved by hand from any thread, or any
callable returning seconds, its readings checked; what the device runs when it reaches a
clock's reading (host functions, at their operation's end); and the lazy device of a callable
clock, brought to the clock's reading by the first call into aiostream.

(The monotonic clock, the default, runs through most other tests; blocking waits on every
clock: test_blocking_waits.py.)
"""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.to_thread
import pytest

import aiostream as ais
from aiostream.virtual import VirtualClock

pytestmark = pytest.mark.anyio


# ---------------------------------------------------------------------- a manual clock


async def test_virtual_clock_resumes_waits_only_when_advanced_past(clock: VirtualClock) -> None:
    s = ais.Stream()
    ais.delay(5.0, stream=s)
    e = s.record_event()
    resumed: list[float] = []

    async def waiter() -> None:
        await e.synchronize()
        resumed.append(clock.now())

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        clock.advance(4.9)
        await anyio.wait_all_tasks_blocked()
        await anyio.sleep(0.01)
        assert resumed == []
        clock.advance(0.1)
    assert resumed == [5.0]


async def test_clock_advanced_from_another_thread_wakes_the_loop(clock: VirtualClock) -> None:
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    thread = threading.Timer(0.02, clock.advance, args=(1.0,))
    thread.start()
    try:
        with anyio.fail_after(10):
            await s.synchronize()
    finally:
        thread.join()
    assert clock.now() == 1.0


def test_virtual_clock_rejects_bad_input() -> None:
    clock = VirtualClock(start=2.5)
    assert clock.now() == 2.5 and clock.now_ns() == 2_500_000_000
    assert repr(clock) == "VirtualClock(now=2.5)"
    # a start before zero is a reading like any other (only durations must not be negative)
    assert VirtualClock(start=-1.5).now_ns() == -1_500_000_000
    with pytest.raises(ValueError) as negative:
        clock.advance(-1)
    assert str(negative.value) == "seconds must be >= 0 seconds, got -1"
    with pytest.raises(TypeError) as text:
        clock.advance("1")  # type: ignore[arg-type]
    assert str(text.value) == "seconds must be a number of seconds (int or float), got '1'"
    with pytest.raises(ValueError, match="finite"):
        VirtualClock(float("inf"))


# ---------------------------------------------------------------------- any callable


async def test_any_callable_can_be_the_clock() -> None:
    now = [10.0]
    ais.virtual.reset(clock=lambda: now[0])
    s = ais.Stream()
    start = s.record_event(ais.Event(enable_timing=True))
    ais.delay(0.25, stream=s)
    end = s.record_event(ais.Event(enable_timing=True))
    assert not end.query()
    now[0] = 10.25
    assert end.query()
    await end.synchronize()
    assert start.elapsed_time(end) == 250.0
    assert ais.virtual.now() == 10.25


async def test_a_clock_with_attributes_of_its_own_is_just_a_clock() -> None:
    """A user's clock object whose attributes happen to be named like aiostream's words
    (``stopped``) is read, never asked anything else."""

    class Clock:
        stopped = True  # the user's own flag, not a question aiostream asks

        def __init__(self) -> None:
            self.t = 0.0

        def __call__(self) -> float:
            return self.t

    clock = Clock()
    ais.virtual.reset(clock=clock)
    s = ais.Stream()
    ais.delay(0.5, stream=s)
    waiting = s.record_event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(waiting.synchronize)  # a wait on unfinished work: the clock is asked
        await anyio.sleep(0.01)
        clock.t = 0.5
    assert ais.virtual.now() == 0.5


async def test_a_callable_clock_advanced_from_a_task_resumes_waits(anyio_backend: object) -> None:
    """A clock callable that a task moves (a fake-time loop's clock, say): awaits resume at
    the next call into aiostream after the work's end, here another task's query."""
    now = [0.0]
    ais.virtual.reset(clock=lambda: now[0])
    s = ais.Stream()
    ais.delay(10.0, stream=s)
    resumed_at: list[float] = []

    async def waiter() -> None:
        await s.synchronize()
        resumed_at.append(now[0])

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        for step in (2.5, 5.0, 7.5):
            now[0] = step
            assert s.query() is False
            await anyio.wait_all_tasks_blocked()
            assert resumed_at == []
        now[0] = 10.0
        assert s.query() is True
        with anyio.fail_after(5):  # the waiter's own timer is 10 s away
            while not resumed_at:
                await anyio.sleep(0.001)
    assert resumed_at == [10.0]
    assert ais.virtual.stats().waits == 0


def test_an_async_clock_is_refused_with_what_to_give() -> None:
    async def clock() -> float:
        return 0.0

    with pytest.raises(TypeError) as info:
        ais.virtual.reset(clock=clock)
    assert str(info.value) == (
        f"clock must return seconds when called; {clock!r} is an async function (its call "
        "returns a coroutine): give a plain function"
    )


def test_a_clock_returning_a_coroutine_is_refused_and_the_coroutine_closed() -> None:
    """A plain callable that returns a coroutine (not an async function, so not refused when
    given): its reading is refused, and the coroutine is closed there, not left to warn
    "never awaited" when collected."""

    async def seconds() -> float:
        return 0.0

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a "never awaited" warning would fail the test
        with pytest.raises(TypeError, match="not a number of seconds") as info:
            ais.virtual.reset(clock=lambda: seconds())
        del info
        gc.collect()


@pytest.mark.parametrize("reading", [float("inf"), float("-inf"), float("nan"), 1e300])
def test_a_clock_that_reads_no_time_is_refused(reading: float) -> None:
    with pytest.raises(ValueError, match=r"clock returned .* seconds"):
        ais.virtual.reset(clock=lambda: reading)


async def test_a_clock_may_read_below_zero() -> None:
    """A callable clock reads seconds, float or int, from any origin, below zero too (an
    offset clock): only the time between readings matters."""
    readings = iter([-10, -10, -9.5, -9])
    ais.virtual.reset(clock=lambda: next(readings, -9))
    s = ais.Stream()
    ais.virtual.submit(s, 1.0)
    assert not s.query()  # 0.5 s in
    assert s.query()  # 1 s in: done


def test_a_clock_that_goes_bad_later_is_refused_at_that_reading() -> None:
    readings: Iterator[object] = iter([0.0, 0.0, 0.0])
    ais.virtual.reset(clock=lambda: next(readings, "soon"))
    s = ais.Stream()
    ais.virtual.submit(s, 1.0)
    with pytest.raises(TypeError, match="clock returned 'soon'"):
        for _ in range(5):
            s.query()


# ---------------------------------------------------------------------- host functions


def test_effects_apply_at_completion_not_submission(clock: VirtualClock) -> None:
    data: list[str] = []
    s = ais.Stream()
    ais.virtual.submit(s, 1.0, engine="h2d", fn=lambda: data.append("landed"))
    assert data == []
    clock.advance(0.999)
    assert s.query() is False and data == []
    clock.advance(0.001)
    assert s.query() is True and data == ["landed"]


def test_a_host_function_runs_when_the_clock_reaches_it() -> None:
    clock = VirtualClock()
    ais.virtual.reset(clock=clock)
    landed: list[float] = []
    s = ais.Stream()
    ais.virtual.submit(s, 0.5, engine="h2d", fn=lambda: landed.append(clock.now()))
    clock.advance(0.4)
    assert landed == []
    clock.advance(1.1)  # no other call into aiostream: the device reached it all the same
    assert landed == [1.5]


def test_a_host_function_on_a_callable_clock_runs_at_the_first_call_after_its_end() -> None:
    """On the monotonic or a callable clock the device is lazy: a host function runs in the
    first call into aiostream (a wait, a query) after its operation's end, not before, and
    the operation ends at its own instant whenever that call comes."""
    now = [0.0]
    ais.virtual.reset(clock=lambda: now[0])
    ran_at: list[float] = []
    s = ais.Stream()
    ais.virtual.submit(s, 0.5, engine="h2d", name="upload", fn=lambda: ran_at.append(now[0]))
    now[0] = 0.4
    assert s.query() is False and ran_at == []
    now[0] = 3.0  # past the end; nothing has looked
    assert ran_at == []
    assert s.query() is True
    assert ran_at == [3.0]  # run by the query, at its reading of the clock
    assert [(r.name, r.start, r.end) for r in ais.virtual.timeline()] == [("upload", 0.0, 0.5)]
    s.query()
    assert ran_at == [3.0]  # once


def test_a_host_function_that_asks_the_device_leaves_the_timeline_as_it_was() -> None:
    """A host function runs while the device reaches the clock's now: what it asks (a query)
    sees the instant the function runs at, and moves nothing; the work after it still runs."""
    clk = VirtualClock()
    ais.virtual.reset(clock=clk, compute_slots=2)
    s, t = ais.Stream(), ais.Stream()
    seen: list[bool] = []
    ais.delay(1.0, stream=t)
    ais.virtual.submit(s, 1.0, fn=lambda: seen.append(t.query()))
    ais.delay(0.5, stream=s)
    clk.advance(2.0)
    assert s.query() and t.query()
    assert seen == [False]  # t's work ends at the same instant, after s's in stream order
    ran = [(r.name, r.stream, r.start, r.end) for r in ais.virtual.timeline()]
    assert ran == [
        ("compute", s.stream_id, 0.0, 1.0),
        ("delay", t.stream_id, 0.0, 1.0),
        ("delay", s.stream_id, 1.0, 1.5),
    ]


# ---------------------------------------------------------------------- a lazy device


def _failing_later() -> tuple[list[float], ais.Stream, ais.Event, ais.Event]:
    """On a callable clock: 1 s of work between two timed events on one stream, and an
    operation on another stream that fails the device at 2.0 s."""
    now = [0.0]
    ais.virtual.reset(clock=lambda: now[0])
    a, b = ais.Stream(), ais.Stream()
    start = a.record_event(ais.Event(enable_timing=True))
    ais.delay(1.0, stream=a)
    end = a.record_event(ais.Event(enable_timing=True))
    ais.virtual.submit(b, 2.0, engine="h2d", error="ecc error")
    now[0] = 1.5
    assert end.query() is True  # the work is done; the failure is not yet
    return now, a, start, end


@pytest.mark.parametrize("call", ["event query", "stream query", "elapsed_time", "wait"])
async def test_a_failure_that_came_due_is_seen_by_the_first_call_after_it(
    anyio_backend: object, call: str
) -> None:
    """The device is lazy on a callable clock: whatever call first looks after the failing
    operation's end (at that very instant here) processes it and raises, though its own
    work had completed before, as every later call does (device errors are sticky)."""
    now, a, start, end = _failing_later()
    assert start.elapsed_time(end) == 1000.0
    now[0] = 2.0
    first: dict[str, Any] = {
        "event query": end.query,
        "stream query": a.query,
        "elapsed_time": lambda: start.elapsed_time(end),
        "wait": a.synchronize_blocking,
    }
    with pytest.raises(ais.DeviceError, match="ecc error"):
        await anyio.to_thread.run_sync(first[call])
    for later in first.values():
        with pytest.raises(ais.DeviceError, match="ecc error"):
            await anyio.to_thread.run_sync(later)


def test_inspection_brings_the_device_to_its_clock_first() -> None:
    """``stats()`` and ``timeline()`` on a callable clock, with nothing else called since
    the work's end: they show it done."""
    for inspect in ("stats", "timeline"):
        now = [0.0]
        ais.virtual.reset(clock=lambda now=now: now[0])
        s = ais.Stream()
        ais.virtual.submit(s, 1.0, name="kernel")
        now[0] = 2.0
        if inspect == "stats":
            assert ais.virtual.stats().operations == 0
        else:
            assert [(r.name, r.end) for r in ais.virtual.timeline()] == [("kernel", 1.0)]
