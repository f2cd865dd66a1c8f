"""The async data loader: order, overlap, bounded prefetch, safe reuse, and clean stops."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import aiostream as ais
from aiostream.testing import VirtualTime

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Virtual time runs on asyncio's default loop and on trio (uvloop cannot fake time)."""
    return request.param


def arrays(n: int, size: int = 16) -> Iterator[np.ndarray]:
    for i in range(n):
        yield np.full(size, i, dtype=np.float32)


class Counted:
    """``n`` small arrays, counting how many the loader has taken so far."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pulled = 0

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(self.n):
            self.pulled += 1
            yield np.full(4, i, np.float32)


async def fetch(buf: ais.DeviceBuffer, stream: ais.Stream) -> np.ndarray:
    """Copy a device buffer back to the host, in order on ``stream``, and wait for it."""
    out = ais.HostBuffer(buf.nbytes)
    ais.copy_async(out, buf, stream=stream)
    await stream.synchronize()
    return out.numpy(buf.dtype, buf.shape).copy()


async def _noting_its_close(cleaned: list[bool]) -> AsyncIterator[np.ndarray]:
    """Ten small arrays, asynchronously; closing it awaits (as giving back a connection
    would), then appends to ``cleaned``."""
    try:
        for i in range(10):
            yield np.full(4, i, np.float32)
    finally:
        await anyio.sleep(0.01)
        cleaned.append(True)


def quiet() -> None:
    stats = ais.virtual.stats()
    assert (stats.operations, stats.waits) == (0, 0), stats


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


async def test_consumer_work_starts_after_the_copy_lands(virtual_time: VirtualTime) -> None:
    consumer = ais.Stream()
    with ais.use_stream(consumer):
        async with ais.DataLoader(arrays(2, size=1 << 20)) as loader:
            async for batch in loader:
                assert not batch.ready.query()  # the host did not wait for the copy
                ais.virtual.submit(consumer, 0.001, name=f"kernel{batch.index}")
        await consumer.synchronize()
    ops = ais.virtual.timeline()
    copies = [r for r in ops if r.engine == "h2d"]
    kernels = [r for r in ops if r.name.startswith("kernel")]
    for copy, kernel in zip(copies, kernels, strict=True):
        assert kernel.start >= copy.end


async def test_at_most_prefetch_batches_in_flight(virtual_time: VirtualTime) -> None:
    source = Counted(20)

    async with ais.DataLoader(source, prefetch=3) as loader:
        async for batch in loader:
            assert source.pulled - (batch.index + 1) <= 3  # handed out + in flight
            ais.delay(0.01)
    await ais.current_stream().synchronize()
    quiet()


async def test_reuse_never_overwrites_a_batch_still_in_use(virtual_time: VirtualTime) -> None:
    """A slow consumer: each batch is read 50 ms after it was handed out, by device work."""
    consumer = ais.Stream()
    results = []
    with ais.use_stream(consumer):
        async with ais.DataLoader(arrays(12, size=1024), prefetch=2) as loader:
            async for batch in loader:
                ais.delay(0.05)  # the consumer's kernel, long after the next copies could run
                out = ais.HostBuffer(batch.data.nbytes)
                ais.copy_async(out, batch.data)  # reads the batch when the kernel is done
                results.append((batch.index, out))
        await consumer.synchronize()
    for index, out in results:
        assert (out.numpy(np.float32) == index).all(), index
    stats = loader.stats
    # every slot: two ahead, the one held, and one the consumer's kernel still reads
    assert stats.peak_in_use == loader.prefetch + 2 == 4
    assert stats.allocations == loader.prefetch + 2  # one per slot, never per batch
    ais.virtual.assert_no_races()
    quiet()


async def test_reused_buffers_wait_for_the_consumer_on_the_device_not_the_host(
    virtual_time: VirtualTime,
) -> None:
    """1 s kernels per batch and a pool of 4 slots: every batch is handed out at once (the
    host never waits on the kernels), and each copy into a reused slot starts on the device
    the instant the kernel that read its previous batch ends."""
    handed_out = []
    async with ais.DataLoader(arrays(8), prefetch=2) as loader:
        async for batch in loader:
            handed_out.append(virtual_time.now())
            ais.virtual.submit(ais.current_stream(), 1.0, name=f"kernel{batch.index}")
    await ais.current_stream().synchronize()
    assert loader.stats.allocations == 4
    assert max(handed_out) < 0.001  # a host waiting on the kernels would take 4 s
    ops = ais.virtual.timeline()
    copies = [r for r in ops if r.engine == "h2d"]  # one stream: in item order
    kernels = {r.name: r for r in ops if r.name.startswith("kernel")}
    assert len(copies) == 8
    for k in range(4, 8):
        assert copies[k].start == kernels[f"kernel{k - 4}"].end
    quiet()


@pytest.mark.aiostream(bandwidth=1e6)  # 4 kB take 4 ms
async def test_record_stream_protects_batches_read_on_another_stream(
    virtual_time: VirtualTime,
) -> None:
    """The consumer reads each batch on a second, slow stream; record_stream orders reuse."""
    side = ais.Stream()
    results = []
    async with ais.DataLoader(arrays(10, size=256), prefetch=2) as loader:
        async for batch in loader:
            side.wait_event(batch.ready)
            batch.record_stream(side)
            ais.delay(0.05, stream=side)
            out = ais.HostBuffer(batch.data.nbytes)
            ais.copy_async(out, batch.data, stream=side)
            results.append((batch.index, out))
    await side.synchronize()
    for index, out in results:
        assert (out.numpy(np.float32) == index).all(), index
    with pytest.raises(TypeError, match="stream must be an aiostream.Stream"):
        batch.record_stream("side")  # type: ignore[arg-type]


def test_record_stream_refuses_a_stream_of_another_device() -> None:
    ais.virtual.reset(devices=2)

    async def main() -> None:
        async with ais.DataLoader(arrays(1)) as loader:
            async for batch in loader:
                with pytest.raises(ValueError) as caught:
                    batch.record_stream(ais.Stream("virtual:1"))
                assert str(caught.value) == "the batch is on virtual:0, the stream on virtual:1"

    anyio.run(main)


async def test_throughput_overlaps_the_stages(virtual_time: VirtualTime) -> None:
    """host 2 ms, copy ~4 ms, compute 3 ms: the pipeline runs at the slowest stage."""
    n, nbytes = 40, 4000

    async def transform(a: np.ndarray) -> np.ndarray:
        await anyio.sleep(0.002)
        return a

    source = (np.zeros(nbytes, np.uint8) for _ in range(n))
    async with ais.DataLoader(source, transform=transform, prefetch=2) as loader:
        async for _ in loader:
            ais.delay(0.003)
    await ais.current_stream().synchronize()
    copy = 10e-6 + nbytes / 1e6
    assert virtual_time.now() <= n * copy / 0.95


async def test_break_with_async_with_leaves_nothing_pending(virtual_time: VirtualTime) -> None:
    async with ais.DataLoader(arrays(100), prefetch=4) as loader:
        async for batch in loader:
            if batch.index == 2:
                break
    quiet()
    del batch, loader
    import gc

    gc.collect()
    assert ais.virtual.stats().buffers == 0


async def test_plain_break_stops_production_and_aclose_drains(virtual_time: VirtualTime) -> None:
    source = Counted(100)

    loader = ais.DataLoader(source, prefetch=2)
    async for batch in loader:  # noqa: B007 - the batch is checked after the loop
        break
    assert source.pulled == 2 and batch.index == 0
    await loader.aclose()
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


async def test_an_error_in_transform_stops_everything(virtual_time: VirtualTime) -> None:
    def transform(a: np.ndarray) -> np.ndarray:
        if a[0] == 3:
            raise RuntimeError("bad item 3")
        return a

    loader = ais.DataLoader(arrays(10), transform=transform)
    seen = []
    with pytest.raises(RuntimeError, match="bad item 3"):
        async for batch in loader:
            seen.append(batch.index)
    assert seen == [0, 1, 2]  # the batches before it, as inside 'async with'
    quiet()
    with pytest.raises(StopAsyncIteration):
        await loader._last.__anext__()  # type: ignore[union-attr]


async def test_a_failed_device_does_not_mask_the_error_that_stopped_the_loader(
    virtual_time: VirtualTime,
) -> None:
    def transform(a: np.ndarray) -> np.ndarray:
        if a[0] == 2:
            raise RuntimeError("bad item 2")
        return a

    ais.virtual.fail_next(engine="h2d", message="link down")
    with pytest.raises(RuntimeError, match="bad item 2"):
        async for _ in ais.DataLoader(arrays(5), transform=transform):
            pass
    with pytest.raises(ais.DeviceError, match="link down"):
        await ais.current_stream().synchronize()


async def test_cancelling_the_consumer_stops_everything(virtual_time: VirtualTime) -> None:
    async def slow(a: np.ndarray) -> np.ndarray:
        await anyio.sleep(1.0)
        return a

    loader = ais.DataLoader(arrays(10), transform=slow, prefetch=2)
    with anyio.move_on_after(2.5):
        async for _ in loader:
            pass
    quiet()
    await loader.aclose()


async def test_a_cancelled_step_of_a_plain_loop_raises_though_batches_are_ready(
    virtual_time: VirtualTime,
) -> None:
    """Produced inside each step (no ``async with``), a step cancelled while a batch made
    ahead waits raises the cancellation: it is not kept as the source's error with that batch
    handed out. The pass is closed: the next step ends it."""
    it = aiter(ais.DataLoader(arrays(5), prefetch=2))
    assert (await it.__anext__()).index == 0  # batch 1 was made ahead
    got = []
    with anyio.CancelScope() as scope:
        scope.cancel()
        got.append(await it.__anext__())
    assert scope.cancelled_caught and got == []
    with pytest.raises(StopAsyncIteration):
        await it.__anext__()
    await anyio.sleep(1)  # the copy left in flight lands (a cancelled close does not wait)
    quiet()


async def test_closing_from_another_task_ends_the_consumer_s_loop(
    virtual_time: VirtualTime,
) -> None:
    """Closed by another task (a shutdown handler) while an async transform runs, the loader
    ends the consumer's ``async for`` as the source's end does: the cancelled transform is not
    handed to the consumer as an error, and the closing task closing the consumer's side
    before the consumer sees the end (trio runs them in either order) ends it too. Here the
    producer is held in the source (shielded) so that the worker sees its cancellation
    first."""

    async def source() -> AsyncIterator[np.ndarray]:
        yield np.zeros(4, np.float32)
        with anyio.CancelScope(shield=True):
            await anyio.sleep(3)
        yield np.ones(4, np.float32)

    async def transform(a: np.ndarray) -> np.ndarray:
        await anyio.sleep(100)
        return a

    for _ in range(8):  # trio's order differs from run to run: eight runs see both
        outcome: list[str] = []
        async with ais.DataLoader(source(), transform=transform, prefetch=2) as loader:

            async def consume() -> None:
                try:
                    async for _ in loader:  # noqa: B023 - awaited in this turn of the loop
                        outcome.append("batch")  # noqa: B023
                except BaseException as exc:
                    outcome.append(type(exc).__name__)  # noqa: B023
                    raise
                outcome.append("ended")  # noqa: B023

            with anyio.fail_after(50):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(consume)
                    await anyio.sleep(1)  # item 0 in the transform, the producer in the source
                    tg.start_soon(loader.aclose)
        assert outcome == ["ended"]
        quiet()


async def test_an_async_source_s_cleanup_may_await_under_cancellation(
    virtual_time: VirtualTime,
) -> None:
    """Closing an async source is shielded: its ``finally`` may await (to give back a
    connection, say) though the block that closes it is being cancelled."""
    cleaned: list[bool] = []
    with anyio.CancelScope() as scope:
        async with ais.DataLoader(_noting_its_close(cleaned), prefetch=2) as loader:
            async for _ in loader:
                scope.cancel()
                await anyio.sleep(1)
    assert scope.cancelled_caught and cleaned == [True]
    await anyio.sleep(1)  # the copies left in flight land (a cancelled close does not wait)
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
            with anyio.fail_after(10):
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


def test_more_than_one_worker_needs_async_with(virtual_device: ais.Device) -> None:
    loader = ais.DataLoader(arrays(1), workers=2)
    with pytest.raises(RuntimeError) as caught:
        aiter(loader)
    assert str(caught.value) == (
        "workers=2 runs transforms in the loader's own tasks, which live in its 'async with' "
        "block: write 'async with DataLoader(...) as loader: async for batch in loader: ...' "
        "(or use workers=1)"
    )


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stop", ["exit", "aclose"])
async def test_exiting_waits_for_a_transform_still_running_in_a_thread(
    virtual_device: ais.Device, stop: str
) -> None:
    """A thread cannot be interrupted: leaving the block early (or ``aclose()`` inside it)
    waits for the transform it runs to return, so no thread of the loader outlives it."""
    import threading

    started, release = threading.Event(), threading.Event()
    finished: list[int] = []

    def transform(a: np.ndarray) -> np.ndarray:
        if a[0] == 1:
            started.set()
            release.wait(10)  # still running when the consumer leaves
        finished.append(int(a[0]))
        return a

    timer = threading.Timer(0.2, release.set)
    async with ais.DataLoader(arrays(2), transform=transform, workers=2) as loader:
        async for batch in loader:
            assert batch.index == 0 and finished == [0]
            with anyio.fail_after(10):
                while not started.is_set():
                    await anyio.sleep(0.001)
            timer.start()
            break
        assert finished == [0]  # item 1's transform is blocked in its thread
        if stop == "aclose":
            await loader.aclose()
            assert release.is_set() and finished == [0, 1]
    assert release.is_set() and finished == [0, 1]  # the exit waited for it to return
    timer.join()
    quiet()


@pytest.mark.timeout(60)
async def test_worker_threads_take_no_more_items_once_stopped(virtual_device: ais.Device) -> None:
    """Leaving early with items queued for the worker threads: each thread finishes the item
    it holds and takes no other, though more were taken from the source for them."""
    import threading

    gate = threading.Event()
    transformed: list[int] = []

    def transform(a: np.ndarray) -> np.ndarray:
        if a[0] != 0:
            gate.wait(10)  # held until the consumer has left
        transformed.append(int(a[0]))
        return a

    source = Counted(20)
    timer = threading.Timer(0.2, gate.set)
    async with ais.DataLoader(source, transform=transform, workers=2, prefetch=8) as loader:
        async for batch in loader:
            assert batch.index == 0
            timer.start()
            break
    timer.join()
    assert source.pulled >= 8  # items were queued for the threads
    assert set(transformed) <= {0, 1, 2}  # 0, and what the two threads held when stopped
    quiet()


def test_bad_input(virtual_device: ais.Device) -> None:
    with pytest.raises(TypeError, match="source must be an iterable"):
        ais.DataLoader(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="transform must be callable"):
        ais.DataLoader([], transform=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefetch must be >= 1"):
        ais.DataLoader([], prefetch=0)
    with pytest.raises(TypeError) as caught:
        ais.DataLoader([], prefetch=2.0)  # type: ignore[arg-type]
    assert str(caught.value) == "prefetch must be an int or None, got 2.0"
    with pytest.raises(TypeError, match="to_thread must be True or False"):
        ais.DataLoader([], to_thread="yes")  # type: ignore[arg-type]


async def test_items_must_be_arrays(virtual_time: VirtualTime) -> None:
    with pytest.raises(TypeError, match="numpy arrays, or tuples or dicts of them; got list"):
        async for _ in ais.DataLoader([[1, 2, 3]]):
            pass
    quiet()


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


# ---------------------------------------------------------------- running ahead, and workers


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


async def test_an_error_is_raised_in_its_turn_and_unwrapped(virtual_time: VirtualTime) -> None:
    """Item 3 fails first (its transform is the fastest); batches 0-2 still come, then it."""

    async def transform(a: np.ndarray) -> np.ndarray:
        i = int(a[0])
        await anyio.sleep(0.0001 if i == 3 else 0.005)
        if i == 3:
            raise RuntimeError("bad item 3")
        return a

    seen = []
    with pytest.raises(RuntimeError, match="bad item 3"):  # not an exception group
        async with ais.DataLoader(arrays(10), transform=transform, workers=4) as loader:
            async for batch in loader:
                seen.append(batch.index)
    assert seen == [0, 1, 2]
    quiet()


async def test_a_source_error_is_raised_in_its_turn(virtual_time: VirtualTime) -> None:
    async def source() -> AsyncIterator[np.ndarray]:
        for i in range(3):
            yield np.full(4, i, np.float32)
        raise OSError("disk gone")

    seen = []
    with pytest.raises(OSError, match="disk gone"):
        async with ais.DataLoader(source(), workers=2) as loader:
            async for batch in loader:
                seen.append(batch.index)
    assert seen == [0, 1, 2]
    quiet()


async def test_a_transform_error_stops_production_while_the_consumer_works(
    virtual_time: VirtualTime,
) -> None:
    """Item 1's transform fails while the consumer is busy with batch 0: nothing more is
    transformed or taken from the source, though items 2-4 were queued for the worker."""
    source = Counted(20)
    transformed: list[int] = []

    async def transform(a: np.ndarray) -> np.ndarray:
        transformed.append(int(a[0]))
        await anyio.sleep(0.01)
        if a[0] == 1:
            raise RuntimeError("bad item 1")
        return a

    seen = []
    with pytest.raises(RuntimeError, match="bad item 1"):
        async with ais.DataLoader(source, transform=transform, prefetch=4) as loader:
            async for batch in loader:
                seen.append(batch.index)
                await anyio.sleep(1.0)  # the consumer's own work: production has stopped
                assert transformed == [0, 1]
    assert seen == [0]
    assert transformed == [0, 1]
    assert source.pulled == 5  # four ahead, and one more for the credit batch 0 returned
    quiet()


async def test_the_block_s_own_error_is_not_wrapped(virtual_time: VirtualTime) -> None:
    with pytest.raises(KeyError, match="consumer"):
        async with ais.DataLoader(arrays(10), workers=2) as loader:
            async for _ in loader:
                raise KeyError("consumer")
    quiet()


async def test_a_cancellation_while_closing_does_not_replace_the_block_s_error(
    virtual_time: VirtualTime,
) -> None:
    """The block raises while its scope is being cancelled, with copies in flight: closing
    the loader sees the cancellation, which must not replace the block's error (the scope
    would then swallow it, and the error would be lost)."""
    with anyio.CancelScope() as scope:
        with pytest.raises(KeyError, match="consumer"):
            async with ais.DataLoader(arrays(10, size=1 << 22), prefetch=3) as loader:
                async for _ in loader:
                    scope.cancel()
                    raise KeyError("consumer")
    await anyio.sleep(1.0)  # the copies left in flight land (a cancelled close does not wait)
    quiet()


async def test_an_error_closing_the_source_follows_the_block_s_error(
    virtual_time: VirtualTime,
) -> None:
    """Closing an async source may fail too: that error is raised, with the block's error as
    its context, as Python does for an error in a ``finally`` (neither is lost)."""

    async def source() -> AsyncIterator[np.ndarray]:
        try:
            for i in range(10):
                yield np.full(16, i, np.float32)
        finally:
            raise RuntimeError("the source's cleanup failed")  # noqa: B012

    with pytest.raises(RuntimeError, match="cleanup failed") as info:
        async with ais.DataLoader(source(), prefetch=2) as loader:
            async for _ in loader:
                raise KeyError("consumer")
    chain, context = [], info.value.__context__
    while context is not None:  # closing the generator raised GeneratorExit into it first
        chain.append(type(context))
        context = context.__context__
    assert KeyError in chain, chain
    quiet()


@pytest.mark.timeout(30)  # a walk that never ends hangs
def test_chaining_a_closing_error_to_the_block_s_never_makes_a_cycle() -> None:
    """The block's error goes at the end of the closing error's context chain, unless it is
    there already, or the closing error is in the block's own chain (linking them would make
    a cycle, which tracebacks would follow forever); a cycle already in a chain ends the walk."""
    from aiostream.loader import _after

    inner, block = ValueError("inner"), RuntimeError("block")
    block.__context__ = inner
    _after(inner, block)  # closing raised an error the block's already holds
    assert inner.__context__ is None
    closing, middle = OSError("closing"), KeyError("middle")
    closing.__context__ = middle
    _after(closing, block)
    assert (closing.__context__, middle.__context__) == (middle, block)
    _after(closing, block)  # already at its end: nothing changes
    assert (closing.__context__, middle.__context__, block.__context__) == (middle, block, inner)
    a, b, other = ValueError("a"), ValueError("b"), RuntimeError("other")
    a.__context__, b.__context__, other.__context__ = b, a, a  # a cycle in the block's chain
    last = OSError("last")
    _after(last, other)
    assert last.__context__ is other
    deep, upper, outer = ValueError("deep"), KeyError("upper"), RuntimeError("outer")
    outer.__context__, upper.__context__ = upper, deep  # the closing error, two links down
    _after(deep, outer)
    assert deep.__context__ is None
    x, y, z = ValueError("x"), ValueError("y"), RuntimeError("z")
    x.__context__, y.__context__ = y, x  # a cycle in the closing error's own chain
    _after(x, z)  # ends: the chain has no end to link to
    assert (x.__context__, y.__context__, z.__context__) == (y, x, None)


async def test_nothing_is_handed_out_after_an_error(virtual_time: VirtualTime) -> None:
    """An error handed out stops everything at once: a worker done with the next item in the
    same turn of the loop (before the producer task sees its cancellation) enqueues no copy
    for it, and hands out nothing."""
    both = anyio.Event()

    async def transform(a: np.ndarray) -> np.ndarray:
        if a[0] == 0:
            await anyio.sleep(1)
            both.set()  # item 1's transform goes on in this turn
            raise RuntimeError("bad item 0")
        await both.wait()
        return a

    with pytest.raises(RuntimeError, match="bad item 0"):
        async with ais.DataLoader(arrays(6), transform=transform, workers=2) as loader:
            async for _ in loader:
                pytest.fail("no batch comes before the error")
    assert [op.engine for op in ais.virtual.timeline()] == []  # no copy was enqueued
    quiet()


async def test_leaving_the_block_early_stops_the_producer(virtual_time: VirtualTime) -> None:
    source = Counted(100)

    async with ais.DataLoader(source, prefetch=3) as loader:
        async for batch in loader:
            if batch.index == 1:
                break
        await anyio.sleep(0.1)  # the producer, parked on its credits, takes no more
        assert source.pulled == 2 + 3  # the two handed out, and prefetch ahead
    assert source.pulled == 2 + 3
    quiet()


async def test_cancelling_the_block_stops_every_worker(virtual_time: VirtualTime) -> None:
    started = 0

    async def slow(a: np.ndarray) -> np.ndarray:
        nonlocal started
        started += 1
        await anyio.sleep(1.0)
        return a

    with anyio.move_on_after(2.5) as scope:
        async with ais.DataLoader(arrays(20), transform=slow, workers=2) as loader:
            async for batch in loader:  # noqa: B007 - kept to show it holds its buffers
                pass
    assert scope.cancelled_caught
    # two at a time, 1 s each: items 0-3 are done by 2.0 s, 4 and 5 would be at 3.0 s
    assert loader.stats.batches == 4
    assert started == 6  # the two in progress when cancelled; no more started
    quiet()
    import gc

    del batch, loader  # the last batch held its slot's buffers
    gc.collect()
    assert ais.virtual.stats().buffers == 0


async def test_workers_need_the_async_with_block(virtual_device: ais.Device) -> None:
    loader = ais.DataLoader(arrays(2), workers=2)
    with pytest.raises(RuntimeError) as info:
        async for _ in loader:
            pass
    assert str(info.value) == (
        "workers=2 runs transforms in the loader's own tasks, which live in its 'async with' "
        "block: write 'async with DataLoader(...) as loader: async for batch in loader: ...' "
        "(or use workers=1)"
    )
    async with loader:
        with pytest.raises(RuntimeError) as info:
            await loader.__aenter__()
        assert str(info.value) == (
            "this DataLoader is already open in an 'async with' block: iterate it there, or "
            "make another DataLoader for a second block"
        )


def test_bad_workers(virtual_device: ais.Device) -> None:
    with pytest.raises(TypeError, match="workers must be an int"):
        ais.DataLoader([], workers=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="workers must be an int"):
        ais.DataLoader([], workers=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="workers must be >= 1"):
        ais.DataLoader([], workers=0)
    with pytest.raises(ValueError) as caught:
        ais.DataLoader([], workers=3, prefetch=2)
    assert str(caught.value) == (
        "prefetch (2) must be >= workers (3): each worker transforms an item ahead of the "
        "consumer; raise prefetch or leave it None"
    )
    assert ais.DataLoader([], workers=5).prefetch == 10
    assert ais.DataLoader([]).prefetch == 2


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


async def test_a_sync_transform_returning_an_awaitable_in_a_thread_is_refused(
    virtual_device: ais.Device,
) -> None:
    async def later(a: np.ndarray) -> np.ndarray:
        return a

    with pytest.raises(TypeError, match="returned an awaitable from a worker thread"):
        async with ais.DataLoader(arrays(3), transform=lambda a: later(a), workers=2) as loader:
            async for _ in loader:
                pass
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


# ---------------------------------------------------------------------- outside contracts

#: real time, every loop (uvloop too: these need no fake clock)
EVERY_LOOP = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]
MODES = {
    "plain": None,  # async for, no async with: produced inside __anext__
    "ahead": {},  # inside async with: the loader's own tasks
    "threads": {"workers": 2},  # inside async with, transforms in worker threads
}


async def _consume(mode: str, source: object, seen: list[int], **options: object) -> None:
    kwargs = {**(MODES[mode] or {}), **options}
    if MODES[mode] is None:
        async for batch in ais.DataLoader(source, **kwargs):  # type: ignore[arg-type]
            seen.append(batch.index)
        return
    async with ais.DataLoader(source, **kwargs) as loader:  # type: ignore[arg-type]
        async for batch in loader:
            seen.append(batch.index)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", EVERY_LOOP)
@pytest.mark.parametrize("mode", sorted(MODES))
async def test_a_stalled_loader_leaves_when_cancelled(
    virtual_device: ais.Device, anyio_backend: object, mode: str
) -> None:
    """Copies that cannot land (the engine is stalled) do not hold the exit: the buffers go
    to the device, freed when the copies complete."""
    seen: list[int] = []
    with ais.virtual.stall("h2d"):
        with anyio.move_on_after(0.2) as scope:
            await _consume(mode, arrays(8), seen, transform=lambda a: a)
        assert scope.cancelled_caught  # the copies never land: the loader waits for slots
    with anyio.fail_after(5):  # released: the copies land (the fixture checks for leaks)
        while ais.virtual.stats().operations:
            await anyio.sleep(0.001)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("where", ["transform", "source"])
async def test_an_error_comes_after_the_batches_before_it_in_every_mode(
    virtual_time: VirtualTime, mode: str, where: str
) -> None:
    def transform(a: np.ndarray) -> np.ndarray:
        if where == "transform" and a[0] == 3:
            raise RuntimeError("bad item 3")
        return a

    def source() -> Iterator[np.ndarray]:
        for i in range(10):
            if where == "source" and i == 3:
                raise RuntimeError("bad item 3")
            yield np.full(4, i, np.float32)

    seen: list[int] = []
    with pytest.raises(RuntimeError, match="bad item 3"):  # as itself, not in a group
        await _consume(mode, source(), seen, transform=transform)
    assert seen == [0, 1, 2]
    quiet()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", EVERY_LOOP)
@pytest.mark.parametrize("mode", sorted(MODES))
async def test_leaving_after_the_device_failed_does_not_hang(
    virtual_device: ais.Device, anyio_backend: object, mode: str
) -> None:
    """The device fails while the consumer holds a batch, and the consumer leaves the loop:
    giving the batch back records on the failed device, which raises. Closing still stops
    the producer and returns; the failure stays for the program's own awaits to report.
    (Real time: a fake clock would jump to the deadline while a worker thread runs.)"""
    loader = ais.DataLoader(arrays(10), **(MODES[mode] or {}))
    with anyio.fail_after(10):
        async with contextlib.AsyncExitStack() as stack:
            if MODES[mode] is not None:
                await stack.enter_async_context(loader)
            async for _ in loader:
                ais.virtual.fail_next(message="link down")
                ais.delay(0.001)
                with pytest.raises(ais.DeviceError, match="link down"):
                    await ais.current_stream().synchronize()
                break
            await loader.aclose()
    with pytest.raises(ais.DeviceError, match="link down"):
        await ais.current_stream().synchronize()


@pytest.mark.parametrize("anyio_backend", EVERY_LOOP)
@pytest.mark.parametrize("mode", sorted(MODES))
async def test_a_keyboard_interrupt_from_the_source_is_raised_as_itself(
    virtual_device: ais.Device, anyio_backend: object, mode: str
) -> None:
    def source() -> Iterator[np.ndarray]:
        yield np.zeros(4, np.float32)
        raise KeyboardInterrupt

    seen: list[int] = []
    with anyio.fail_after(10):
        with pytest.raises(KeyboardInterrupt):
            await _consume(mode, source(), seen)
    assert seen == [0]


@pytest.mark.parametrize("anyio_backend", EVERY_LOOP)
async def test_a_keyboard_interrupt_from_a_transform_thread_is_raised_as_itself(
    virtual_device: ais.Device, anyio_backend: object
) -> None:
    def transform(a: np.ndarray) -> np.ndarray:
        if a[0] == 1:
            raise KeyboardInterrupt
        return a

    seen: list[int] = []
    with anyio.fail_after(10):
        with pytest.raises(KeyboardInterrupt):
            await _consume("threads", arrays(5), seen, transform=transform)
    assert seen == [0]


async def test_a_slot_whose_copy_is_in_flight_is_not_taken_for_idle(
    virtual_time: VirtualTime,
) -> None:
    """Batches taken on one stream and let go on another, which never waited for their
    copies: the work on the stream that let a batch go being done does not make its slot idle
    (the stream it was taken on, which waited for the copy, is waited for too), so the loader
    makes a new slot (the pool has room for three) rather than have the host wait for that
    copy; only with the pool full does it wait."""
    a, b = ais.Stream(), ais.Stream()
    handed_out = []
    async with ais.DataLoader(arrays(6, size=1 << 22), prefetch=1) as loader:
        batches = aiter(loader)
        for i in range(6):
            with ais.use_stream(a if i % 2 == 0 else b):  # b's work waits for no copy
                batch = await anext(batches)
            handed_out.append(virtual_time.now())
            assert not batch.ready.query()  # 16 MiB each: every copy is still in flight
    assert handed_out[:3] == [0.0, 0.0, 0.0]
    assert handed_out[3] > 0.0  # the pool is full: the oldest slot, after its copy
    assert loader.stats.allocations == loader.stats.pool_size == 3
    await ais.current_stream().synchronize()
    quiet()


@pytest.mark.parametrize("mode", ["plain", "ahead"])
async def test_an_empty_source_takes_no_slot(virtual_time: VirtualTime, mode: str) -> None:
    loader = ais.DataLoader([], prefetch=2)
    if mode == "plain":
        batches = [batch async for batch in loader]
    else:
        async with loader:
            batches = [batch async for batch in loader]
    assert batches == []
    stats = loader.stats
    assert (stats.batches, stats.allocations, stats.pool_size, stats.peak_in_use) == (0, 0, 4, 0)
    assert stats.run_ahead == (mode == "ahead")
    quiet()


async def test_slots_are_made_as_needed(virtual_time: VirtualTime) -> None:
    """A huge prefetch costs nothing up front: a slot per item in flight, at most."""
    loader = ais.DataLoader(arrays(3), prefetch=1 << 40)
    async for _ in loader:
        pass
    assert loader.stats.allocations == 3
    assert loader.stats.peak_in_use == 3  # all three taken at the first step
    quiet()


@pytest.mark.parametrize("mode", ["plain", "ahead"])
async def test_buffers_are_made_again_only_when_an_item_s_shape_changes(
    virtual_time: VirtualTime, mode: str
) -> None:
    sizes = [16, 16, 16, 16, 32, 32, 32, 32, 16]
    items = [np.full(n, i, np.float32) for i, n in enumerate(sizes)]
    s = ais.current_stream()
    got: list[tuple[tuple[int, ...], float]] = []

    async def take(loader: ais.DataLoader) -> None:
        async for batch in loader:
            got.append((batch.data.shape, float((await fetch(batch.data, s))[0])))

    loader = ais.DataLoader(items, prefetch=1)  # a pool of 3 slots
    if mode == "plain":
        await take(loader)
    else:
        async with loader:
            await take(loader)
    assert got == [((n,), float(i)) for i, n in enumerate(sizes)]
    # Each batch is fetched back before the next is asked for, so a released slot is idle
    # and reused at once: one slot inside each step of a plain loop, two running ahead (the
    # batch held and the next). A slot is made again where the item's size changes: at
    # item 4 for every slot, and at item 8 for the one it takes.
    slots = 1 if mode == "plain" else 2
    assert loader.stats.allocations == slots + slots + 1
    assert loader.stats.peak_in_use == 1  # the held batch's slot when it is handed out
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


async def _indices_from_a_loader(**options: Any) -> AsyncGenerator[int, None]:
    """An async generator that owns an 'async with DataLoader' block."""
    async with ais.DataLoader(arrays(10), workers=2, **options) as loader:
        async for batch in loader:
            yield batch.index


async def _close_elsewhere(
    agen: AsyncGenerator[int, None], then: Callable[[], None] = lambda: None
) -> BaseException | None:
    """Close ``agen`` from another task, as a loop's async-generator finalizer does: what
    closing raised, if anything; ``then()`` runs right after, with no checkpoint between."""
    raised: list[BaseException] = []

    async def close() -> None:
        try:
            await agen.aclose()
        except BaseException as exc:  # noqa: BLE001 - returned to the caller
            raised.append(exc)
        then()

    async with anyio.create_task_group() as tg:
        tg.start_soon(close)
    return raised[0] if raised else None


# trio itself refuses a nursery left open in a suspended generator
LOOPS_BUT_TRIO = [p for p in EVERY_LOOP if p.id != "trio"]


@pytest.mark.parametrize("anyio_backend", EVERY_LOOP)
async def test_an_async_generator_owning_a_loader_closes_with_aclosing(
    virtual_device: ais.Device, anyio_backend: object
) -> None:
    """README's pattern: the generator is closed in the task that ran it."""
    import contextlib

    async with contextlib.aclosing(_indices_from_a_loader()) as agen:
        async for index in agen:
            if index == 2:
                break
    await ais.current_stream().synchronize()
    assert ais.virtual.stats().operations == 0


