"""The data loader's clean stops: a loop left early, a consumer or block cancelled, a loader
closed from another task, a stalled device, threads that cannot be interrupted, and async
generators that own a loader (closed where they ran, or left from another task)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

import anyio
import numpy as np
import pytest

import aiostream as ais
from aiostream.testing import VirtualTime
from tests.helpers import virtual_loops
from tests.helpers.deadlines import deadline, until, until_blocking
from tests.helpers.loader import (
    EVERY_LOOP,
    LEFT_BEHIND,
    LOOPS_BUT_TRIO,
    MODES,
    Counted,
    arrays,
    close_elsewhere,
    consume,
    indices_from_a_loader,
    noting_its_close,
    until_released,
)
from tests.helpers.waits import assert_quiet as quiet

anyio_backend = virtual_loops.anyio_backend  # the module's loops: asyncio and trio

pytestmark = pytest.mark.anyio


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

            with deadline(50, "the consumer's loop to end once another task closed it"):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(consume)
                    await anyio.sleep(1)  # item 0 in the transform, the producer in the source
                    tg.start_soon(loader.aclose)
        assert outcome == ["ended"]
        quiet()


@pytest.mark.parametrize("anyio_backend", EVERY_LOOP)
@pytest.mark.parametrize("closers", [1, 2])
@pytest.mark.parametrize("waits_in", ["async generator", "async transform"])
async def test_closing_a_plain_loop_from_another_task_while_it_takes_a_batch(
    virtual_device: ais.Device, anyio_backend: object, closers: int, waits_in: str
) -> None:
    """Closed by other tasks (one, or two at once) while the consumer's plain ``async for``
    waits in the source's ``__anext__`` (an async generator) or in an async transform: no
    ``aclose()`` raises, the source is closed when each returns, and the consumer's loop ends
    as at the source's end, with no batch after the close."""
    cleaned: list[bool] = []

    async def slow_source() -> AsyncIterator[np.ndarray]:
        try:
            yield np.zeros(4, np.float32)
            await anyio.sleep(30)
            yield np.ones(4, np.float32)
        finally:
            cleaned.append(True)

    async def slow_transform(a: np.ndarray) -> np.ndarray:
        if a[0] == 1:
            await anyio.sleep(30)
        return a

    if waits_in == "async generator":
        loader = ais.DataLoader(slow_source(), prefetch=1)
    else:
        loader = ais.DataLoader(arrays(3), transform=slow_transform, prefetch=1)
    events: list[str] = []

    async def take() -> None:
        async for batch in loader:
            events.append(f"batch {batch.index}")
        events.append("ended")

    async def close() -> None:
        await loader.aclose()
        events.append(f"closed, source closed: {cleaned == [True]}")

    with deadline(10, "the loader to close and the consumer's loop to end"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(take)
            await until(lambda: events == ["batch 0"], "the consumer to take batch 0")
            await anyio.sleep(0.05)  # it waits in the source, or in the transform
            for _ in range(closers):
                tg.start_soon(close)
    closed = "closed, source closed: " + str(waits_in == "async generator")
    assert events[0] == "batch 0"
    assert sorted(events[1:]) == sorted([closed] * closers + ["ended"]), events
    quiet()


async def test_an_async_source_s_cleanup_may_await_under_cancellation(
    virtual_time: VirtualTime,
) -> None:
    """Closing an async source is shielded: its ``finally`` may await (to give back a
    connection, say) though the block that closes it is being cancelled."""
    cleaned: list[bool] = []
    with anyio.CancelScope() as scope:
        async with ais.DataLoader(noting_its_close(cleaned), prefetch=2) as loader:
            async for _ in loader:
                scope.cancel()
                await anyio.sleep(1)
    assert scope.cancelled_caught and cleaned == [True]
    await anyio.sleep(1)  # the copies left in flight land (a cancelled close does not wait)
    quiet()


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
            await until(started.is_set, "item 1's transform to start in its thread")
            break
        assert finished == [0]  # item 1's transform is blocked in its thread
        timer.start()  # it returns 0.2 s from now, while the block's exit waits for it
        if stop == "aclose":
            await loader.aclose()
            assert release.is_set() and finished == [0, 1]
    assert release.is_set() and finished == [0, 1]  # the exit waited for it to return
    timer.join()
    del loader, batch  # its worker thread, idle now, lets go of it back in its pool
    await until_released("the loader's worker thread to let go of its stream")
    quiet()


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
    # the gate opens while the block's exit waits for the threads (0.5 s: a wide margin for
    # a loaded machine, on which it must not open before the block is left)
    timer = threading.Timer(0.5, gate.set)
    async with ais.DataLoader(source, transform=transform, workers=2, prefetch=8) as loader:
        async for batch in loader:
            assert batch.index == 0
            timer.start()
            break
    timer.join()
    assert source.pulled >= 8  # items were queued for the threads
    assert set(transformed) <= {0, 1, 2}  # 0, and what the two threads held when stopped
    quiet()


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
            await consume(mode, arrays(8), seen, transform=lambda a: a)
        assert scope.cancelled_caught  # the copies never land: the loader waits for slots
    # released: the copies land (the fixture checks for leaks)
    await until(lambda: not ais.virtual.stats().operations, "the released copies to land")


@pytest.mark.parametrize("anyio_backend", EVERY_LOOP)
@pytest.mark.parametrize("mode", sorted(MODES))
async def test_a_cancellation_while_closing_at_the_source_s_end_propagates(
    virtual_device: ais.Device, anyio_backend: object, mode: str
) -> None:
    """The source ends while its one copy cannot land (the engine is stalled): closing at the
    end waits for that copy, and the cancellation that comes meanwhile is raised, not taken
    for the loop's end."""
    seen: list[int] = []
    with ais.virtual.stall("h2d"):
        with anyio.move_on_after(0.2) as scope:
            await consume(mode, arrays(1), seen)
        assert seen == [0]
        assert scope.cancelled_caught  # the cancellation reached its scope
    await until(lambda: not ais.virtual.stats().operations, "the released copy to land")


@pytest.mark.parametrize("anyio_backend", EVERY_LOOP)
async def test_an_async_generator_owning_a_loader_closes_with_aclosing(
    virtual_device: ais.Device, anyio_backend: object
) -> None:
    """README's pattern: the generator is closed in the task that ran it."""

    async with contextlib.aclosing(indices_from_a_loader()) as agen:
        async for index in agen:
            if index == 2:
                break
    await ais.current_stream().synchronize()
    assert ais.virtual.stats().operations == 0


@pytest.mark.parametrize("anyio_backend", LOOPS_BUT_TRIO)
async def test_leaving_the_block_from_another_task_says_what_to_write(
    virtual_device: ais.Device, anyio_backend: object
) -> None:
    agen = indices_from_a_loader()
    assert await agen.__anext__() == 0
    raised = await close_elsewhere(agen)
    assert isinstance(raised, RuntimeError), raised
    assert str(raised) == (
        "this DataLoader's 'async with' block is being left from another task than the one "
        "that entered it: an async generator holding it was not closed where it ran. Wrap the "
        "generator in 'contextlib.aclosing(...)' (and iterate it in an 'async with' of that), "
        "or iterate the loader with a plain 'async for' (no 'async with') inside the generator"
    )
    await ais.current_stream().synchronize()
    del raised, agen  # the error's frames hold the loader
    await until_released(LEFT_BEHIND)


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
    assert isinstance(await close_elsewhere(agen), RuntimeError)
    with pytest.raises(StopAsyncIteration):
        await plain.__anext__()
    loader = ais.DataLoader(noting_its_close(cleaned), prefetch=2)
    agen = indices(loader)
    assert await agen.__anext__() == 0
    assert isinstance(await close_elsewhere(agen), RuntimeError)
    assert cleaned == []
    await loader.aclose()
    assert cleaned == [True]
    await ais.current_stream().synchronize()
    quiet()
    del listed, plain, loader, agen
    await until_released(
        "the loader's tasks, left behind by a block left from another task, let go of its "
        "stream, events and buffers"
    )


@pytest.mark.parametrize("anyio_backend", LOOPS_BUT_TRIO)
async def test_worker_threads_take_no_item_once_the_block_is_left_from_another_task(
    virtual_device: ais.Device, anyio_backend: object
) -> None:
    """The loader stops its producer there and then: a worker thread done with its item takes
    none of those queued behind it, even before the producer task runs again."""
    import threading
    import time

    gate, calls, returned = threading.Event(), [], []

    def transform(x: np.ndarray) -> np.ndarray:
        calls.append(x)
        if len(calls) > 1:  # the first is handed out; the workers then hold one each
            gate.wait(10)
        returned.append(x)
        return x

    agen = indices_from_a_loader(transform=transform)
    assert await agen.__anext__() == 0
    await until(
        lambda: len(calls) == 3, "both worker threads to hold an item at the gate (more queued)"
    )
    taken: list[int] = []

    def release_the_workers() -> None:
        gate.set()  # no checkpoint since the block was left: the producer task has not run
        until_blocking(lambda: len(returned) == 3, "the worker threads to finish their items")
        time.sleep(0.3)  # time the workers, done, would take to take the queued ones
        taken.append(len(calls))

    raised = await close_elsewhere(agen, then=release_the_workers)
    assert isinstance(raised, RuntimeError) and "from another task" in str(raised), raised
    assert taken == [3]
    await ais.current_stream().synchronize()
    del raised, agen  # the error's frames hold the loader
    await until_released(LEFT_BEHIND)
