"""Loop integration: fast path, stream-order sweeps, timers, cancellation, late wake-ups."""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import aiostream as ais
from aiostream import _waiting
from aiostream.virtual import VirtualClock
from tests.helpers.waits import synchronize_keeping

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


async def test_each_wait_is_checked_once_when_told_and_the_checks_add_up(
    clock: VirtualClock,
) -> None:
    """Two waits on work that completes a second apart, on a clock moved by hand: each is
    checked once, when the backend tells the waiter its work completed."""
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    first = s.record_event()
    ais.delay(1.0, stream=s)
    second = s.record_event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(first.synchronize)
        tg.start_soon(second.synchronize)
        await anyio.wait_all_tasks_blocked()
        waiter_ = the_waiter()
        assert waiter_.checks == 0
        clock.advance(1.0)
        await anyio.wait_all_tasks_blocked()
        assert waiter_.checks == 1
        clock.advance(1.0)
    assert waiter_.checks == 2


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


async def test_the_waiter_looks_when_a_wait_begins_and_when_told_nothing_more(
    clock: VirtualClock,
) -> None:
    """On a clock that moves only when told, the waiter wakes exactly twice for one wait:
    once when the wait begins (the backend has told it nothing yet: it checks nothing and
    sleeps, with no timer), once when the backend tells it the work completed, and checks
    that wait then; no poll in between, however long the wait."""
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    e = s.record_event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(e.synchronize)
        await anyio.wait_all_tasks_blocked()
        waiter_ = the_waiter()
        assert (waiter_.wakes, waiter_.checks) == (1, 0)
        for _ in range(10):
            await anyio.sleep(0.01)  # real time goes by; the device's time does not
        assert (waiter_.wakes, waiter_.checks) == (1, 0)
        clock.advance(1.0)
    assert (waiter_.wakes, waiter_.checks) == (2, 1)  # the wait checked once: when told


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
    start = anyio.current_time()
    with anyio.fail_after(60):  # a guard against a hang: the bound is below
        with anyio.move_on_after(0.01) as scope:
            await s.synchronize()
    assert scope.cancelled_caught
    # it returns in about 10 ms; a wait deaf to its cancellation would take an hour
    assert anyio.current_time() - start < 0.5
    assert ais.virtual.stats().waits == 0


async def test_a_wait_on_shorter_work_submitted_while_the_waiter_sleeps_resumes_promptly() -> None:
    """Real time: the waiter sleeps toward the end of 1 s of work when 1 ms of work is
    submitted and awaited; that wait resumes after about 1 ms, not when the waiter's timer
    for the long work fires."""
    long, short = ais.Stream(), ais.Stream()
    ais.virtual.submit(long, 1.0, engine="h2d")
    async with anyio.create_task_group() as tg:
        tg.start_soon(long.synchronize)
        await anyio.wait_all_tasks_blocked()  # the waiter sleeps until the long work's end
        start = anyio.current_time()
        ais.delay(0.001, stream=short)
        with anyio.fail_after(60):
            await short.synchronize()
        late = anyio.current_time() - start
        assert long.query() is False
        tg.cancel_scope.cancel()
    assert late < 0.5, late
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
        with anyio.move_on_after(5):  # about 1 ms; left asleep, it would wait for the stall
            await resumed.wait()
        assert resumed.is_set()
        assert held.query() is False
        stall.release()
    assert held.query() is True
    assert ais.virtual.stats().waits == 0


async def test_a_completion_seen_on_the_loop_s_thread_wakes_the_sleeping_waiter() -> None:
    """A clock callable advanced from a task: the next call into aiostream on the loop's own
    thread (here a query) processes the completion, and that wakes the waiting task at once,
    not when the waiter's timer for the old reading of the clock fires (100 s)."""
    now = [0.0]
    ais.virtual.reset(clock=lambda: now[0])
    s = ais.Stream()
    ais.delay(100.0, stream=s)
    resumed = anyio.Event()

    async def waiter() -> None:
        await s.synchronize()
        resumed.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()  # the waiter sleeps for 100 s
        now[0] = 100.0  # the clock moves; nothing has looked at it yet
        assert not resumed.is_set()
        assert s.query() is True  # this call completes the work, on the loop's thread
        with anyio.move_on_after(5):  # at once; a waiter left asleep would take 100 s
            await resumed.wait()
        tg.cancel_scope.cancel()
    assert resumed.is_set()
    assert ais.virtual.stats().waits == 0


