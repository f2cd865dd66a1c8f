"""The data loader's modes and transforms: batches in the source's order with the data, of
any shape; a plain loop, running ahead inside ``async with``, and workers; transforms sync or
async, on the loop, in worker threads or in processes; the loader's own tasks and threads."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import numpy as np
import pytest

import aiostream as ais
from aiostream.testing import VirtualTime
from tests.helpers import virtual_loops
from tests.helpers.deadlines import deadline
from tests.helpers.loader import (
    arrays,
    fetch,
)
from tests.helpers.waits import assert_quiet as quiet

anyio_backend = virtual_loops.anyio_backend  # the module's loops: asyncio and trio

pytestmark = pytest.mark.anyio


async def test_batches_arrive_in_order_with_the_data(virtual_time: VirtualTime) -> None:
    s = ais.current_stream()
    seen = []
    async with ais.DataLoader(arrays(6), transform=lambda a: a * 2, prefetch=3) as loader:
        async for batch in loader:
            assert isinstance(batch.data, ais.DeviceBuffer)
            assert (batch.data.dtype, batch.data.shape) == (np.float32, (16,))
            data = await fetch(batch.data, s)
            seen.append((batch.index, float(data[0])))
    assert seen == [(i, 2.0 * i) for i in range(6)]
    assert loader.stats.batches == 6
    quiet()


@pytest.mark.aiostream(devices=2)
async def test_a_loader_on_another_device_than_the_default_works_there(
    virtual_time: VirtualTime,
) -> None:
    """Its copy stream and buffers are on its own device, not the default (``virtual:0``)."""
    s = ais.current_stream("virtual:1")
    seen = []
    async with ais.DataLoader(arrays(3), device="virtual:1") as loader:
        async for batch in loader:
            assert batch.data.device == ais.device("virtual:1")
            seen.append(float((await fetch(batch.data, s))[0]))
    assert seen == [0.0, 1.0, 2.0]
    assert {op.device for op in ais.virtual.timeline()} == {1}
    quiet()


async def test_tuples_and_dicts_keep_their_shape(virtual_time: VirtualTime) -> None:
    s = ais.current_stream()
    items = [(np.arange(4, dtype=np.int32) + i, np.ones((2, 3)) * i) for i in range(3)]
    async with ais.DataLoader(items) as loader:
        async for batch in loader:
            x, y = batch.data
            assert (x.dtype, x.shape, y.dtype, y.shape) == (np.int32, (4,), np.float64, (2, 3))
            assert (await fetch(y, s) == batch.index).all()
    dicts = [{"x": np.full(2, i, np.int64), "y": np.zeros(1, np.uint8)} for i in range(2)]
    async with ais.DataLoader(dicts) as loader:
        async for batch in loader:
            assert list(batch.data) == ["x", "y"]
            assert (await fetch(batch.data["x"], s) == batch.index).all()
    quiet()


async def test_async_source_and_async_transform(virtual_time: VirtualTime) -> None:
    async def source() -> AsyncIterator[np.ndarray]:
        for i in range(4):
            await anyio.sleep(0.001)
            yield np.full(8, i, np.uint8)

    async def transform(a: np.ndarray) -> np.ndarray:
        await anyio.sleep(0.002)
        return a + 1

    s = ais.current_stream()
    got = []
    async with ais.DataLoader(source(), transform=transform) as loader:
        async for batch in loader:
            got.append(int((await fetch(batch.data, s))[0]))
    assert got == [1, 2, 3, 4]
    quiet()


class Restarting:
    """An iterator that, against the protocol, yields again after it said it was done: the
    loader must take the first end as the end, and ask nothing more of it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0

    def __iter__(self) -> Restarting:
        return self

    def __next__(self) -> np.ndarray:
        self.calls += 1
        if self.calls == self.n + 1 or self.calls > 2 * self.n:
            raise StopIteration
        return np.full(4, self.calls, np.float32)


@pytest.mark.parametrize("to_thread", [False, True])
async def test_a_plain_loop_transforms_where_to_thread_says_and_stops_at_the_end(
    virtual_time: VirtualTime, to_thread: bool
) -> None:
    """Without ``async with`` the loader fills its batches in the consumer's task, the
    transform in a worker thread with ``to_thread=True``; it reads the source up to its first
    end and no further."""
    import threading

    threads: set[int] = set()

    def transform(a: np.ndarray) -> np.ndarray:
        threads.add(threading.get_ident())
        return a * 10

    s = ais.current_stream()
    source = Restarting(3)
    loader = ais.DataLoader(source, transform=transform, prefetch=2, to_thread=to_thread)
    batches = aiter(loader)
    seen = [(batch.index, (await fetch(batch.data, s)).tolist()) async for batch in batches]
    assert seen == [(i, [10.0 * (i + 1)] * 4) for i in range(3)]
    assert source.calls == 4  # three items and one end
    with pytest.raises(StopAsyncIteration):  # a finished pass stays finished
        await anext(batches)
    assert source.calls == 4
    assert (threading.get_ident() in threads) is not to_thread and len(threads) == 1
    quiet()


