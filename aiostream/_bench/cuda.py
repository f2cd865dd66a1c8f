"""CUDA waits: the latency and CPU of awaits of short kernels, against ``cuEventSynchronize``
in a plain thread and in ``anyio.to_thread``; and waits at scale: threads, handles held, CPU
and lateness of thousands of concurrent waits on hundreds of streams, against tasks sleeping on
the loop's own timer until the same moments (``benchmarks/bench_cuda.py`` prints them all)."""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel

import aiostream as ais

from .. import _backends, _objects

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


@contextmanager
def primary_context(index: int = 0) -> Iterator[None]:
    """Device ``index``'s primary context, retained and current on the calling thread
    meanwhile: what a baseline that calls the driver itself, as a program of its own would,
    needs."""
    from cuda.bindings import driver

    # The driver initialised first (the backend's cuInit), and every result checked: before
    # cuInit the retain fails, and the release after would take aiostream's own reference,
    # resetting the context under its streams, events and completion flags.
    _backends.get("cuda")
    dev = _ok(driver.cuDeviceGet(index), "cuDeviceGet")
    ctx = _ok(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    try:
        _ok(driver.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            driver.cuCtxPopCurrent()
    finally:
        driver.cuDevicePrimaryCtxRelease(dev)


def _ok(result: tuple[Any, ...], call: str) -> Any:
    if int(result[0]) != 0:
        raise RuntimeError(f"{call} failed: {result[0]!r}")
    return result[1] if len(result) > 1 else None


def floor_thread(n: int, kernel_s: float) -> tuple[list[float], float]:
    """(a): the same work, waited with cuEventSynchronize in a plain thread (no loop), the
    device's primary context made current once, as a program of its own would."""
    from cuda.bindings import driver

    result: list[Any] = []

    def run() -> None:
        with primary_context():
            measure()

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


# ---------------------------------------------------------------------- waits at scale


def os_threads() -> int:
    """Threads of this process, as the OS counts them (Linux); Python's count elsewhere."""
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return threading.active_count()


def ours_cpu() -> float:
    """CPU seconds of the calling thread (the loop's) and of aiostream's own threads (the
    watchers): what waiting costs, without the driver's threads (on the stand-in, its
    engine thread does the device's work on the CPU)."""
    total = time.thread_time()
    for t in threading.enumerate():
        if t.name.startswith("aiostream") and t.ident is not None:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (AttributeError, OSError):  # no per-thread clocks here
                pass
    return total


def aiostream_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("aiostream"))


@dataclass(frozen=True)
class Scale:
    """One run of :func:`scale`."""

    waits: int
    streams: int
    loop: str
    strategy: str
    cancelled: int
    threads_peak: int  # the process's OS threads beyond those before the run, at most
    threads_settled: int  # and half a second after it
    ours_peak: int  # aiostream's own threads (named "aiostream ..."), at most
    ours_settled: int
    held_peak: dict[str, int]  # what the device held for aiostream at most (Backend.held)
    held_after: dict[str, int]
    cpu_per_wait_us: float  # the loop's thread and aiostream's (ours_cpu), per wait begun
    timer_cpu_per_wait_us: float  # the loop's thread, per task (the same give up)
    late_median_us: float  # beyond the work's end, median, of the waits not cancelled
    late_p99_us: float
    timer_late_median_us: float  # a task sleeping on the loop timer until the same moment
    timer_late_p99_us: float


def lead_s(waits: int) -> float:
    """Seconds of work at the head of every stream, so that all ``waits`` have been submitted
    and started before the first completes (submitting and starting a wait costs well under
    0.3 ms)."""
    return 0.2 + 3e-4 * waits


def _plan(waits: int, streams: int, window: float) -> list[list[float]]:
    """Kernel durations per stream: ``waits // streams`` each, a stream's ending near
    ``window``, staggered so that completions spread over it."""
    per = max(1, waits // streams)
    base = window / per / 1.4
    return [[base * (1 + ((i + k) % 7) / 10) for k in range(per)] for i in range(streams)]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def scale(
    waits: int, streams: int, loop: str, strategy: str = "quiet", window: float = 0.5
) -> Scale:
    """``waits`` events on ``streams`` streams awaited at once, a third cancelled at random
    times: threads, handles held, CPU per wait and lateness, beside tasks that sleep on the
    loop's timer until the same moments (the same third giving up at the same moments). CPU
    per wait is the whole burst's over the waits begun, cancelled ones included."""
    backend, options = (loop, {}) if loop != "uvloop" else ("asyncio", {"use_uvloop": True})
    plan = _plan(waits, streams, window)
    lead = lead_s(waits)  # every wait has started before the first completion
    cuda = _backends.get("cuda")
    rng = random.Random(21)
    threads_before = os_threads()
    peak = {"threads": 0, "ours": 0}
    held_peak: dict[str, int] = {}
    stop = threading.Event()

    def sample() -> None:
        turns = 0
        while not stop.wait(0.005):
            peak["threads"] = max(peak["threads"], os_threads() - 1)  # less this sampler
            peak["ours"] = max(peak["ours"], aiostream_threads())
            turns += 1
            if turns % 10:  # held() sweeps the flags and wakes the watcher for what it
                continue  # finds: asked every 5 ms, it made a quarter of the watcher's wakes
            for key, value in cuda.held(0).items():  # type: ignore[attr-defined]
                held_peak[key] = max(held_peak.get(key, 0), value)

    # a third give up at a random moment while the streams' work completes (seconds after the
    # start; None: never), the same in both runs
    give_ups = [
        rng.uniform(lead, lead + window) if rng.random() < 1 / 3 else None
        for durations in plan
        for _ in durations
    ]

    async def timers() -> tuple[list[float], float]:
        t0 = anyio.current_time()
        ends = [t0 + lead + sum(d[: k + 1]) for d in plan for k in range(len(d))]
        late: list[float] = []

        async def one(end: float, give_up: float | None) -> None:
            if give_up is None:
                await anyio.sleep_until(end)
                late.append(anyio.current_time() - end)
                return
            with anyio.move_on_after(max(0.0, give_up - anyio.current_time())) as scope:
                await anyio.sleep_until(end)
            if not scope.cancelled_caught:
                late.append(anyio.current_time() - end)

        cpu = ours_cpu()
        async with anyio.create_task_group() as tg:
            for end, give_up in zip(ends, give_ups, strict=True):
                tg.start_soon(one, end, None if give_up is None else t0 + give_up)
        return late, ours_cpu() - cpu

    async def device() -> tuple[list[float], float, int]:
        pairs = [(ais.Stream(DEVICE), durations) for durations in plan]
        late: list[float] = []
        cancelled = 0

        async def one(e: ais.Event, end: float, give_up: float | None) -> None:
            nonlocal cancelled
            if give_up is None:
                await e.synchronize(strategy=strategy)
                late.append(time.monotonic() - end)
                return
            with anyio.move_on_after(max(0.0, give_up - time.monotonic())) as scope:
                await e.synchronize(strategy=strategy)
            if scope.cancelled_caught:
                cancelled += 1
            else:
                late.append(time.monotonic() - end)

        work = []  # submitted first: the CPU measured is the waits', not the submissions'
        moments = iter(give_ups)
        for s, durations in pairs:
            ais.delay(lead, stream=s)
            t0, elapsed = time.monotonic(), lead
            for d in durations:
                ais.delay(d, stream=s)
                elapsed += d
                give_up = next(moments)
                work.append(
                    (s.record_event(), t0 + elapsed, None if give_up is None else t0 + give_up)
                )
        cpu = ours_cpu()
        async with anyio.create_task_group() as tg:
            for e, end, give_up in work:
                tg.start_soon(one, e, end, give_up)
        return late, ours_cpu() - cpu, cancelled

    timer_late, timer_cpu = anyio.run(timers, backend=backend, backend_options=options)
    sampler = threading.Thread(target=sample, name="bench sampler", daemon=True)
    sampler.start()
    try:
        late, cpu, cancelled = anyio.run(device, backend=backend, backend_options=options)
    finally:
        stop.set()
        sampler.join()
    time.sleep(0.5)
    return Scale(
        waits=waits,
        streams=streams,
        loop=loop,
        strategy=strategy,
        cancelled=cancelled,
        threads_peak=max(0, peak["threads"] - threads_before),
        threads_settled=max(0, os_threads() - threads_before),
        ours_peak=peak["ours"],
        ours_settled=aiostream_threads(),
        held_peak=held_peak,
        held_after=cuda.held(0),  # type: ignore[attr-defined]
        cpu_per_wait_us=cpu / len(give_ups) * 1e6,
        timer_cpu_per_wait_us=timer_cpu / len(give_ups) * 1e6,
        late_median_us=statistics.median(late) * 1e6 if late else 0.0,
        late_p99_us=_quantile(late, 0.99) * 1e6,
        timer_late_median_us=statistics.median(timer_late) * 1e6,
        timer_late_p99_us=_quantile(timer_late, 0.99) * 1e6,
    )


def pending_cpu(waits: int, streams: int, seconds: float, strategy: str) -> float:
    """The CPU share of one core this process uses while ``waits`` waits on ``streams``
    streams pend for ``seconds`` (asyncio)."""

    async def main() -> float:
        pairs = [ais.Stream(DEVICE) for _ in range(streams)]
        events = []
        for s in pairs:
            ais.delay(seconds + 0.2, stream=s)
            events += [s.record_event() for _ in range(max(1, waits // streams))]

        async def wait(e: ais.Event) -> None:
            await e.synchronize(strategy=strategy)

        async with anyio.create_task_group() as tg:
            for e in events:
                tg.start_soon(wait, e)
            await anyio.sleep(0.1)  # every wait has started and been handed over
            cpu, wall = time.process_time(), time.perf_counter()
            await anyio.sleep(seconds)
            share = (time.process_time() - cpu) / (time.perf_counter() - wall)
        return share

    return asyncio.run(main())