@pytest.mark.timeout(60)
async def test_a_failed_waiter_fails_its_waits_instead_of_leaving_them_parked(
    clock: VirtualClock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(self: _waiting._TimedWaiter) -> float | None:
        raise RuntimeError("a bug in the waiter")

    monkeypatch.setattr(_waiting._TimedWaiter, "_sweep", broken)
    streams = [ais.Stream() for _ in range(3)]
    for s in streams:
        ais.delay(1.0, stream=s)
    errors: list[BaseException] = []

    async def waiter(s: ais.Stream) -> None:
        try:
            await s.synchronize()
        except ais.AiostreamError as exc:
            errors.append(exc)

    with anyio.fail_after(10):  # parked forever would hang here
        async with anyio.create_task_group() as tg:
            for s in streams:
                tg.start_soon(waiter, s)
    assert len(errors) == 3
    for exc in errors:
        assert type(exc) is ais.AiostreamError
        assert str(exc) == "aiostream's waiter failed: RuntimeError('a bug in the waiter')"
    assert "aiostream waiter failed; failing its pending waits" in caplog.text
    assert ais.virtual.stats().waits == 0
    assert _waiting._waiters.get() == {}
    assert not any(s.query() for s in streams)  # the device work goes on


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "anyio_backend",
    [
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ],
)
async def test_a_cancelled_waiter_fails_its_waits(clock: VirtualClock) -> None:
    """The waiter's task cancelled (as a loop shutting down does): its waits raise, saying
    so, instead of staying parked."""
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    errors: list[BaseException] = []

    async def waiter() -> None:
        try:
            await s.synchronize()
        except ais.AiostreamError as exc:
            errors.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            task = the_waiter()._task
            assert isinstance(task, asyncio.Task)
            task.cancel()
    assert [str(e) for e in errors] == [
        "aiostream's waiter for device 0 was cancelled (is the event loop shutting down?)"
    ] * 2
    assert ais.virtual.stats().waits == 0