async def test_to_thread_runs_the_transform_in_a_worker(virtual_device: ais.Device) -> None:
    import threading

    main = threading.get_ident()
    threads = set()

    def transform(a: np.ndarray) -> np.ndarray:
        threads.add(threading.get_ident())
        return a + 1

    s = ais.current_stream()
    async with ais.DataLoader(arrays(3), transform=transform, to_thread=True) as loader:
        async for batch in loader:
            assert (await fetch(batch.data, s) == batch.index + 1).all()
    assert threads and main not in threads
    quiet()


@pytest.mark.parametrize(
    ("workers", "to_thread", "in_a_thread"),
    [(1, None, False), (2, None, True), (2, False, False), (1, True, True), (3, None, True)],
)
async def test_to_thread_defaults_to_true_with_more_than_one_worker(
    virtual_device: ais.Device, workers: int, to_thread: bool | None, in_a_thread: bool
) -> None:
    """Where a sync transform runs: in worker threads when ``to_thread`` says so, which it
    does by default once there is more than one worker; else on the loop's thread."""
    import threading

    loop_thread = threading.get_ident()
    ran_in: set[int] = set()

    def transform(a: np.ndarray) -> np.ndarray:
        ran_in.add(threading.get_ident())
        return a

    async with ais.DataLoader(
        arrays(4), transform=transform, workers=workers, to_thread=to_thread
    ) as loader:
        async for _ in loader:
            pass
    assert ran_in and (loop_thread not in ran_in) == in_a_thread
    quiet()


@pytest.mark.parametrize(("workers", "in_async_with"), [(1, False), (2, True)])
async def test_the_loaders_threads_are_its_own_not_the_default_limiters(
    virtual_device: ais.Device, workers: int, in_async_with: bool
) -> None:
    """The worker threads count against the loader's own limit (one per worker), never against
    anyio's default thread limiter, which the program may have used up."""
    default = anyio.to_thread.current_default_thread_limiter()
    total = default.total_tokens
    default.total_tokens = 1
    s = ais.current_stream()
    try:
        async with default:  # every default thread token is held
            with deadline(10, "the loader's own threads, the default limiter used up"):
                loader = ais.DataLoader(
                    arrays(4), transform=lambda a: a + 1, workers=workers, to_thread=True
                )
                async with loader if in_async_with else contextlib.nullcontext():
                    got = [float((await fetch(b.data, s))[0]) async for b in loader]
    finally:
        default.total_tokens = total
    assert got == [1.0, 2.0, 3.0, 4.0]
    quiet()


class AsyncCallable:
    """A transform object whose ``__call__`` is a coroutine function."""

    def __init__(self) -> None:
        self.threads: set[int] = set()

    async def __call__(self, a: np.ndarray) -> np.ndarray:
        import threading

        self.threads.add(threading.get_ident())
        await anyio.sleep(0)
        return a + 1


async def test_an_object_with_an_async_call_is_an_async_transform(
    virtual_device: ais.Device,
) -> None:
    """Awaited on the loop, as an async function is, whatever ``workers`` says."""
    import threading

    transform = AsyncCallable()
    s = ais.current_stream()
    async with ais.DataLoader(arrays(3), transform=transform, workers=2) as loader:
        got = [float((await fetch(b.data, s))[0]) async for b in loader]
    assert got == [1.0, 2.0, 3.0]
    assert transform.threads == {threading.get_ident()}
    quiet()


async def test_the_loaders_tasks_are_named(virtual_device: ais.Device) -> None:
    """Its producer and workers carry names that say whose they are (debuggers, task dumps)."""
    names: set[str] = set()
    outside = {task.name for task in anyio.get_running_tasks()}
    for to_thread in (True, False):
        async with ais.DataLoader(arrays(4), workers=2, to_thread=to_thread) as loader:
            async for _ in loader:
                names |= {task.name for task in anyio.get_running_tasks()}
    assert names - outside == {
        "aiostream.DataLoader producer on virtual:0",
        "aiostream.DataLoader worker 0",
        "aiostream.DataLoader worker 1",
    }


