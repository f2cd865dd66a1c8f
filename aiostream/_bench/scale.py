"""How waiting grows with the load, from 100 to 100,000 streams, in real time: CPU and
lateness per wait against tasks sleeping on the loop's timer, and memory per pending wait
(``benchmarks/bench_scale.py`` adds the simulator against SimPy)."""

from __future__ import annotations

import gc
import time
import tracemalloc

import anyio

import aiostream as ais

MIN_WINDOW = 1.0  # seconds over which the completions spread, at the least


def window(n: int, min_window: float = MIN_WINDOW) -> float:
    """Completions 200 us apart at the least: a bare timer task costs about 50 us of CPU on a
    small machine, so neither side is measured while the loop is saturated."""
    return max(min_window, n * 200e-6)


def lead(n: int, min_window: float = MIN_WINDOW) -> float:
    """Time to create the tasks before the first completion."""
    return 0.2 * min_window + n * 150e-6


async def waits_ours(n: int, min_window: float = MIN_WINDOW) -> tuple[float, float, list[float]]:
    """(setup CPU s, CPU s per wait, lateness list) for N streams awaited by N tasks."""
    ais.virtual.reset(compute_slots=n)  # every operation starts at once: ends spread by length
    c = time.process_time()
    t0 = time.monotonic()
    first, span = lead(n, min_window), window(n, min_window)
    streams = [ais.Stream("virtual:0") for _ in range(n)]
    ends = []
    for i, s in enumerate(streams):
        seconds = t0 + first + span * (i + 1) / n - time.monotonic()
        ais.delay(seconds, stream=s)
        ends.append(ais.virtual.now() + seconds)
    setup = time.process_time() - c
    late: list[float] = [0.0] * n

    async def wait(i: int) -> None:
        await streams[i].synchronize()
        late[i] = time.monotonic() - ends[i]

    c = time.process_time()
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(wait, i)
    cpu = time.process_time() - c
    assert ais.virtual.stats().waits == 0
    return setup, cpu / n, late


async def waits_base(n: int, min_window: float = MIN_WINDOW) -> tuple[float, list[float]]:
    """(CPU s per wait, lateness list) for N tasks sleeping on the loop timer until the same
    moments."""
    t0 = time.monotonic()
    first, span = lead(n, min_window), window(n, min_window)
    ends = [t0 + first + span * (i + 1) / n for i in range(n)]
    late: list[float] = [0.0] * n

    async def sleep(i: int) -> None:
        # until the moment has passed: uvloop's timers fire up to a millisecond early, and a
        # wait must never resume before its work is done
        while (left := ends[i] - time.monotonic()) > 0:
            await anyio.sleep(left)
        late[i] = time.monotonic() - ends[i]

    c = time.process_time()
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(sleep, i)
    return (time.process_time() - c) / n, late


async def memory_per_wait(n: int) -> tuple[float, float]:
    """Bytes per pending wait, its asyncio task included: (ours, a task sleeping on a timer)."""
    import asyncio

    clock = ais.virtual.VirtualClock()
    ais.virtual.reset(clock=clock, compute_slots=n)
    streams = [ais.Stream("virtual:0") for _ in range(n)]
    for s in streams:
        ais.delay(1.0, stream=s)
    results = []
    for ours in (True, False):
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        tasks = [
            asyncio.create_task(s.synchronize() if ours else asyncio.sleep(3600)) for s in streams
        ]
        for _ in range(3):  # every task runs up to its wait
            await asyncio.sleep(0)
        results.append((tracemalloc.get_traced_memory()[0] - before) / n)
        tracemalloc.stop()
        if ours:
            clock.advance(1.0)
        else:
            for t in tasks:
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert ais.virtual.stats().waits == 0
    return results[0], results[1]