def entries() -> int:
    """How many waits (``_waiting._Entry``) are alive in the process, after a collection."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is _waiting._Entry)


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
        assert alive <= 2 * 1 + _waiting._COMPACT_MIN + 1, alive  # 300 without compaction
        tg.cancel_scope.cancel()


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
# when the test says so, from another thread, and it tells the waiter (``watch``) from a thread
# of its own, as the CUDA backend's watcher does. It runs the strategies' control flow on every
# loop without a driver (test_cuda.py runs them against the stand-in driver and on GPUs).


class _Work:
    def __init__(self, lane: str, seq: int, wake: bool = True) -> None:
        self.lane, self.seq, self.wake = lane, seq, wake
        self.complete = threading.Event()
        self.checks = 0
        self.released = False
        self.watched: Any = None

    def done(self) -> bool:
        self.checks += 1
        return self.complete.is_set()

    def watch(self, callback: Any) -> None:
        self.watched = callback

        def tell() -> None:
            self.complete.wait()
            if not self.released:
                callback()

        threading.Thread(target=tell, daemon=True).start()

    def release(self) -> None:
        self.released = True


class _ManualBackend:
    kind = "manual"
    completion_times = False

    def wake_hint(self, index: int) -> float | None:
        return None

    def subscribe(self, index: int, callback: object) -> object:
        return lambda: None


def _complete_later(work: _Work, seconds: float) -> None:
    threading.Timer(seconds, work.complete.set).start()


@pytest.mark.parametrize("strategy", ["hybrid", "poll", "thread", "callback"])
async def test_each_strategy_wakes_its_wait(anyio_backend: object, strategy: str) -> None:
    backend = _ManualBackend()
    work = _Work("s", 0)
    start = anyio.current_time()
    _complete_later(work, 0.03)
    with anyio.fail_after(5):
        await _waiting.wait(backend, 0, work, "work", strategy=strategy)  # type: ignore[arg-type]
    assert work.complete.is_set() and work.released
    # Only poll leaves the backend out; only hybrid and poll have the loop check meanwhile.
    assert (work.watched is None) == (strategy == "poll")
    if strategy == "poll":
        # every turn for 100 us (up to 1 ms on uvloop, whose clock counts milliseconds: a
        # hundred turns or so), then half the age, up to 2 ms: about 10 looks to reach the
        # cap, then one per 2 ms. A poll that spun every turn would look thousands of times
        # in 30 ms. (The exact schedule: test_poll_backs_off_to_half_the_age_then_to_2_ms.)
        assert 3 <= work.checks <= 300 + (anyio.current_time() - start) / 0.002, work.checks
    elif strategy in ("thread", "callback"):
        assert work.checks == 1  # once, when the backend said it completed


@pytest.mark.parametrize("strategy", ["hybrid", "poll"])
async def test_polling_never_holds_the_loop(anyio_backend: object, strategy: str) -> None:
    """While the loop polls a wait, other tasks run on every turn: a poll is one look per turn,
    never a spin within one."""
    backend = _ManualBackend()
    work = _Work("s", 0)
    _complete_later(work, 0.03)
    turns = 0

    async def other() -> None:
        nonlocal turns
        while not work.complete.is_set():
            turns += 1
            await anyio.lowlevel.checkpoint()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            await _waiting.wait(backend, 0, work, "work", strategy=strategy)  # type: ignore[arg-type]
    assert turns >= 20, turns  # in 30 ms: a spinning sweep would have allowed one or two
    assert work.checks >= 2


class _Told:
    """A wait the backend tells of only when the test calls ``told`` (a watcher's sweep)."""

    def __init__(self, seq: int) -> None:
        self.lane, self.seq = "s", seq
        self.complete = False
        self.callback: Any = None

    def done(self) -> bool:
        return self.complete

    def watch(self, callback: Any) -> None:
        self.callback = callback

    def release(self) -> None:
        self.callback = None


async def test_completions_told_from_another_thread_wake_the_loop_once(
    anyio_backend: object,
) -> None:
    """1,000 waits told complete at once from another thread (a watcher's sweep): one
    wake-up crosses to the loop, not one per wait (each is a write to the loop's self-pipe on
    asyncio, a run_sync_soon on trio)."""
    backend = _ManualBackend()
    targets = [_Told(i) for i in range(1000)]
    sent: list[object] = []

    async def wait(t: _Told) -> None:
        await _waiting.wait(backend, 0, t, "work", strategy="thread")  # type: ignore[arg-type]

    def sweep() -> None:
        callbacks = [t.callback for t in targets]
        for t in targets:
            t.complete = True
        for callback in callbacks:
            callback()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for t in targets:
                tg.start_soon(wait, t)
            await anyio.wait_all_tasks_blocked()
            waiter = the_waiter()
            send = waiter._call_soon_threadsafe
            waiter._call_soon_threadsafe = lambda fn: (sent.append(fn), send(fn))[1]
            watcher = threading.Thread(target=sweep)
            watcher.start()
            watcher.join()
    assert all(t.callback is None for t in targets)  # every wait finished and released
    assert len(sent) == 1, len(sent)


class _FrozenLoopTime:
    """The waiter's view of the loop clock, moved only by the test: a machine under load can
    take longer than hybrid's window between two loop turns, a frozen clock cannot."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def loop_time(monkeypatch: pytest.MonkeyPatch) -> _FrozenLoopTime:
    frozen = _FrozenLoopTime()
    monkeypatch.setattr(_waiting, "_loop_time", frozen)
    return frozen


async def test_hybrid_catches_short_waits_on_the_loop(
    anyio_backend: object, loop_time: _FrozenLoopTime
) -> None:
    backend = _ManualBackend()
    work = _Work("s", 0)
    work.watch = lambda callback: None  # type: ignore[method-assign]  # the backend never tells

    async def finish_soon() -> None:
        await anyio.lowlevel.checkpoint()
        loop_time.now += _waiting.HYBRID_HANDOFF_S / 2  # within the window
        work.complete.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(finish_soon)
            await _waiting.wait(backend, 0, work, "work", strategy="hybrid")  # type: ignore[arg-type]
    assert work.checks >= 2  # polled while pending, then seen complete by the loop


async def test_hybrid_leaves_a_wait_past_its_window_to_the_backend(
    anyio_backend: object, loop_time: _FrozenLoopTime
) -> None:
    backend = _ManualBackend()
    work = _Work("s", 0)

    async def outlast_the_window() -> None:
        await anyio.lowlevel.checkpoint()
        loop_time.now += 2 * _waiting.HYBRID_HANDOFF_S  # the window has passed, work pending
        await anyio.sleep(0.02)
        checks = work.checks
        await anyio.sleep(0.02)
        assert work.checks == checks  # the loop has stopped checking
        work.complete.set()  # and the backend's word finishes it

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(outlast_the_window)
            await _waiting.wait(backend, 0, work, "work", strategy="hybrid")  # type: ignore[arg-type]
    assert work.released


async def test_back_to_back_waits_are_never_lost(anyio_backend: object) -> None:
    """Each wait starts while the previous one's waiter may still be closing."""
    backend = _ManualBackend()
    for i in range(30):
        work = _Work("s", i)
        _complete_later(work, 0.001)
        with anyio.fail_after(5):
            await _waiting.wait(backend, 0, work, "work", strategy="thread")  # type: ignore[arg-type]


async def test_a_cancelled_wait_is_forgotten_at_once(anyio_backend: object) -> None:
    backend = _ManualBackend()
    work = _Work("s", 0)
    with anyio.move_on_after(0.02) as scope:
        await _waiting.wait(backend, 0, work, "work", strategy="thread")  # type: ignore[arg-type]
    assert scope.cancelled_caught and work.released
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


async def test_poll_backs_off_to_half_the_age_then_to_2_ms(
    anyio_backend: object, loop_time: _FrozenLoopTime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The poll strategy's schedule, read from the sleeps the waiter asks for on a frozen
    loop clock: every turn for the first 100 us, then half the wait's age, up to 2 ms."""
    backend = _ManualBackend()
    work = _Work("s", 0)
    asked: list[tuple[float, float | None]] = []  # (loop time, sleep asked for)
    sweep = _waiting._StrategyWaiter._sweep

    def recorded(self: _waiting._StrategyWaiter) -> float | None:
        delay = sweep(self)
        asked.append((loop_time.now, delay))
        return delay

    monkeypatch.setattr(_waiting._StrategyWaiter, "_sweep", recorded)
    since = loop_time.now

    async def asked_at(age: float) -> set[float | None]:
        """Move the clock to ``age`` past the wait's start; the sleeps asked for there."""
        loop_time.now = since + age
        while sum(1 for t, _ in asked if t == loop_time.now) < 3:
            await anyio.sleep(0.0005)
        return {round(d, 12) if d is not None else None for t, d in asked if t == loop_time.now}

    async def drive() -> None:
        while not asked:
            await anyio.lowlevel.checkpoint()
        assert await asked_at(0.0) == {0.0}  # spinning: every turn
        assert await asked_at(50e-6) == {0.0}  # still within the first 100 us
        assert await asked_at(0.001) == {0.0005}  # half the age
        assert await asked_at(0.003) == {0.0015}
        assert await asked_at(1.0) == {0.002}  # the cap, however old the wait
        assert await asked_at(100.0) == {0.002}
        work.complete.set()
        loop_time.now += 1.0  # the next look finds it done

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(drive)
            await _waiting.wait(backend, 0, work, "work", strategy="poll")  # type: ignore[arg-type]
    assert work.watched is None  # the loop alone looked


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
