"""The near-end look of hybrid waits (``_StrategyWaiter._plan_near``): once the device's recent
waits ran alike, a wait past its check budget, handed over to the backend, is looked at on the
loop's turns again from just before its predicted end, so that a 2 ms kernel resumes its task
without the watcher's hops. Driven by a fake backend on a frozen clock, on every loop."""

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


class _Work:
    """A wait the test completes; the backend it stands for never tells of it."""

    def __init__(self) -> None:
        self.lane, self.seq = "s", 0
        self.complete = threading.Event()
        self.peeks = 0
        self.watched: Any = None
        self.released = False

    def done(self) -> bool:
        return self.complete.is_set()

    def peek(self) -> bool | None:
        self.peeks += 1
        return self.complete.is_set()

    def watch(self, callback: Any, gone: Any = None) -> None:
        self.watched = callback  # never called: only the loop's looks can end the wait

    def release(self) -> None:
        self.released = True


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    frozen = _Clock()
    monkeypatch.setattr(waiters, "_loop_time", frozen)
    monkeypatch.setattr(waiters, "_clock", frozen)
    return frozen


async def _waits_of(backend: ManualBackend, clock: _Clock, lengths: list[float]) -> None:
    """Waits that each take the given length on the frozen clock (the loop sees them end)."""
    for length in lengths:
        work = _Work()

        async def finish(work: _Work = work, length: float = length) -> None:
            await anyio.lowlevel.checkpoint()
            clock.now += length
            work.complete.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(finish)
            await _waiting.wait(backend, 0, work, "work", strategy="poll")  # type: ignore[arg-type]


async def _until(predicate: Any) -> None:
    while not predicate():
        await anyio.sleep(0.0005)


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[float | None]:
    """The sleeps the strategy waiter asks for."""
    delays: list[float | None] = []
    sweep = waiters.StrategyWaiter._sweep

    def recorded(self: waiters.StrategyWaiter) -> float | None:
        delay = sweep(self)
        delays.append(delay)
        return delay

    monkeypatch.setattr(waiters.StrategyWaiter, "_sweep", recorded)
    return delays


async def test_a_wait_like_the_recent_ones_is_looked_at_near_its_end(
    anyio_backend: object, clock: _Clock, asked: list[float | None]
) -> None:
    """After waits of 5 ms, a hybrid wait handed over to the backend sleeps whole
    milliseconds to ``NEAR_LEAD_S`` before its predicted end, is not looked at meanwhile,
    then is looked at on every turn and ends by the loop's look, the backend silent."""
    backend = ManualBackend()
    work = _Work()

    async def drive() -> None:
        await anyio.lowlevel.checkpoint()
        start = clock.now
        clock.now += 2 * waiters.SPIN_MIN_S  # past the budget (the recent waits were long)
        await _until(lambda: work.watched is not None)
        handed = work.peeks
        asked.clear()
        clock.now = start + 0.002  # far from the end: a sleep, no look
        await _until(lambda: len(asked) >= 2)
        assert work.peeks == handed
        # planned at the hand-over, 100 us in: 4 whole ms, to 150 us before the lead
        assert all(d == pytest.approx(0.0041 - 0.002) for d in asked), asked
        clock.now = start + 0.005 - waiters.NEAR_LEAD_S  # near the end: looked at every turn
        await _until(lambda: work.peeks >= handed + 5)
        work.complete.set()

    with anyio.fail_after(10):
        await _waits_of(backend, clock, [0.005] * 5)
        async with anyio.create_task_group() as tg:
            tg.start_soon(drive)
            await _waiting.wait(backend, 0, work, "work", strategy="hybrid")  # type: ignore[arg-type]
    assert work.watched is not None and work.released


@pytest.mark.parametrize("lengths", [[0.005, 0.02, 0.005, 0.02, 0.005], [0.2] * 5, [0.005] * 2])
async def test_no_near_end_look_without_a_prediction(
    anyio_backend: object, clock: _Clock, lengths: list[float]
) -> None:
    """Unalike recent waits, long ones (over ``NEAR_MAX_S``) or too few: the wait handed over
    is the backend's alone, the loop looks at it no more."""
    backend = ManualBackend()
    work = _Work()

    async def drive() -> None:
        await anyio.lowlevel.checkpoint()
        clock.now += 2 * waiters.SPIN_MAX_S
        await _until(lambda: work.watched is not None)
        handed = work.peeks
        for length in lengths:
            clock.now += length
            await anyio.sleep(0.005)
        assert work.peeks == handed
        work.complete.set()
        work.watched()  # the backend's word ends it

    with anyio.fail_after(10):
        await _waits_of(backend, clock, lengths)
        async with anyio.create_task_group() as tg:
            tg.start_soon(drive)
            await _waiting.wait(backend, 0, work, "work", strategy="hybrid")  # type: ignore[arg-type]
    assert work.released


def test_the_prediction_follows_alike_waits_only() -> None:
    lengths = waiters.Lengths()
    for _ in range(waiters.NEAR_SAMPLES - 1):
        lengths.add(0.002)
    assert lengths.predicted() is None  # too few
    lengths.add(0.002)
    assert lengths.predicted() == pytest.approx(0.002)
    lengths.add(1.0)  # one outlier moves it a little, and makes the waits unalike for a while
    assert lengths.mean < 0.003
    assert lengths.predicted() is None
    for _ in range(20):
        lengths.add(0.002)
    assert lengths.predicted() == pytest.approx(0.002, rel=0.05)


async def test_a_long_approach_is_taken_in_steps(
    anyio_backend: object, clock: _Clock, asked: list[float | None]
) -> None:
    """After waits of 20 ms, the sleeps toward the predicted end are ``NEAR_STEP_S`` at most
    (a loop's timer may wake a millisecond late after a long sleep), planned again at each
    wake, until the looks on every turn begin."""
    backend = ManualBackend()
    work = _Work()

    async def drive() -> None:
        await anyio.lowlevel.checkpoint()
        start = clock.now
        clock.now += 2 * waiters.SPIN_MIN_S
        await _until(lambda: work.watched is not None)
        handed = work.peeks
        steps = []
        while True:
            asked.clear()
            await _until(lambda: asked)
            delay = asked[-1]
            if delay == 0.0:
                break
            assert delay is not None and delay <= waiters.NEAR_STEP_S + 1e-9, delay
            assert work.peeks == handed  # no look while the end is far
            steps.append(delay)
            clock.now += delay  # the timer fires
        assert len(steps) >= 4, steps
        assert clock.now - start >= 0.02 - waiters.NEAR_LEAD_S - waiters.TIMER_FLOOR_S
        await _until(lambda: work.peeks >= handed + 3)
        work.complete.set()

    with anyio.fail_after(10):
        await _waits_of(backend, clock, [0.02] * 5)
        async with anyio.create_task_group() as tg:
            tg.start_soon(drive)
            await _waiting.wait(backend, 0, work, "work", strategy="hybrid")  # type: ignore[arg-type]
    assert work.released