@pytest.mark.parametrize("anyio_backend", LOOPS_BUT_TRIO)
async def test_leaving_the_block_from_another_task_says_what_to_write(
    virtual_device: ais.Device, anyio_backend: object
) -> None:
    agen = _indices_from_a_loader()
    assert await agen.__anext__() == 0
    raised = await _close_elsewhere(agen)
    assert isinstance(raised, RuntimeError), raised
    assert str(raised) == (
        "this DataLoader's 'async with' block is being left from another task than the one "
        "that entered it: an async generator holding it was not closed where it ran. Wrap the "
        "generator in 'contextlib.aclosing(...)' (and iterate it in an 'async with' of that), "
        "or iterate the loader with a plain 'async for' (no 'async with') inside the generator"
    )
    await ais.current_stream().synchronize()


@pytest.mark.parametrize("anyio_backend", LOOPS_BUT_TRIO)
async def test_a_loader_left_from_another_task_is_stopped_and_closed_by_its_aclose(
    virtual_device: ais.Device, anyio_backend: object
) -> None:
    """Left from another task, the block stops every pass of the loader, a plain one begun
    before it too (its next step ends it, as after a block left as it should be), but cannot
    wait there: the program's own ``aclose`` then closes the source."""
    cleaned: list[bool] = []

    async def indices(loader: ais.DataLoader) -> AsyncGenerator[int, None]:
        async with loader:
            async for batch in loader:
                yield batch.index

    listed = ais.DataLoader(list(arrays(4)), prefetch=2)
    plain = aiter(listed)
    agen = indices(listed)
    assert await agen.__anext__() == 0
    assert isinstance(await _close_elsewhere(agen), RuntimeError)
    with pytest.raises(StopAsyncIteration):
        await plain.__anext__()
    loader = ais.DataLoader(_noting_its_close(cleaned), prefetch=2)
    agen = indices(loader)
    assert await agen.__anext__() == 0
    assert isinstance(await _close_elsewhere(agen), RuntimeError)
    assert cleaned == []
    await loader.aclose()
    assert cleaned == [True]
    await ais.current_stream().synchronize()
    quiet()


