"""The CUDA benchmark's own measurements (``bench_cuda.py``, ``gpu_graphs.py`` and the tests
that bound the same figures): awaits of pending work against ``cuEventSynchronize``, driver
calls per wait, the cost of a look, memory per pending wait, and two streams' kernels beside
pending waits. The rows that ``python -m aiostream bench`` prints too live in the package
(``aiostream/_bench/cuda.py``), and are imported from there."""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import statistics
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread

import aiostream as ais
from aiostream import _backends, _objects
from aiostream._bench.cuda import DEVICE, _ok, primary_context


def to_thread_wait(s: ais.Stream, e: ais.Event) -> Awaitable[None]:
    """(c): ``await anyio.to_thread.run_sync(cuEventSynchronize)`` of the same event, the
    device's context made current in the worker thread."""
    from cuda.bindings import driver

    handle = _objects.handle(e).ptr

    def sync() -> None:
        with primary_context():
            driver.cuEventSynchronize(handle)

    return anyio.to_thread.run_sync(sync)


@dataclass
class Beside:
    """Two streams' kernels beside long work on other streams (``beside_pending``)."""

    held_ms: float  #: how much later the kernels started than the host asked, by the device
    device_ms: float  #: first kernel's start to last kernel's end, by the device's clock
    await_ms: float  #: first submission to both awaits' return, by the host's clock


#: the ways waits can pend beside the two streams: none (the other streams' work alone),
#: driver (events recorded after it by the driver's own cuEventRecord: no mark), recorded
#: (aiostream's events, each record with its mark, none awaited), or awaited with one of the
#: wait strategies
BESIDE = ("none", "driver", "recorded", "quiet", "poll", "thread", "callback", "hybrid")


def beside_pending(
    how: str,
    streams: int = 10,
    waits: int = 1_000,
    kernel_s: float = 0.001,
    kernels: int = 50,
    pending_s: float = 0.5,
    device: str = DEVICE,
) -> Beside:
    """Streams a and b each run ``kernels`` kernels of ``kernel_s`` at once, while ``streams``
    other streams run work of ``pending_s`` and ``waits`` waits pend on them as ``how`` says
    (one of ``BESIDE``). On a device that holds later work behind host functions or stream
    memory operations (a device queue shared by several streams), a and b's kernels start
    late (``held_ms``), run long (``device_ms``), or only their awaits end late
    (``await_ms``); else the first is near 0 and the others near ``kernels * kernel_s``. The
    awaits of a and b use ``how``'s strategy (``quiet``, the default, for none, driver and
    recorded). Returns once the other streams' work is over: the next run starts on an idle
    device."""
    if how not in BESIDE:
        raise ValueError(f"how must be one of {', '.join(BESIDE)}, not {how!r}")
    strategy = how if how not in ("none", "driver", "recorded") else "quiet"
    index = ais.device(device).index

    async def main() -> Beside:
        a, b = ais.Stream(device), ais.Stream(device)
        for s in (a, b):  # warm-up: the kernel loaded, the streams ready
            ais.delay(kernel_s, stream=s)
            await s.synchronize(strategy=strategy)
        # the reference: recorded before anything else pends, so a hold shows as a late start
        ref = ais.Event(device, enable_timing=True)
        ref.record(a)
        asked_ref = time.perf_counter()
        others = [ais.Stream(device) for _ in range(streams)]
        for s in others:
            ais.delay(pending_s, stream=s)
        events: list[ais.Event] = []
        raw: list[Any] = []
        try:
            if how == "driver":
                raw = driver_records(others, waits, index)
            elif how != "none":
                events = [others[i % streams].record_event() for i in range(waits)]
            marks = [ais.Event(device, enable_timing=True) for _ in range(4)]
            async with anyio.create_task_group() as tg:
                if how not in ("none", "driver", "recorded"):
                    for e in events:
                        tg.start_soon(functools.partial(e.synchronize, strategy=strategy))
                await anyio.sleep(0.1)  # every wait begun and handed over
                start = time.perf_counter()
                marks[0].record(a)
                marks[1].record(b)
                for _ in range(kernels):
                    ais.delay(kernel_s, stream=a)
                    ais.delay(kernel_s, stream=b)
                marks[2].record(a)
                marks[3].record(b)
                await marks[2].synchronize(strategy=strategy)
                await marks[3].synchronize(strategy=strategy)
                took = time.perf_counter() - start
                tg.cancel_scope.cancel()
            first = min(marks[:2], key=ref.elapsed_time)
            held_ms = ref.elapsed_time(first) - (start - asked_ref) * 1e3
            device_ms = max(first.elapsed_time(marks[2]), first.elapsed_time(marks[3]))
        finally:
            for s in others:
                await s.synchronize(strategy="poll")
            if raw:
                driver_destroy(raw, index)
        return Beside(max(held_ms, 0.0), device_ms, took * 1e3)

    return anyio.run(main)


