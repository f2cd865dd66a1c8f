"""CUDA waits: the latency and CPU of awaits of short kernels, against ``cuEventSynchronize``
in a plain thread (``benchmarks/bench_cuda.py`` adds long waits, concurrency and PyTorch)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiostream as ais

from .. import _objects

DEVICE = "cuda:0"


def short_awaits(
    n: int, kernel_s: float, wait: Callable[[ais.Stream, ais.Event], Awaitable[None]]
) -> tuple[list[float], float]:
    """Latencies (s) of n sequential awaits of one kernel each, and the CPU seconds used."""

    async def main() -> tuple[list[float], float]:
        s = ais.Stream(DEVICE)
        e = ais.Event(DEVICE)
        for _ in range(20):  # warm-up: module loaded, pools filled, threads started
            ais.delay(kernel_s, stream=s)
            e.record(s)
            await wait(s, e)
        out = []
        cpu = time.process_time()
        for _ in range(n):
            t0 = time.perf_counter()
            ais.delay(kernel_s, stream=s)
            e.record(s)
            await wait(s, e)
            out.append(time.perf_counter() - t0 - kernel_s)
        return out, time.process_time() - cpu

    return asyncio.run(main())


def floor_thread(n: int, kernel_s: float) -> tuple[list[float], float]:
    """(a): the same work, waited with cuEventSynchronize in a plain thread (no loop), the
    device's primary context made current once, as a program of its own would."""
    from cuda.bindings import driver

    result: list[Any] = []

    def run() -> None:
        _, dev = driver.cuDeviceGet(0)
        _, ctx = driver.cuDevicePrimaryCtxRetain(dev)
        driver.cuCtxPushCurrent(ctx)
        try:
            measure()
        finally:
            driver.cuCtxPopCurrent()
            driver.cuDevicePrimaryCtxRelease(dev)

    def measure() -> None:
        s = ais.Stream(DEVICE)
        e = ais.Event(DEVICE)
        for _ in range(20):
            ais.delay(kernel_s, stream=s)
            e.record(s)
            driver.cuEventSynchronize(_objects.handle(e).ptr)
        out = []
        cpu = time.process_time()
        for _ in range(n):
            t0 = time.perf_counter()
            ais.delay(kernel_s, stream=s)
            e.record(s)
            driver.cuEventSynchronize(_objects.handle(e).ptr)
            out.append(time.perf_counter() - t0 - kernel_s)
        result.extend([out, time.process_time() - cpu])

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return result[0], result[1]


def strategy_wait(strategy: str) -> Callable[[ais.Stream, ais.Event], Awaitable[None]]:
    async def wait(s: ais.Stream, e: ais.Event) -> None:
        await e.synchronize(strategy=strategy)

    return wait
