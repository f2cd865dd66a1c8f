"""The data loader's errors: a transform's, a source's, the device's and the block's own,
each raised as itself in its turn, after the batches before it and never masked by another;
and the misuses it refuses (bad arguments, workers outside ``async with``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import anyio
import numpy as np
import pytest

import aiostream as ais
from aiostream.testing import VirtualTime
from tests.helpers import virtual_loops
from tests.helpers.deadlines import deadline
from tests.helpers.loader import (
    EVERY_LOOP,
    MODES,
    Counted,
    arrays,
    consume,
    fetch,
)
from tests.helpers.waits import assert_quiet as quiet

anyio_backend = virtual_loops.anyio_backend  # the module's loops: asyncio and trio

pytestmark = pytest.mark.anyio


async def test_an_error_in_transform_stops_everything(virtual_time: VirtualTime) -> None:
    def transform(a: np.ndarray) -> np.ndarray:
        if a[0] == 3:
            raise RuntimeError("bad item 3")
        return a

    loader = ais.DataLoader(arrays(10), transform=transform)
    batches = aiter(loader)  # the pass 'async for' runs, kept to be asked again
    seen = []
    with pytest.raises(RuntimeError, match="bad item 3"):
        async for batch in batches:
            seen.append(batch.index)
    assert seen == [0, 1, 2]  # the batches before it, as inside 'async with'
    quiet()
    with pytest.raises(StopAsyncIteration):  # the pass the error stopped stays stopped
        await anext(batches)


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
        await consume(mode, source(), seen, transform=transform)
    assert seen == [0, 1, 2]
    quiet()


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
    with deadline(10, "the loader to close after the device failed"):
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
    with deadline(10, "the source's KeyboardInterrupt to reach the consumer"):
        with pytest.raises(KeyboardInterrupt):
            await consume(mode, source(), seen)
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
    with deadline(10, "the transform's KeyboardInterrupt to reach the consumer"):
        with pytest.raises(KeyboardInterrupt):
            await consume("threads", arrays(5), seen, transform=transform)
    assert seen == [0]


async def test_a_sync_transform_returning_an_awaitable_in_a_thread_is_refused(
    virtual_device: ais.Device,
) -> None:
    async def later(a: np.ndarray) -> np.ndarray:
        return a

    with pytest.raises(TypeError) as caught:
        async with ais.DataLoader(arrays(3), transform=lambda a: later(a), workers=2) as loader:
            async for _ in loader:
                pass
    message = str(caught.value)  # what went wrong, and the two ways out
    assert "returned an awaitable from a worker thread" in message
    assert "'async def'" in message and "to_thread=False" in message
    quiet()


async def test_items_must_be_arrays(virtual_time: VirtualTime) -> None:
    with pytest.raises(TypeError) as caught:
        async for _ in ais.DataLoader([[1, 2, 3]]):
            pass
    assert "numpy arrays" in str(caught.value) and str(caught.value).endswith("got list")
    with pytest.raises(TypeError) as caught:  # a tuple says what it holds
        async for _ in ais.DataLoader([(np.zeros(2), [1])]):
            pass
    assert str(caught.value).endswith("got tuple of ['ndarray', 'list']")
    quiet()


def test_a_batch_is_not_made_by_hand() -> None:
    with pytest.raises(TypeError) as caught:
        ais.Batch(0, None, None, None)  # type: ignore[arg-type]
    assert "made by aiostream.DataLoader" in str(caught.value)


def test_bad_input(virtual_device: ais.Device) -> None:
    with pytest.raises(TypeError, match="source must be an iterable"):
        ais.DataLoader(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="transform must be callable"):
        ais.DataLoader([], transform=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefetch must be >= 1"):
        ais.DataLoader([], prefetch=0)
    with pytest.raises(TypeError, match=r"prefetch must be an int or None, got 2\.0"):
        ais.DataLoader([], prefetch=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="to_thread must be True or False"):
        ais.DataLoader([], to_thread="yes")  # type: ignore[arg-type]


def test_bad_workers(virtual_device: ais.Device) -> None:
    with pytest.raises(TypeError, match="workers must be an int"):
        ais.DataLoader([], workers=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="workers must be an int"):
        ais.DataLoader([], workers=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="workers must be >= 1"):
        ais.DataLoader([], workers=0)
    with pytest.raises(ValueError) as caught:
        ais.DataLoader([], workers=3, prefetch=2)
    message = str(caught.value)  # both values, and what to do
    assert "prefetch (2) must be >= workers (3)" in message
    assert "raise prefetch or leave it None" in message
    assert ais.DataLoader([], workers=5).prefetch == 10
    assert ais.DataLoader([]).prefetch == 2


def says_to_open_it(message: str) -> None:
    """The refusal of workers outside 'async with': the workers asked, the block to write, and
    the one worker that needs none."""
    assert message.startswith("workers=2 ") and "async with DataLoader(" in message
    assert "workers=1" in message


def test_more_than_one_worker_needs_async_with(virtual_device: ais.Device) -> None:
    loader = ais.DataLoader(arrays(1), workers=2)
    with pytest.raises(RuntimeError) as caught:
        aiter(loader)
    says_to_open_it(str(caught.value))


async def test_workers_need_the_async_with_block(virtual_device: ais.Device) -> None:
    loader = ais.DataLoader(arrays(2), workers=2)
    with pytest.raises(RuntimeError) as info:
        async for _ in loader:
            pass
    says_to_open_it(str(info.value))
    async with loader:
        with pytest.raises(RuntimeError) as info:
            await loader.__aenter__()
        assert "already open in an 'async with' block" in str(info.value)
        assert "another DataLoader" in str(info.value)


@pytest.mark.parametrize("anyio_backend", EVERY_LOOP)
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("when", ["holding a batch", "taking a batch"])
@pytest.mark.parametrize(
    ("names", "who"),
    [
        (("first", "second"), "task 'second' asks for a batch of a DataLoader pass that task "
         "'first' is consuming"),
        (("worker", "worker"), "a task named 'worker' asks for a batch of a DataLoader pass "
         "that another task of that name is consuming"),
    ],
    ids=["named apart", "one name"],
)  # fmt: skip
async def test_a_second_task_taking_batches_from_one_pass_is_refused(
    virtual_device: ais.Device,
    anyio_backend: object,
    mode: str,
    when: str,
    names: tuple[str, str],
    who: str,
) -> None:
    """A batch is valid until its consumer asks for the next, so a second task asking for
    batches of the same pass (while the first holds one, or is taking one) is refused, saying
    what to do (and which task, told apart when both share a name); the first task's loop goes
    on unharmed, every batch read back as written."""
    gate = anyio.Event()  # the source's items 2 and 3 wait for the second task's attempt

    async def source() -> AsyncIterator[np.ndarray]:
        for i in range(4):
            if i == 2:
                await gate.wait()
            yield np.full(16, i, np.float32)

    read: list[float] = []
    refused: list[str] = []
    asking = anyio.Event()
    async with contextlib.AsyncExitStack() as stack:
        # a plain loop fills its prefetch inside each step: one, so that it waits at the gate
        # only when asked for batch 2
        prefetch = 1 if MODES[mode] is None else 2
        loader = ais.DataLoader(source(), **{"prefetch": prefetch, **(MODES[mode] or {})})
        if MODES[mode] is not None:
            await stack.enter_async_context(loader)
        it = aiter(loader)

        async def first() -> None:
            s = ais.Stream()
            with ais.use_stream(s):
                for n in range(4):
                    if n == 2:  # holding batch 1, or about to take batch 2 (held at the gate)
                        asking.set()
                        if when == "holding a batch":
                            await gate.wait()
                    batch = await it.__anext__()
                    read.append(float((await fetch(batch.data, s))[0]))

        async def second() -> None:
            await asking.wait()
            try:
                await it.__anext__()
            except RuntimeError as exc:
                refused.append(str(exc))
            gate.set()

        with deadline(10, "both tasks to be done"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(first, name=names[0])
                tg.start_soon(second, name=names[1])
        await it.aclose()  # the source, not taken to its end, is closed
    assert refused == [
        f"{who}: "
        "a batch is valid until its consumer asks for the next, so two consumers would reuse "
        "each other's buffers under their work. Iterate a pass in one task (hand work to "
        "others from there), or make a DataLoader per task"
    ]
    assert read == [0.0, 1.0, 2.0, 3.0]