@pytest.mark.parametrize("anyio_backend", LOOPS_BUT_TRIO)
async def test_worker_threads_take_no_item_once_the_block_is_left_from_another_task(
    virtual_device: ais.Device, anyio_backend: object
) -> None:
    """The loader stops its producer there and then: a worker thread done with its item takes
    none of those queued behind it, even before the producer task runs again."""
    import threading
    import time

    gate, calls = threading.Event(), []

    def transform(x: np.ndarray) -> np.ndarray:
        calls.append(x)
        if len(calls) > 1:  # the first is handed out; the workers then hold one each
            gate.wait(10)
        return x

    agen = _indices_from_a_loader(transform=transform)
    assert await agen.__anext__() == 0
    with anyio.fail_after(5):
        while len(calls) < 3:  # both workers wait at the gate; more items are queued
            await anyio.sleep(0.001)
    taken: list[int] = []

    def release_the_workers() -> None:
        gate.set()  # no checkpoint since the block was left: the producer task has not run
        time.sleep(0.3)  # the workers finish their items, and would take the queued ones
        taken.append(len(calls))

    raised = await _close_elsewhere(agen, then=release_the_workers)
    assert isinstance(raised, RuntimeError) and "from another task" in str(raised), raised
    assert taken == [3]
    await ais.current_stream().synchronize()
