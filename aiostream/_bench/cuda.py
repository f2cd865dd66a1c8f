"""CUDA waits: the latency and CPU of awaits of short kernels, against ``cuEventSynchronize``
in a plain thread and in ``anyio.to_thread``; and waits at scale: threads, handles held, CPU
and lateness of thousands of concurrent waits on hundreds of streams, against tasks sleeping on
the loop's own timer until the same moments (``benchmarks/bench_cuda.py`` prints them all)."""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import random
import statistics
import threading
import time
import tracemalloc
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


def to_thread_wait(s: ais.Stream, e: ais.Event) -> Awaitable[None]:
    """(c): ``await anyio.to_thread.run_sync(cuEventSynchronize)`` of the same event, the
    device's context made current in the worker thread."""
    from cuda.bindings import driver

    handle = _objects.handle(e).ptr

    def sync() -> None:
        with primary_context():
            driver.cuEventSynchronize(handle)

    return anyio.to_thread.run_sync(sync)


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
        while not stop.wait(0.005):
            peak["threads"] = max(peak["threads"], os_threads() - 1)  # less this sampler
            peak["ours"] = max(peak["ours"], aiostream_threads())
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
