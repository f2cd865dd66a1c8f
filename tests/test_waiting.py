"""Loop integration: fast path, stream-order sweeps, timers, cancellation, late wake-ups."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import aiostream as ais
from aiostream import _waiting
from aiostream.virtual import VirtualClock

pytestmark = pytest.mark.anyio


def the_waiter() -> _waiting._Waiter:
    (waiter,) = _waiting._waiters.get().values()
    return waiter


async def test_complete_work_takes_the_fast_path(clock: VirtualClock) -> None:
    e = ais.Stream().record_event()
    await e.synchronize()
    with pytest.raises(LookupError):
        _waiting._waiters.get()  # no waiter was ever needed
    assert ais.virtual.stats().waits == 0


async def test_sweeps_check_one_wait_per_stream(clock: VirtualClock) -> None:
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
        waiter_ = the_waiter()
        assert ais.virtual.stats().waits == 10_000
        checks_before = waiter_.checks
        clock.advance(0.0015)  # one operation of the first stream completes
        await anyio.wait_all_tasks_blocked()
        assert finished == 1
        # at most one failed check per stream, plus one per completed wait
        assert waiter_.checks - checks_before <= len(streams) + finished
        clock.advance(100.0)
    assert finished == 10_000
    assert ais.virtual.stats().waits == 0


async def test_waiting_on_a_manual_clock_does_not_poll(clock: VirtualClock) -> None:
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    async with anyio.create_task_group() as tg:
        tg.start_soon(s.synchronize)
        await anyio.wait_all_tasks_blocked()
        checks = the_waiter().checks
        await anyio.sleep(0.05)  # real time passes; device time does not
        assert the_waiter().checks == checks
        clock.advance(1.0)


async def test_real_time_waits_sleep_until_the_completion() -> None:
    s = ais.Stream()
    ais.delay(0.05, stream=s)
    e = s.record_event()
    started = anyio.Event()

    async def waiter() -> None:
        started.set()  # the main task runs again once this one is suspended in the wait
        await e.synchronize()
        assert e.query()  # resumed no earlier than the completion

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await started.wait()
        waiter_ = the_waiter()
    # a timer set for the completion, not polling: one look when the wait began, one when the
    # timer fired, and one spare for a timer that fires a hair early; the wait is checked
    # once, when the backend told it complete
    assert 2 <= waiter_.wakes <= 3
    assert waiter_.checks == 1


async def test_cancelled_waits_are_removed_and_the_waiter_exits(clock: VirtualClock) -> None:
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    events = [s.record_event() for _ in range(200)]
    async with anyio.create_task_group() as tg:
        for e in events:
            tg.start_soon(e.synchronize)
        await anyio.wait_all_tasks_blocked()
        assert ais.virtual.stats().waits == 200
        tg.cancel_scope.cancel()
    assert ais.virtual.stats().waits == 0
    await anyio.wait_all_tasks_blocked()
    assert _waiting._waiters.get() == {}  # the waiter saw nothing pending and left
    assert not s.query()  # the device work goes on
    clock.advance(1.0)
    assert s.query()


async def test_timeout_around_a_wait_returns_promptly() -> None:
    s = ais.Stream()
    ais.delay(3600.0, stream=s)
    with anyio.fail_after(5):  # far beyond what prompt means; it returns in ~10 ms
        with anyio.move_on_after(0.01):
            await s.synchronize()
    assert ais.virtual.stats().waits == 0


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


def test_a_late_wake_up_after_the_loop_closed_is_harmless(clock: VirtualClock) -> None:
    captured: list[_waiting._Waiter] = []
    s = ais.Stream()
    ais.delay(1.0, stream=s)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.synchronize)
            await anyio.wait_all_tasks_blocked()
            captured.append(the_waiter())
            tg.cancel_scope.cancel()

    asyncio.run(main())
    captured[0]._kick_threadsafe()  # the loop is closed: nothing raises
    clock.advance(1.0)  # no listener left to call
    assert ais.virtual.stats().waits == 0


def test_in_loop_thread_detection() -> None:
    assert _waiting.in_loop_thread() is False

    async def inside() -> bool:
        return _waiting.in_loop_thread()

    assert anyio.run(inside) is True
    assert anyio.run(inside, backend="trio") is True


async def test_a_completion_between_sweep_and_hint_is_not_slept_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The work completes while the waiter is between its checks: it must still wake."""
    now = [0.0]
    ais.virtual.reset(clock=lambda: now[0])
    s = ais.Stream()
    ais.delay(0.001, stream=s)
    real_sweep = _waiting._TimedWaiter._sweep

    def sweep_then_time_passes(self: _waiting._TimedWaiter) -> float | None:
        delay = real_sweep(self)
        now[0] = 1.0  # the last operation is due the moment the sweep is done
        return delay

    monkeypatch.setattr(_waiting._TimedWaiter, "_sweep", sweep_then_time_passes)
    with anyio.fail_after(5):
        await s.synchronize()
    assert ais.virtual.stats().waits == 0