def driver_records(streams: list[ais.Stream], n: int, index: int = 0) -> list[Any]:
    """``n`` events of the driver's own (no timing), recorded with ``cuEventRecord`` on
    ``streams`` in turn, on device ``index``: records with no mark of aiostream's after them."""
    from cuda.bindings import driver

    events: list[Any] = []
    with primary_context(index):
        try:
            for i in range(n):
                event = _ok(driver.cuEventCreate(2), "cuEventCreate")  # DISABLE_TIMING
                events.append(event)
                handle = driver.CUstream(streams[i % len(streams)].__cuda_stream__()[1])
                _ok(driver.cuEventRecord(event, handle), "cuEventRecord")
        except BaseException:
            for event in events:
                driver.cuEventDestroy(event)
            raise
    return events


def driver_destroy(events: list[Any], index: int = 0) -> None:
    from cuda.bindings import driver

    with primary_context(index):
        for event in events:
            driver.cuEventDestroy(event)


def print_beside(
    streams: tuple[int, ...], hows: tuple[str, ...] = BESIDE, indent: str = "   ", **kw: Any
) -> None:
    """Print ``beside_pending`` for each count of other streams and each way in ``hows``,
    with each row's times over the ``none`` row's of its count (run first): how late the two
    streams' kernels started (held), their span and their awaits."""
    connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8, the default")
    print(f"{indent}(device queues: CUDA_DEVICE_MAX_CONNECTIONS={connections})")
    print(
        f"{indent}{'other streams':>13} {'waits pend':22} {'held ms':>8} {'device ms':>10} "
        f"{'x':>6} {'await ms':>9} {'x':>6}"
    )
    for count in streams:
        base: Beside | None = None
        for how in ("none", *[h for h in hows if h != "none"]):
            r = beside_pending(how, streams=count, **kw)
            base = base or r
            label = {
                "driver": "driver's records alone",
                "recorded": "recorded, not awaited",
            }.get(how, how)
            print(
                f"{indent}{count:>13} {label:22} {r.held_ms:8.1f} {r.device_ms:10.1f} "
                f"{r.device_ms / base.device_ms:6.2f} {r.await_ms:9.1f} "
                f"{r.await_ms / base.await_ms:6.2f}"
            )


def look_cost(n: int, repeats: int = 20) -> tuple[float, float]:
    """The CPU seconds of one look at ``n`` pending waits: (a sweep of the completion flags,
    one vectorised comparison; ``cuEventQuery`` of each event), the two ways a watching
    thread can learn of completions without a host function."""
    from cuda.bindings import driver

    backend = _backends.get("cuda")
    s = ais.Stream(DEVICE)
    ais.delay(30.0, stream=s)  # nothing completes while we look
    events = [s.record_event() for _ in range(n)]  # each record puts a mark after it
    handles = [_objects.handle(e).ptr for e in events]
    cpu = time.thread_time()
    for _ in range(repeats):
        backend.sweep(0)  # type: ignore[attr-defined]
    flags = (time.thread_time() - cpu) / repeats
    with primary_context():
        cpu = time.thread_time()
        for _ in range(repeats):
            for h in handles:
                driver.cuEventQuery(h)
        queries = (time.thread_time() - cpu) / repeats
    return flags, queries


# ---------------------------------------------------------------------- the short wait


def _run_on(loop: str, main: Callable[[], Awaitable[Any]]) -> Any:
    backend, options = (loop, {}) if loop != "uvloop" else ("asyncio", {"use_uvloop": True})
    return anyio.run(main, backend=backend, backend_options=options)