@pytest.mark.parametrize(
    "anyio_backend", [pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")]
)
async def test_the_loader_on_uvloop_in_real_time(virtual_device: ais.Device) -> None:
    """uvloop cannot fake time, so here the virtual device runs on the monotonic clock."""
    consumer = ais.Stream()
    results = []
    with ais.use_stream(consumer):
        async with ais.DataLoader(arrays(8, size=256), transform=lambda a: a + 1) as loader:
            async for batch in loader:
                ais.delay(0.001)
                out = ais.HostBuffer(batch.data.nbytes)
                ais.copy_async(out, batch.data)
                results.append((batch.index, out))
        await consumer.synchronize()
    assert [int(out.numpy(np.float32)[0]) for _, out in results] == list(range(1, 9))
    ais.virtual.assert_no_races()
    quiet()


async def test_inside_async_with_production_runs_ahead_of_the_consumer(
    virtual_time: VirtualTime,
) -> None:
    """Host transform 5 ms, consumer 10 ms of its own host time per batch: run ahead, the
    transforms hide under the consumer's time; produced inside ``__anext__``, they add up."""

    async def transform(a: np.ndarray) -> np.ndarray:
        await anyio.sleep(0.005)
        return a

    n = 10
    start = virtual_time.now()
    async with ais.DataLoader(arrays(n), transform=transform) as loader:
        async for _ in loader:
            await anyio.sleep(0.010)
    ahead = virtual_time.now() - start
    assert loader.stats.run_ahead
    assert ahead == pytest.approx(0.005 + n * 0.010, abs=1e-3)

    start = virtual_time.now()
    plain = ais.DataLoader(arrays(n), transform=transform)
    async for _ in plain:
        await anyio.sleep(0.010)
    assert not plain.stats.run_ahead
    assert virtual_time.now() - start == pytest.approx(n * 0.015, abs=1e-3)
    quiet()


async def test_workers_transform_at_once_and_keep_the_source_order(
    virtual_time: VirtualTime,
) -> None:
    """Later items finish their transform first; batches still come in the source's order."""
    n, running, most = 9, 0, 0

    async def transform(a: np.ndarray) -> np.ndarray:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await anyio.sleep(0.001 * (10 - int(a[0])))  # item 0 slowest
        running -= 1
        return a * 3

    s = ais.current_stream()
    got = []
    async with ais.DataLoader(arrays(n), transform=transform, workers=3) as loader:
        async for batch in loader:
            got.append((batch.index, int((await fetch(batch.data, s))[0])))
    assert got == [(i, 3 * i) for i in range(n)]
    assert most == 3
    assert loader.prefetch == 6 and loader.stats.workers == 3
    # the six items taken ahead when batch 0 came out (it among them); each batch is
    # fetched back before the next is asked for, so at most one more slot is ever made
    assert loader.stats.peak_in_use == 6
    assert loader.stats.allocations == 7  # one per slot, never per batch
    quiet()


async def test_sync_transforms_run_in_worker_threads_async_ones_on_the_loop(
    virtual_device: ais.Device,
) -> None:
    import threading

    main = threading.get_ident()
    sync_threads, async_threads = set(), set()

    def sync_transform(a: np.ndarray) -> np.ndarray:
        sync_threads.add(threading.get_ident())
        return a + 1

    async def async_transform(a: np.ndarray) -> np.ndarray:
        async_threads.add(threading.get_ident())
        await anyio.sleep(0)
        return a + 2

    s = ais.current_stream()
    for transform, plus in ((sync_transform, 1), (async_transform, 2)):
        async with ais.DataLoader(arrays(6), transform=transform, workers=2) as loader:
            async for batch in loader:
                assert (await fetch(batch.data, s) == batch.index + plus).all()
    assert sync_threads and main not in sync_threads
    assert async_threads == {main}
    quiet()


@pytest.mark.slow
async def test_a_pure_python_transform_can_use_processes(virtual_device: ais.Device) -> None:
    """The README's recipe where threads do not help: each worker awaits a process."""
    import anyio.to_process

    async def transform(a: np.ndarray) -> np.ndarray:
        return await anyio.to_process.run_sync(np.negative, a)

    s = ais.current_stream()
    got = []
    async with ais.DataLoader(arrays(4), transform=transform, workers=2) as loader:
        async for batch in loader:
            got.append(int((await fetch(batch.data, s))[0]))
    assert got == [0, -1, -2, -3]
    quiet()


@pytest.mark.parametrize(
    "anyio_backend", [pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")]
)
async def test_workers_on_uvloop_in_real_time(virtual_device: ais.Device) -> None:
    consumer = ais.Stream()
    results = []
    with ais.use_stream(consumer):
        async with ais.DataLoader(arrays(12, size=256), transform=np.negative, workers=3) as loader:
            async for batch in loader:
                ais.delay(0.0005)
                out = ais.HostBuffer(batch.data.nbytes)
                ais.copy_async(out, batch.data)
                results.append(out)
        await consumer.synchronize()
    assert [int(out.numpy(np.float32)[0]) for out in results] == [-i for i in range(12)]
    assert loader.stats.run_ahead and loader.stats.peak_in_use <= loader.prefetch + 2
    ais.virtual.assert_no_races()
    quiet()


async def test_no_more_worker_threads_than_items(virtual_time: VirtualTime) -> None:
    import threading

    names: set[str] = set()

    def transform(a: np.ndarray) -> np.ndarray:
        names.add(threading.current_thread().name)
        return a

    before = threading.active_count()
    async with ais.DataLoader(arrays(3), transform=transform, workers=200) as loader:
        async for _ in loader:
            assert threading.active_count() - before <= 3
    assert 1 <= len(names) <= 3
    quiet()
