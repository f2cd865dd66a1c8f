"""The strategy waiter, for backends that cannot say when work will complete (CUDA), driven
by a fake backend in Python: each strategy's control flow (README, "Waiting") on every loop,
without a driver.

The fake backend's waits finish when the test says so, from another thread, and it tells the
waiter (``watch``) from a thread of its own, as the CUDA backend's watcher does. The virtual
backend cannot stand in: it knows when its work completes, and its waits take the timed
waiter whatever the strategy. tests/cuda/ runs the strategies against the stand-in driver and
on GPUs; these tests call ``aiostream._waiting.wait`` with the fake backend, read the waiter's
registry, and freeze or patch the waiter's clock and sweep.
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from aiostream import _waiting
from aiostream._waiting import waiters
from tests.helpers.waits import ManualBackend

pytestmark = pytest.mark.anyio


def the_waiter() -> waiters.Waiter:
    (waiter,) = waiters._registry.get().values()
    return waiter


class _Work:
    def __init__(self, lane: str, seq: int, wake: bool = True) -> None:
        self.lane, self.seq, self.wake = lane, seq, wake
        self.complete = threading.Event()
        self.checks = 0  # looks of either kind
        self.peeks = 0  # those of the check budget
        self.released = False
        self.watched: Any = None

    def done(self) -> bool:
        self.checks += 1
        return self.complete.is_set()

    def peek(self) -> bool | None:
        self.peeks += 1
        return self.done()

    def watch(self, callback: Any, gone: Any = None) -> None:
        self.watched = callback

        def tell() -> None:
            self.complete.wait()
            if not self.released:
                callback()

        threading.Thread(target=tell, daemon=True).start()

    def release(self) -> None:
        self.released = True


def _complete_later(work: _Work, seconds: float) -> None:
    threading.Timer(seconds, work.complete.set).start()


@pytest.mark.parametrize("strategy", ["hybrid", "poll", "thread", "callback", "quiet"])
async def test_each_strategy_wakes_its_wait(anyio_backend: object, strategy: str) -> None:
    backend = ManualBackend()
    work = _Work("s", 0)
    start = anyio.current_time()
    _complete_later(work, 0.03)
    with anyio.fail_after(5):
        await _waiting.wait(backend, 0, work, "work", strategy=strategy)  # type: ignore[arg-type]
    assert work.complete.is_set() and work.released
    # Only poll leaves the backend out; only hybrid and poll have the loop check meanwhile.
    assert (work.watched is None) == (strategy == "poll")
    if strategy == "poll":
        # every turn for the check budget (at most 500 us: a few hundred turns), then half
        # the age, at least 1 ms, up to 2 ms: a few looks to reach the cap, then one per
        # 2 ms. A poll that spun every turn would look thousands of times in 30 ms; one that
        # never looked again would never see the work done (the fail_after above). At least
        # the look that found it pending and the one that found it done: a loop the machine's
        # load holds up may make no other in 30 ms. (The exact schedule:
        # test_poll_backs_off_to_half_the_age_then_to_2_ms.)
        assert 2 <= work.checks <= 500 + (anyio.current_time() - start) / 0.002, work.checks
    elif strategy in ("thread", "callback"):
        assert work.checks == 1  # once, when the backend said it completed


@pytest.mark.parametrize("strategy", ["hybrid", "poll", "quiet"])
async def test_polling_never_holds_the_loop(anyio_backend: object, strategy: str) -> None:
    """While the loop polls a wait, other tasks run on every turn: a poll is one look per turn,
    never a spin within one. The other task completes the work on its 20th turn: a sweep
    that spun would never let it get there (a thread then completes the work, after 30 s)."""
    backend = ManualBackend()
    work = _Work("s", 0)
    rescue = threading.Timer(30, work.complete.set)
    rescue.start()
    turns = 0

    async def other() -> None:
        nonlocal turns
        while not work.complete.is_set():
            turns += 1
            if turns == 20:
                work.complete.set()
            await anyio.lowlevel.checkpoint()

    try:
        with anyio.fail_after(45):
            async with anyio.create_task_group() as tg:
                tg.start_soon(other)
                await _waiting.wait(backend, 0, work, "work", strategy=strategy)  # type: ignore[arg-type]
    finally:
        rescue.cancel()
        rescue.join()
    assert turns >= 20, turns  # a spinning sweep would have allowed one or two
    assert work.checks >= 2


class _Told:
    """A wait the backend tells of only when the test calls ``told`` (a watcher's sweep)."""

    def __init__(self, seq: int) -> None:
        self.lane, self.seq = "s", seq
        self.complete = False
        self.callback: Any = None

    def done(self) -> bool:
        return self.complete

    def peek(self) -> bool | None:
        return self.complete

    def watch(self, callback: Any, gone: Any = None) -> None:
        self.callback = callback

    def release(self) -> None:
        self.callback = None


async def test_completions_told_from_another_thread_wake_the_loop_once(
    anyio_backend: object,
) -> None:
    """1,000 waits told complete at once from another thread (a watcher's sweep): one
    wake-up crosses to the loop, not one per wait (each is a write to the loop's self-pipe on
    asyncio, a run_sync_soon on trio)."""
    backend = ManualBackend()
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
    monkeypatch.setattr(waiters, "_loop_time", frozen)
    monkeypatch.setattr(waiters, "_clock", frozen)  # the check budget's
    return frozen


async def test_hybrid_catches_short_waits_on_the_loop(
    anyio_backend: object, loop_time: _FrozenLoopTime
) -> None:
    backend = ManualBackend()
    work = _Work("s", 0)
    work.watch = lambda callback: None  # type: ignore[method-assign]  # the backend never tells

    async def finish_soon() -> None:
        await anyio.lowlevel.checkpoint()
        loop_time.now += waiters.SPIN_MAX_S / 2  # within the check budget
        work.complete.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(finish_soon)
            await _waiting.wait(backend, 0, work, "work", strategy="hybrid")  # type: ignore[arg-type]
    assert work.checks >= 2  # polled while pending, then seen complete by the loop


async def test_hybrid_leaves_a_wait_past_its_window_to_the_backend(
    anyio_backend: object, loop_time: _FrozenLoopTime
) -> None:
    backend = ManualBackend()
    work = _Work("s", 0)

    async def outlast_the_window() -> None:
        await anyio.lowlevel.checkpoint()
        loop_time.now += 2 * waiters.SPIN_MAX_S  # the budget has passed, work pending
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


async def test_a_wait_complete_as_hybrid_hands_it_over_is_not_lost(
    anyio_backend: object, loop_time: _FrozenLoopTime
) -> None:
    """The work completes between the loop's last look and the hand-over, so the backend
    calls back at once, from the loop's own thread, inside the waiter's sweep (the CUDA
    watcher does so for a mark that landed meanwhile): the wait ends, not asleep for good."""
    backend = ManualBackend()
    work = _Work("s", 0)

    def watch_complete_meanwhile(callback: Any, gone: Any = None) -> None:
        work.watched = callback
        work.complete.set()
        callback()

    work.watch = watch_complete_meanwhile  # type: ignore[method-assign]

    async def outlast_the_window() -> None:
        await anyio.lowlevel.checkpoint()
        loop_time.now += 2 * waiters.SPIN_MAX_S

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(outlast_the_window)
            await _waiting.wait(backend, 0, work, "work", strategy="hybrid")  # type: ignore[arg-type]
    assert work.watched is not None and work.released


async def test_back_to_back_waits_are_never_lost(anyio_backend: object) -> None:
    """Each wait starts while the previous one's waiter may still be closing."""
    backend = ManualBackend()
    for i in range(30):
        work = _Work("s", i)
        _complete_later(work, 0.001)
        with anyio.fail_after(5):
            await _waiting.wait(backend, 0, work, "work", strategy="thread")  # type: ignore[arg-type]


async def test_a_cancelled_wait_is_forgotten_at_once(anyio_backend: object) -> None:
    backend = ManualBackend()
    work = _Work("s", 0)
    with anyio.move_on_after(0.02) as scope:
        await _waiting.wait(backend, 0, work, "work", strategy="thread")  # type: ignore[arg-type]
    assert scope.cancelled_caught and work.released
    await anyio.sleep(0.01)
    assert waiters._registry.get() == {}  # the waiter exited
    work.complete.set()


@pytest.mark.parametrize("strategy", ["thread", "callback"])
async def test_a_wait_told_complete_after_its_cancellation_counts_once(
    anyio_backend: object, strategy: str
) -> None:
    """A wait's task is cancelled, and the backend tells of its completion anyway (a
    watcher thread that took the callback before the wait released it): the waiter's sweep
    must pass the told wait by. Finishing it too would take it off the waiter's count a
    second time, and the waiter would stop with another wait still pending, which would
    then sleep for good."""
    backend = ManualBackend()
    first, second = _Told(0), _Told(1)
    ended: list[str] = []

    async def wait(t: _Told, name: str) -> None:
        await _waiting.wait(backend, 0, t, name, strategy=strategy)  # type: ignore[arg-type]
        ended.append(name)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            async with anyio.create_task_group() as doomed:
                doomed.start_soon(wait, first, "first")
                tg.start_soon(wait, second, "second")
                await anyio.wait_all_tasks_blocked()
                taken = first.callback  # the watcher's copy
                doomed.cancel_scope.cancel()
            assert first.callback is None  # cancelled: released, and off the count
            first.complete = True
            taken()  # told all the same
            await anyio.wait_all_tasks_blocked()
            assert the_waiter()._pending == 1  # the second wait, still counted
            second.complete = True
            second.callback()
    assert ended == ["second"]


async def test_waits_on_different_lanes_do_not_queue_behind_each_other(
    anyio_backend: object,
) -> None:
    backend = ManualBackend()
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
    loop clock: every turn for the check budget (500 us with no wait before it), then half
    the wait's age, never under the loop timer's 1 ms, up to 2 ms."""
    backend = ManualBackend()
    work = _Work("s", 0)
    asked: list[tuple[float, float | None]] = []  # (loop time, sleep asked for)
    sweep = waiters.StrategyWaiter._sweep

    def recorded(self: waiters.StrategyWaiter) -> float | None:
        delay = sweep(self)
        asked.append((loop_time.now, delay))
        return delay

    monkeypatch.setattr(waiters.StrategyWaiter, "_sweep", recorded)
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
        assert await asked_at(400e-6) == {0.0}  # still within the budget
        assert await asked_at(0.001) == {0.001}  # half the age, 0.5 ms: the timer's 1 ms
        assert await asked_at(0.003) == {0.0015}  # half the age
        assert await asked_at(1.0) == {0.002}  # the cap, however old the wait
        assert await asked_at(100.0) == {0.002}
        work.complete.set()
        loop_time.now += 1.0  # the next look finds it done

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(drive)
            await _waiting.wait(backend, 0, work, "work", strategy="poll")  # type: ignore[arg-type]
    assert work.watched is None  # the loop alone looked


# ------------------------------------------------ the short wait: check budget and one hop


@pytest.mark.parametrize("strategy", ["hybrid", "poll", "quiet"])
async def test_no_sleep_is_shorter_than_the_loop_timer(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """asyncio's selector and trio's epoll round a timeout up to a whole millisecond: a waiter
    asks for a look on the next turn (0), or for a sleep of at least ``TIMER_FLOOR_S``, never
    for one in between."""
    backend = ManualBackend()
    asked: list[float | None] = []
    sweep = waiters.StrategyWaiter._sweep

    def recorded(self: waiters.StrategyWaiter) -> float | None:
        delay = sweep(self)
        asked.append(delay)
        return delay

    monkeypatch.setattr(waiters.StrategyWaiter, "_sweep", recorded)
    works = [_Work(lane, 0) for lane in "abc"]
    for i, work in enumerate(works):
        _complete_later(work, 0.004 + 0.003 * i)

    async def wait(work: _Work) -> None:
        await _waiting.wait(backend, 0, work, "work", strategy=strategy)  # type: ignore[arg-type]

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for work in works:
                tg.start_soon(wait, work)
    assert asked and 0.0 in asked  # it spun first
    short = [d for d in asked if d is not None and 0.0 < d < waiters.TIMER_FLOOR_S]
    assert not short, short


async def test_the_backends_word_ends_the_wait_in_one_hop(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A completion told from the watcher's thread finishes its wait in the callback that
    crosses to the loop: no sweep of the waiter's task runs between the word and the
    waiting task's resumption."""
    backend = ManualBackend()
    target = _Told(0)
    events: list[str] = []
    sweep = waiters.StrategyWaiter._sweep

    def recorded(self: waiters.StrategyWaiter) -> float | None:
        events.append("sweep")
        return sweep(self)

    monkeypatch.setattr(waiters.StrategyWaiter, "_sweep", recorded)

    def tell() -> None:
        target.complete = True
        events.append("told")
        target.callback()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:

            async def waiting() -> None:
                await _waiting.wait(backend, 0, target, "work", strategy="thread")  # type: ignore[arg-type]
                events.append("resumed")

            tg.start_soon(waiting)
            await anyio.wait_all_tasks_blocked()
            thread = threading.Thread(target=tell)
            thread.start()
            thread.join()
    told = events.index("told")
    assert events[told + 1] == "resumed", events


async def test_the_check_budget_follows_the_recent_waits(
    anyio_backend: object, loop_time: _FrozenLoopTime
) -> None:
    """The loop checks a wait on its turns for 1.5 times the recent waits' typical length,
    plus ``SPIN_MIN_S``, at most ``SPIN_MAX_S``; after long waits, ``SPIN_MIN_S`` only; the
    length outlives the waiter, which leaves with its last wait."""
    backend = ManualBackend()

    async def one(length: float) -> None:
        work = _Work("s", 0)
        work.watch = lambda callback: None  # type: ignore[method-assign]  # the loop alone

        async def finish() -> None:
            await anyio.lowlevel.checkpoint()
            loop_time.now += length
            work.complete.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(finish)
            await _waiting.wait(backend, 0, work, "work", strategy="poll")  # type: ignore[arg-type]

    def budget() -> float:
        return waiters.waiter_for(backend, 0).budget()  # type: ignore[attr-defined,arg-type]

    with anyio.fail_after(5):
        assert budget() == waiters.SPIN_MAX_S  # nothing known yet
        for _ in range(20):
            await one(100e-6)
        assert budget() == pytest.approx(1.5 * 100e-6 + waiters.SPIN_MIN_S)
        for _ in range(20):
            await one(0.01)
        assert budget() == waiters.SPIN_MIN_S


async def test_at_most_spin_lanes_streams_are_checked_on_every_turn(
    anyio_backend: object, loop_time: _FrozenLoopTime
) -> None:
    """Hybrid waits on more streams than ``SPIN_LANES`` at once: the others go to the
    backend at once, so that a turn's checks stay few however many streams wait."""
    backend = ManualBackend()
    lanes = waiters.SPIN_LANES + 5
    works = [_Work(str(i), 0) for i in range(lanes)]

    async def wait(work: _Work) -> None:
        await _waiting.wait(backend, 0, work, "work", strategy="hybrid")  # type: ignore[arg-type]

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for work in works:
                tg.start_soon(wait, work)
            for _ in range(20):
                await anyio.lowlevel.checkpoint()
            spinning = [w for w in works if w.watched is None]
            assert len(spinning) == waiters.SPIN_LANES
            assert all(w.peeks for w in spinning)
            for work in works:
                work.complete.set()