def pending_wait(
    loop: str, kernel_s: float, n: int, strategy: str | None = None
) -> dict[str, float]:
    """Medians (s) of what an await of pending work adds, interleaved in one loop's thread
    with the same work waited by a blocking ``cuEventSynchronize`` (the baseline): a kernel of
    ``kernel_s`` launched, an event recorded after it, then awaited; extra = submission to
    resumption minus the kernel. Also the await of complete work (the event waited already)
    against ``cuEventSynchronize`` of the same complete event, and the submission's cost."""
    from cuda.bindings import driver

    async def main() -> dict[str, float]:
        s = ais.Stream(DEVICE)
        e = ais.Event(DEVICE)
        e.record(s)
        handle = _objects.handle(e).ptr
        rows: dict[str, list[float]] = {
            k: [] for k in ("await", "sync", "done", "done_sync", "submit")
        }
        with primary_context():
            for i in range(n + 20):
                t0 = time.perf_counter()
                ais.delay(kernel_s, stream=s)
                e.record(s)
                t1 = time.perf_counter()
                await e.synchronize(strategy=strategy)
                t2 = time.perf_counter()
                await e.synchronize(strategy=strategy)  # complete work
                t3 = time.perf_counter()
                driver.cuEventSynchronize(handle)
                t4 = time.perf_counter()
                ais.delay(kernel_s, stream=s)
                e.record(s)
                driver.cuEventSynchronize(handle)
                t5 = time.perf_counter()
                if i >= 20:  # warm-up: the check budget learns the kernels' length
                    rows["await"].append(t2 - t0 - kernel_s)
                    rows["done"].append(t3 - t2)
                    rows["done_sync"].append(t4 - t3)
                    rows["sync"].append(t5 - t4 - kernel_s)
                    rows["submit"].append(t1 - t0)
        return {k: statistics.median(v) for k, v in rows.items()}

    result: dict[str, float] = _run_on(loop, main)
    return result


def driver_calls(loop: str, kernel_s: float, n: int, streams: int = 1) -> tuple[float, float]:
    """(driver calls per wait, host functions per 1,000 waits): ``n`` waits of ``kernel_s``
    kernels on ``streams`` streams (records back to back, all awaited at once), the
    submission's calls included: every call through the bindings, on any thread (the
    watcher's too), counted by wrapping the bindings module's functions meanwhile."""
    from cuda.bindings import driver as cu

    backend = _backends.get("cuda")
    dev = backend._devices.get(0)  # type: ignore[attr-defined]  # noqa: SLF001
    watcher = dev.watcher
    calls = [0]
    real_launch = watcher.launch
    originals = {
        name: getattr(cu, name)
        for name in dir(cu)
        if name.startswith("cu") and callable(getattr(cu, name))
    }

    def counting(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            calls[0] += 1
            return fn(*args)

        return call

    launches = [0]

    def launch(*args: Any) -> int:
        launches[0] += 1
        calls[0] += 1
        result: int = real_launch(*args)
        return result

    async def main() -> None:
        pool = [ais.Stream(DEVICE) for _ in range(streams)]
        per = max(1, n // streams)
        for s in pool:  # warm-up
            ais.delay(kernel_s, stream=s)
            await s.record_event().synchronize()
        for name, fn in originals.items():
            setattr(cu, name, counting(fn))
        watcher.launch = launch if real_launch is not None else None
        try:
            events = []
            for s in pool:
                for _ in range(per):
                    ais.delay(kernel_s, stream=s)
                    events.append(s.record_event())
            async with anyio.create_task_group() as tg:
                for e in events:
                    tg.start_soon(e.synchronize)
            del events
        finally:
            for name, fn in originals.items():
                setattr(cu, name, fn)
            watcher.launch = real_launch

    _run_on(loop, main)
    waits = max(1, n // streams) * streams
    return calls[0] / waits, launches[0] * 1000 / waits


# ---------------------------------------------------------------------- memory


def pending_memory(device: str, n: int, on: str = "events") -> float:
    """Bytes per pending wait, its asyncio task included (tracemalloc), as
    ``_bench.scale.memory_per_wait`` counts them: ``n`` tasks awaiting events recorded on 100
    streams (``on="events"``; made before the count begins), or each its own stream
    (``"streams"``), while the work before them is held (a manual clock on a virtual device;
    a kernel on CUDA, its waits cancelled after the count)."""
    virtual = device.startswith("virtual")
    if virtual:
        clock = ais.virtual.VirtualClock()
        ais.virtual.reset(clock=clock, compute_slots=max(n, 100))

    async def main() -> float:
        warm = ais.Stream(device)  # the waiter's code paths and caches, made before the count
        ais.delay(0.001, stream=warm)
        if virtual:
            clock.advance(0.01)
        await warm.record_event().synchronize()
        count = min(n, 100) if on == "events" else n
        streams = [ais.Stream(device) for _ in range(count)]
        for s in streams:
            ais.delay(1.0 + n * 200e-6, stream=s)  # longer than making the waits takes
        subjects: list[Any] = (
            [streams[i % count].record_event() for i in range(n)] if on == "events" else streams
        )
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        tasks = [asyncio.create_task(x.synchronize()) for x in subjects]
        for _ in range(3):  # every task runs up to its wait
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)  # CUDA: past the check budget, handed over
        per = (tracemalloc.get_traced_memory()[0] - before) / n
        tracemalloc.stop()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if virtual:
            clock.advance(1e6)
        return per  # (on CUDA the kernels run out meanwhile: nothing waits for them)

    try:
        return asyncio.run(main())
    finally:
        if virtual:
            ais.virtual.reset()
