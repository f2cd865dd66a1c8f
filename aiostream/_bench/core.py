"""The waiter's own costs on the virtual backend: the fast path, wake lateness, CPU while
waits are pending (``benchmarks/bench_core.py`` prints them in full)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import anyio.lowlevel

import aiostream as ais

DEVICE = "virtual:0"  # the waiter's own costs, on the simulated device (cuda.py: GPUs)


def run_on(loop: str, fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    # Each phase starts from a collected heap, so that no phase pays for an earlier one's
    # garbage (a full collection during a phase costs tens of milliseconds).
    gc.collect()
    if loop == "trio":
        return anyio.run(fn, backend="trio")
    return anyio.run(fn, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"})


async def fast_path(n: int, rounds: int) -> tuple[float, float]:
    """Median seconds per await: (complete event, bare checkpoint)."""
    ais.virtual.reset()
    e = ais.Stream(DEVICE).record_event()
    assert e.query()
    checkpoint = anyio.lowlevel.checkpoint
    ours, base = [], []
    for _ in range(rounds):  # interleaved, so drift and noise hit both alike
        t = time.perf_counter()
        for _ in range(n):
            await checkpoint()
        base.append((time.perf_counter() - t) / n)
        t = time.perf_counter()
        for _ in range(n):
            await e.synchronize()
        ours.append((time.perf_counter() - t) / n)
    return statistics.median(ours), statistics.median(base)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def lateness_ours(n: int, gap: float, streams: int) -> list[float]:
    ais.virtual.reset()  # the monotonic clock: device work takes real time
    lanes = [ais.Stream(DEVICE) for _ in range(streams)]
    events = []
    lead = 0.05  # time to start every task before the first completion
    ais.delay(lead, stream=lanes[0])
    for i in range(n):
        s = lanes[i % streams]
        ais.delay(gap, stream=s)  # one compute slot: completions come `gap` apart
        events.append(s.record_event())
    late: list[float] = []

    async def waiter(e: ais.Event) -> None:
        await e.synchronize()
        late.append(time.monotonic())

    async with anyio.create_task_group() as tg:
        for e in events:
            tg.start_soon(waiter, e)
    ends = sorted(r.end for r in ais.virtual.timeline() if r.name == "delay")[1:]
    assert len(ends) == n and len(late) == n
    # waits on distinct moments resume in completion order
    return [resumed - end for resumed, end in zip(sorted(late), ends, strict=True)]


async def lateness_base(n: int, gap: float, loop: str, rearm: bool = False) -> list[float]:
    """Lateness of bare loop timers at the same moments. With ``rearm``, a timer that fires
    early (libuv's do, by up to a millisecond) is set again until the moment has passed: the
    floor for a waker that must not resume anything before its work is done."""
    start = time.monotonic() + 0.05
    moments = [start + gap * (i + 1) for i in range(n)]
    late: list[float] = []
    if loop == "trio":
        import trio

        offset = trio.current_time() - time.monotonic()

        async def sleeper(when: float) -> None:
            await trio.sleep_until(when + offset)
            late.append(time.monotonic() - when)

        async with trio.open_nursery() as nursery:
            for when in moments:
                nursery.start_soon(sleeper, when)
        return late
    import asyncio

    aloop = asyncio.get_running_loop()
    offset = aloop.time() - time.monotonic()
    done = asyncio.Event()

    def fire(when: float) -> None:
        now = time.monotonic()
        if rearm and now < when:
            aloop.call_later(when - now, fire, when)
            return
        late.append(now - when)
        if len(late) == n:
            done.set()

    for when in moments:
        aloop.call_at(when + offset, fire, when)
    await done.wait()
    return late


async def cpu_pending(n: int, seconds: float, busy: bool) -> tuple[float, float]:
    """CPU seconds of this process while n tasks wait `seconds` for device work: in the steady
    window from 10 % to 90 % of the wait, and over the whole run (start-up and wake-up too)."""
    ais.virtual.reset()
    s = ais.Stream(DEVICE)
    ais.delay(seconds, stream=s)
    events = [s.record_event() for _ in range(n)]

    async def hand_loop(e: ais.Event) -> None:
        while not e.query():
            await anyio.sleep(0)

    async def awaiting(e: ais.Event) -> None:
        await e.synchronize()

    t = time.process_time()
    async with anyio.create_task_group() as tg:
        for e in events:
            tg.start_soon(hand_loop if busy else awaiting, e)
        await anyio.sleep(seconds * 0.1)
        c0 = time.process_time()
        await anyio.sleep(seconds * 0.8)
        steady = time.process_time() - c0
    return steady, time.process_time() - t
