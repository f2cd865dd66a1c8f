"""The data loader's buffers and streams: copies that overlap the consumer's work, bounded
prefetch, slots reused only once the device is done with them (``record_stream`` for other
streams), made as needed and made again when an item's shape changes."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

import aiostream as ais
from aiostream.testing import VirtualTime
from tests.helpers import virtual_loops
from tests.helpers.loader import (
    Counted,
    arrays,
    fetch,
)
from tests.helpers.waits import assert_quiet as quiet

anyio_backend = virtual_loops.anyio_backend  # the module's loops: asyncio and trio

pytestmark = pytest.mark.anyio


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


async def test_record_stream_on_a_batch_given_back_is_refused(virtual_device: ais.Device) -> None:
    """A batch's buffers go back to the pool when the next batch is asked for: naming a
    stream then would protect nothing (the slot may hold the next item already)."""
    side = ais.Stream()
    async with ais.DataLoader(arrays(4, size=256), prefetch=1) as loader:
        batches = aiter(loader)
        first = await anext(batches)
        first.record_stream(side)  # held: accepted
        second = await anext(batches)
        with pytest.raises(RuntimeError, match="batch 0 was given back .* before asking"):
            first.record_stream(side)
        second.record_stream(side)
    with pytest.raises(RuntimeError, match="batch 1 was given back"):
        second.record_stream(side)  # the loader closed


def test_record_stream_refuses_a_stream_of_another_device() -> None:
    ais.virtual.reset(devices=2)

    async def main() -> None:
        async with ais.DataLoader(arrays(1)) as loader:
            async for batch in loader:
                with pytest.raises(ValueError) as caught:
                    batch.record_stream(ais.Stream("virtual:1"))
                message = str(caught.value)  # which is on which device
                assert "batch is on virtual:0" in message and "stream on virtual:1" in message

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