# ---------------------------------------------------------------------- strategies


def test_the_wait_strategy_is_chosen_globally_or_by_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AIOSTREAM_WAIT_STRATEGY", raising=False)
    assert ais.get_wait_strategy() == "hybrid"
    monkeypatch.setenv("AIOSTREAM_WAIT_STRATEGY", "thread")
    assert ais.get_wait_strategy() == "thread"
    ais.set_wait_strategy("poll")
    try:
        assert ais.get_wait_strategy() == "poll"  # the call wins over the environment
    finally:
        ais.set_wait_strategy(None)
    assert ais.get_wait_strategy() == "thread"
    monkeypatch.setenv("AIOSTREAM_WAIT_STRATEGY", "spin")
    with pytest.raises(ValueError, match="AIOSTREAM_WAIT_STRATEGY='spin' is not a wait strategy"):
        ais.get_wait_strategy()
    with pytest.raises(ValueError, match="'hybrid', 'poll', 'thread', 'callback'"):
        ais.set_wait_strategy("spin")
    with pytest.raises(TypeError, match="strategy must be a str"):
        ais.set_wait_strategy(1)  # type: ignore[arg-type]


async def test_a_bad_strategy_is_refused_even_on_the_fast_path(anyio_backend: object) -> None:
    s = ais.Stream()
    with pytest.raises(ValueError, match="strategy must be one of"):
        await s.synchronize(strategy="busy")
    with pytest.raises(TypeError, match="strategy must be a str"):
        await s.record_event().synchronize(strategy=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", ["hybrid", "poll", "thread", "callback"])
async def test_virtual_waits_take_any_strategy_and_sleep_until_completion(
    clock: ais.virtual.VirtualClock, anyio_backend: object, strategy: str
) -> None:
    """The virtual backend knows when work completes: every strategy waits on that moment."""
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    e = s.record_event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: e.synchronize(strategy=strategy))
        await anyio.wait_all_tasks_blocked()
        assert not e.query()
        clock.advance(1.0)
    assert e.query()


# ---------------------------------------------------------------------- strategies, in Python
#
# A backend that, like the CUDA driver, cannot say when work will complete: its waits finish
# when the test says so, from another thread. It runs the strategies' control flow on every
# loop without a driver (test_cuda.py runs it against the stand-in driver and on GPUs).


class _Work:
    def __init__(self, lane: str, seq: int) -> None:
        self.lane, self.seq = lane, seq
        self.complete = threading.Event()
        self.checks = 0
        self.released = False

    def done(self) -> bool:
        self.checks += 1
        return self.complete.is_set()

    def release(self) -> None:
        self.released = True


class _ManualBackend:
    kind = "manual"
    completion_times = False

    def __init__(self) -> None:
        self.blocked: list[_Work] = []
        self.notified: list[_Work] = []

    def wake_hint(self, index: int) -> float | None:
        return None

    def subscribe(self, index: int, callback: object) -> object:
        return lambda: None

    def block(self, target: _Work) -> None:
        self.blocked.append(target)
        target.complete.wait()

    def notify_done(self, target: _Work, fn: Any) -> None:
        self.notified.append(target)
        threading.Thread(target=lambda: (target.complete.wait(), fn()), daemon=True).start()


def _complete_later(work: _Work, seconds: float) -> None:
    threading.Timer(seconds, work.complete.set).start()


