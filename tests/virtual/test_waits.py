"""Waits on the virtual device, through the backend protocol and at scale: a wait handed over
after its work ended is told at once; a cancelled wait leaves nothing on the work it watched;
loops in several threads wait on one device; twenty thousand waits resume in order of
completion. (How the waiter serves waits on every loop: tests/waiting/.)
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import anyio.to_thread
import pytest

import aiostream as ais
from aiostream.virtual import VirtualClock
from tests.helpers.protocol import backend, handle_of
from tests.helpers.virtual import alive, target_class

pytestmark = pytest.mark.anyio


def test_a_wait_handed_over_after_its_work_ended_is_told_at_once(clock: VirtualClock) -> None:
    """A waiter may hand a wait over just after the work ended (it checked a moment before):
    completed, failed, or dropped with its failed device, the callback runs at once, never
    left to wait for a completion that has already happened."""
    virtual = backend("virtual")
    told: list[str] = []

    def capture(s: ais.Stream) -> Any:
        return virtual.stream_target(handle_of(s), False)

    ok = ais.Stream()
    ais.virtual.submit(ok, 1.0)
    done = capture(ok)
    clock.advance(2.0)  # completed, on a device that works
    done.watch(lambda: told.append("completed"))
    assert told == ["completed"]
    failing, late = ais.Stream(), ais.Stream()
    ais.virtual.fail_next(stream=failing)
    ais.virtual.submit(failing, 1.0)
    ais.virtual.submit(late, 5.0)
    failed, dropped = capture(failing), capture(late)
    clock.advance(2.0)  # failing's work failed, and the device with it: late's is dropped
    failed.watch(lambda: told.append("failed"))
    dropped.watch(lambda: told.append("dropped"))
    assert told == ["completed", "failed", "dropped"]
    for target in (done, failed, dropped):
        target.release()


async def test_cancelled_waits_leave_nothing_on_the_work_they_watched(
    clock: VirtualClock,
) -> None:
    """A wait cancelled while its work runs is forgotten by that work at once, not when the
    work completes: a loop of timed-out waits on a long kernel holds nothing (no wait target,
    what the backend hands out for a wait, stays alive)."""
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    e = s.record_event()
    target = target_class(s)
    before = alive(target)  # other tests' backends may still hold some, uncollected
    for _ in range(3):
        async with anyio.create_task_group() as tg:
            for _ in range(100):
                tg.start_soon(e.synchronize)
                tg.start_soon(s.synchronize)
            await anyio.wait_all_tasks_blocked()
            assert alive(target) == before + 200
            tg.cancel_scope.cancel()
        await anyio.wait_all_tasks_blocked()  # the waiter, with nothing left, has exited
        assert alive(target) == before  # the work still runs
        assert ais.virtual.stats().waits == 0
    assert not e.query()
    clock.advance(1.0)
    await e.synchronize()


async def test_two_loops_in_two_threads_wait_on_one_device() -> None:
    s1, s2 = ais.Stream(), ais.Stream()
    ais.delay(0.05, stream=s1)
    ais.delay(0.05, stream=s2)
    e1, e2 = s1.record_event(), s2.record_event()
    results: dict[str, bool] = {}

    def run(name: str, event: ais.Event, loop: str) -> None:
        async def main() -> None:
            with anyio.fail_after(60):  # 50 ms of work
                await event.synchronize()
            results[name] = event.query()

        anyio.run(main, backend=loop)

    threads = [
        threading.Thread(target=run, args=("a", e1, "asyncio")),
        threading.Thread(target=run, args=("b", e2, "trio")),
    ]
    for t in threads:
        t.start()
    with anyio.fail_after(60):  # 50 ms of work
        await e2.synchronize()  # and this loop waits too
    for t in threads:
        await anyio.to_thread.run_sync(t.join, 60)
        assert not t.is_alive()
    assert results == {"a": True, "b": True}


@pytest.mark.slow
async def test_twenty_thousand_waits_on_as_many_streams(clock: VirtualClock) -> None:
    """Scale is ordinary: every wait resumes, in order of completion, and nothing is left.
    (benchmarks/bench_scale.py goes to 100,000.)"""
    n = 20_000
    ais.virtual.reset(clock=clock, compute_slots=n)
    streams = [ais.Stream() for _ in range(n)]
    for i, s in enumerate(streams):
        ais.delay((i % 1000 + 1) * 1e-3, stream=s)
    resumed: list[int] = []

    async def wait(i: int) -> None:
        await streams[i].synchronize()
        resumed.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(wait, i)
        await anyio.wait_all_tasks_blocked()
        assert ais.virtual.stats().waits == n
        clock.advance(0.5)  # the first half of the durations
        await anyio.wait_all_tasks_blocked()
        assert len(resumed) == n // 2
        assert all(i % 1000 < 500 for i in resumed)
        clock.advance(0.5)
    assert len(resumed) == n
    assert ais.virtual.stats().waits == 0 and ais.virtual.stats().operations == 0