@pytest.mark.parametrize("strategy", ["hybrid", "poll", "thread", "callback"])
async def test_each_strategy_wakes_its_wait(anyio_backend: object, strategy: str) -> None:
    backend = _ManualBackend()
    work = _Work("s", 0)
    _complete_later(work, 0.03)
    with anyio.fail_after(5):
        await _waiting.wait(backend, 0, work, "work", strategy=strategy)  # type: ignore[arg-type]
    assert work.complete.is_set() and work.released
    assert backend.blocked == ([work] if strategy in ("hybrid", "thread") else [])
    assert backend.notified == ([work] if strategy == "callback" else [])
    if strategy == "poll":
        assert 3 <= work.checks < 200  # backed off: far fewer checks than loop turns in 30 ms


class _FrozenLoopTime:
    """The waiter's view of the loop clock, moved only by the test: a machine under load can
    take longer than hybrid's hand-off window between two loop turns, a frozen clock cannot."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def loop_time(monkeypatch: pytest.MonkeyPatch) -> _FrozenLoopTime:
    frozen = _FrozenLoopTime()
    monkeypatch.setattr(_waiting, "_loop_time", frozen)
    return frozen


async def test_hybrid_catches_short_waits_without_a_thread(
    anyio_backend: object, loop_time: _FrozenLoopTime
) -> None:
    backend = _ManualBackend()
    work = _Work("s", 0)

    async def finish_soon() -> None:
        await anyio.lowlevel.checkpoint()
        loop_time.now += _waiting.HYBRID_HANDOFF_S / 2  # within the window
        work.complete.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(finish_soon)
            await _waiting.wait(backend, 0, work, "work", strategy="hybrid")  # type: ignore[arg-type]
    assert backend.blocked == []
    assert work.checks >= 2  # polled while pending, then seen complete


async def test_hybrid_hands_a_wait_past_its_window_to_a_thread(
    anyio_backend: object, loop_time: _FrozenLoopTime
) -> None:
    backend = _ManualBackend()
    work = _Work("s", 0)

    async def outlast_the_window() -> None:
        await anyio.lowlevel.checkpoint()
        loop_time.now += 2 * _waiting.HYBRID_HANDOFF_S  # the window has passed, work pending
        while not backend.blocked:
            await anyio.sleep(0.001)
        work.complete.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(outlast_the_window)
            await _waiting.wait(backend, 0, work, "work", strategy="hybrid")  # type: ignore[arg-type]
    assert backend.blocked == [work] and work.released


async def test_back_to_back_waits_are_never_lost(anyio_backend: object) -> None:
    """Each wait starts while the previous one's waiter may still be closing its task group."""
    backend = _ManualBackend()
    for i in range(30):
        work = _Work("s", i)
        _complete_later(work, 0.001)
        with anyio.fail_after(5):
            await _waiting.wait(backend, 0, work, "work", strategy="thread")  # type: ignore[arg-type]


async def test_a_cancelled_thread_wait_is_abandoned_at_once(anyio_backend: object) -> None:
    backend = _ManualBackend()
    work = _Work("s", 0)
    with anyio.move_on_after(0.02) as scope:
        await _waiting.wait(backend, 0, work, "work", strategy="thread")  # type: ignore[arg-type]
    assert scope.cancelled_caught and work.released
    assert backend.blocked == [work]  # its thread still waits for the work, not for us
    await anyio.sleep(0.01)
    assert _waiting._waiters.get() == {}  # the waiter exited
    work.complete.set()


async def test_waits_on_different_lanes_do_not_queue_behind_each_other(
    anyio_backend: object,
) -> None:
    backend = _ManualBackend()
    slow, fast = _Work("a", 0), _Work("b", 0)
    order: list[str] = []

    async def wait(work: _Work, name: str) -> None:
        await _waiting.wait(backend, 0, work, name, strategy="thread")  # type: ignore[arg-type]
        order.append(name)

    _complete_later(fast, 0.01)
    _complete_later(slow, 0.1)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait, slow, "slow")
            tg.start_soon(wait, fast, "fast")
    assert order == ["fast", "slow"]
