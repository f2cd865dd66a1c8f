"""The CUDA backend's memory lifetimes: pinned and device memory is freed only once the work
of every stream that used it has completed (copies, the user's kernels on recorded streams,
the loader's consumers), never with a host wait; stream-ordered allocations come before
their first use elsewhere; devices without memory pools use ``cuMemAlloc``; only memory the
driver can share is shared.

Run where ``cuda:0`` works: on a GPU, and in CI's CUDA lane against the strict stand-in
driver, whose kernels that read memory (``touch``) and count of violations catch a use after
a free; tests that need its hooks skip on a GPU.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import anyio
import numpy as np
import pytest

import aiostream as ais
from tests.helpers.cuda import DEV, N, allocations, held, ptr
from tests.helpers.protocol import backend, handle_of
from tests.helpers.stand_in import FAKE, PINNED, STREAMS, hurry, needs_stand_in, touch

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


# ----------------------------------------------------------- host memory


@needs_stand_in
def test_pinned_memory_dropped_in_another_thread_is_freed() -> None:
    kept = [ais.HostBuffer(N, device=DEV) for _ in range(3)]
    pinned = FAKE.fake_cuda_live(PINNED)
    t = threading.Thread(target=lambda: (kept.clear(), gc.collect()))
    t.start()
    t.join()
    assert FAKE.fake_cuda_live(PINNED) == pinned - 3


@needs_stand_in
async def test_pinned_memory_is_freed_after_the_copies_that_use_it(anyio_backend: object) -> None:
    """A HostBuffer dropped while copies on a busy stream will still read or write it is freed
    (``cuMemFreeHost``) only once they have completed, also when an allocation in between
    collects the frees that are due: the copies move the right bytes, and the stand-in sees
    no free of memory that pending copies use."""
    s = ais.Stream(DEV)
    with ais.use_stream(s):
        dev = ais.DeviceBuffer(N, DEV)
    up, down = ais.HostBuffer(N, device=DEV), ais.HostBuffer(N, device=DEV)
    kept = ais.HostBuffer(N, device=DEV)
    up.numpy()[:] = 6
    ais.delay(3600.0, stream=s)  # the copies run after this, once the test ends it
    ais.copy_async(dev, up, stream=s)  # read from up, written to down: both dropped
    ais.copy_async(down, dev, stream=s)
    ais.copy_async(kept, dev, stream=s)
    view = kept.numpy()
    del up, down
    gc.collect()
    ais.HostBuffer(64, device=DEV)  # an allocation frees what is due, and only that
    assert not s.query()
    hurry()
    await s.synchronize()
    assert (view == 6).all()


@needs_stand_in
async def test_device_memory_is_freed_after_copies_on_other_streams(
    anyio_backend: object,
) -> None:
    """A DeviceBuffer that copies used on a stream other than its allocation stream is freed
    (``cuMemFreeAsync``) after them: the free is ordered after a marker on that stream."""
    s, t = ais.Stream(DEV), ais.Stream(DEV)
    with ais.use_stream(s):
        dev = ais.DeviceBuffer(N, DEV)
    up, down = ais.HostBuffer(N, device=DEV), ais.HostBuffer(N, device=DEV)
    with ais.use_stream(s):
        written = ais.DeviceBuffer(N, DEV)  # only written on t
    up.numpy()[:] = 8
    ais.delay(3600.0, stream=t)  # the copies on t run after this, once the test ends it
    ais.copy_async(written, up, stream=t)
    ais.copy_async(dev, up, stream=t)
    ais.copy_async(down, dev, stream=t)
    del dev, written
    gc.collect()
    assert not t.query()
    hurry()
    await t.synchronize()
    assert (down.numpy() == 8).all()
    await s.synchronize()


def test_a_host_view_keeps_its_buffer_alive() -> None:
    view = ais.HostBuffer(1 << 20, device=DEV).numpy(np.float32)
    gc.collect()
    view[:] = 1.0  # freed pinned memory is unmapped: this would crash the process
    assert view.sum() == 1 << 18
    if FAKE is not None:
        pinned = FAKE.fake_cuda_live(PINNED)
        del view
        gc.collect()
        assert FAKE.fake_cuda_live(PINNED) == pinned - 1


def test_host_memory_the_machine_cannot_hold_is_refused_by_its_device() -> None:
    """Pageable host memory for a CUDA device is the machine's: more than it has is refused
    with a DeviceError of that device, as pinned memory the driver cannot give is."""
    with pytest.raises(ais.DeviceError) as refused:
        ais.HostBuffer(1 << 62, pinned=False, device=DEV)
    assert refused.value.device == DEV
    assert str(refused.value) == (
        f"{DEV}: cannot allocate {1 << 62} bytes of host memory (the machine does not have it)"
    )


# --------------------------------------------------------- device memory


@needs_stand_in
def test_device_memory_is_freed_after_kernels_on_its_allocation_stream() -> None:
    s = ais.Stream(DEV)
    with ais.use_stream(s):
        buf = ais.DeviceBuffer(N, DEV)
    touch(s, ptr(buf), N, seconds=0.03)  # the user's kernel reading it, after the copies
    del buf
    gc.collect()
    s.synchronize_blocking()  # the contract fixture checks that nothing read freed memory


@needs_stand_in
def test_device_memory_is_freed_after_kernels_on_recorded_streams() -> None:
    s, t = ais.Stream(DEV), ais.Stream(DEV)
    with ais.use_stream(s):
        buf = ais.DeviceBuffer(N, DEV)
    buf.record_stream(t)
    ais.delay(0.03, stream=t)
    touch(t, ptr(buf), N)
    del buf
    gc.collect()
    t.synchronize_blocking()


@needs_stand_in
def test_a_stream_ordered_allocation_is_ordered_before_its_first_use_elsewhere() -> None:
    s, t = ais.Stream(DEV), ais.Stream(DEV)
    host = ais.HostBuffer(N, device=DEV)
    ais.delay(0.03, stream=s)  # the allocation completes after this
    with ais.use_stream(s):
        for use in ("copy", "record_stream"):
            buf = ais.DeviceBuffer(N, DEV)
            if use == "copy":
                ais.copy_async(buf, host, stream=t)
            else:
                buf.record_stream(t)
                touch(t, ptr(buf), N)
    t.synchronize_blocking()
    s.synchronize_blocking()


@needs_stand_in
@pytest.mark.parametrize("shapes", ["same", "changing"])
async def test_loader_buffers_are_freed_after_the_consumers_kernels(
    anyio_backend: object, shapes: str
) -> None:
    """The loader frees its buffers at close and on a shape change: never before the kernels
    the consumer ran with them, and its copy stream never uses a buffer before its
    allocation."""
    consumer = ais.Stream(DEV)
    ais.delay(0.02, stream=consumer)  # allocations on the consumer's stream complete late
    source = [np.full(64 + (i if shapes == "changing" else 0), i, np.float32) for i in range(6)]
    with ais.use_stream(consumer):
        async with ais.DataLoader(source, device=DEV, prefetch=2) as loader:
            async for batch in loader:
                ais.delay(0.005, stream=consumer)
                touch(consumer, ptr(batch.data), batch.data.nbytes)
    await consumer.synchronize()
    await anyio.sleep(0.01)


@needs_stand_in
@pytest.mark.parametrize(
    "anyio_backend",  # trio itself refuses a nursery left open in a suspended generator
    [
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ],
)
async def test_a_loader_left_from_another_task_frees_no_batch_still_in_use(
    anyio_backend: object,
) -> None:
    """An async generator holding a loader's block, closed by another task (the loop's
    finalizer, when the generator was not closed where it ran), stops the loader and raises
    (the message says what to write): the batch the consumer held goes back to the pool
    first, so once the dropped pass is collected, its buffers are freed after the consumer's
    kernel on them, on the consumer's stream (not the closing task's current stream)."""

    async def indices() -> Any:
        source = (np.full(1024, i, np.float32) for i in range(4))
        async with ais.DataLoader(source, device=DEV, prefetch=2) as loader:
            async for batch in loader:
                touch(ais.current_stream(DEV), ptr(batch.data), batch.data.nbytes, 0.3)
                yield batch.index

    consumer = ais.Stream(DEV)
    agen = indices()
    with ais.use_stream(consumer):
        assert await agen.__anext__() == 0
    raised: list[BaseException] = []

    async def close(gen: Any, into: list[BaseException]) -> None:
        try:  # in a task of its own, whose current stream is the default
            await gen.aclose()
        except RuntimeError as exc:
            into.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(close, agen, raised)
    assert len(raised) == 1 and "from another task" in str(raised[0]), raised
    del agen, raised  # the traceback held the generator's frame, and the pass with it
    gc.collect()  # the pass and its buffers are freed now, the kernel still running
    await consumer.synchronize()  # the stand-in counts a kernel reading freed memory


@needs_stand_in
def test_freeing_never_waits_on_the_host() -> None:
    """Dropping buffers whose streams have work pending returns at once: their frees are
    ordered on the device, or wait in a list for markers, never in a host wait."""
    s = ais.Stream(DEV)
    ais.delay(20.0, stream=s)  # work that outlasts the test, were it waited for
    with ais.use_stream(s):
        dev = ais.DeviceBuffer(N, DEV)
    host = ais.HostBuffer(N, device=DEV)
    ais.copy_async(dev, host, stream=s)
    ais.copy_async(host, dev, stream=s)
    start = time.monotonic()
    del dev, host
    gc.collect()
    ais.HostBuffer(64, device=DEV)  # collects the frees that are due: none is
    assert time.monotonic() - start < 10.0
    assert not s.query()
    hurry()
    s.synchronize_blocking()


# ------------------------------------------------ streams held by memory


def test_memory_of_another_library_whose_release_fails_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A free never raises: a failing release of imported memory is logged, word for word."""

    def release() -> None:
        raise RuntimeError("its owner is gone")

    cuda: Any = backend("cuda")
    mem = cuda.memory_wrap(0, 4096, 64, release)
    with caplog.at_level("WARNING", logger="aiostream"):
        cuda.device_free(mem)
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert said == [
        "releasing memory of another library failed: RuntimeError('its owner is gone')"
    ], said


@needs_stand_in
def test_a_dropped_stream_lives_until_the_last_buffer_that_used_it_is_freed() -> None:
    """A stream its owner dropped while buffers that it used are alive is destroyed once the
    last of them is freed (their frees record on it), not before, and not never."""
    s, t = ais.Stream(DEV), ais.Stream(DEV)
    ais.DeviceBuffer(N, DEV).record_stream(t)  # the device's free stream is made, if it uses one
    gc.collect()
    before = FAKE.fake_cuda_live(STREAMS)
    with ais.use_stream(s):
        first, second = ais.DeviceBuffer(N, DEV), ais.DeviceBuffer(N, DEV)
    for buf in (first, second):
        buf.record_stream(t)
    ais.delay(0.005, stream=t)
    del t, buf
    gc.collect()
    assert FAKE.fake_cuda_live(STREAMS) == before  # both buffers hold t
    del first
    gc.collect()
    assert FAKE.fake_cuda_live(STREAMS) == before  # the second still does
    del second
    gc.collect()
    assert FAKE.fake_cuda_live(STREAMS) == before - 1  # the last hold gone: t destroyed
    s.synchronize_blocking()


def test_frees_after_several_streams_go_through_one_internal_stream() -> None:
    """Stream-ordered device memory used on two streams is freed on the device's own free
    stream, made once, which the backend counts among what it holds (``held()``) and
    releases at close as a stream."""
    s, t = ais.Stream(DEV), ais.Stream(DEV)
    with allocations() as asked:
        for _ in range(3):
            with ais.use_stream(s):
                buf = ais.DeviceBuffer(N, DEV)
            buf.record_stream(t)
            ais.delay(0.002, stream=t)
            del buf
            gc.collect()
    pools = any(code == 0 for code, _ in asked["cuMemAllocAsync"])  # stream-ordered memory
    assert held(0)["streams"] == (1 if pools else 0)
    t.synchronize_blocking()


# ---------------------------------------------- memory pools and sharing


@needs_stand_in
@pytest.mark.parametrize("answer", ["no pools", "no answer"])
def test_a_device_that_does_not_say_it_has_memory_pools_never_asks_for_them(
    own_backend: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, answer: str
) -> None:
    """Stream-ordered memory is used only where the device says it has memory pools
    (CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED is 1): where it says 0, or the query fails
    (whatever value comes with the failure), buffers come from ``cuMemAlloc`` from the first,
    and ``cuMemAllocAsync`` is never tried."""
    from cuda.bindings import driver

    code = driver.CUresult.CUDA_SUCCESS if answer == "no pools" else driver.CUresult(1)
    value = 0 if answer == "no pools" else 1
    monkeypatch.setattr(driver, "cuDeviceGetAttribute", lambda attribute, dev: (code, value))
    with caplog.at_level("DEBUG", logger="aiostream"), allocations() as asked:
        buf = ais.DeviceBuffer(N, DEV)
    assert asked == {"cuMemAllocAsync": [], "cuMemAlloc": [(0, ptr(buf))]}
    assert not [r for r in caplog.records if "memory pools" in r.getMessage()]
    del buf
    gc.collect()


@needs_stand_in
def test_a_device_without_memory_pools_allocates_with_cu_mem_alloc(
    own_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``cuMemAllocAsync`` answering CUDA_ERROR_NOT_SUPPORTED (a device or driver without
    stream-ordered memory): the buffer comes from ``cuMemAlloc``, the device is never asked
    again, and the debug log says so once."""
    s = ais.Stream(DEV)
    assert FAKE.fake_cuda_fail_call(b"cuMemAllocAsync", 1, 801)  # CUDA_ERROR_NOT_SUPPORTED
    try:
        with caplog.at_level("DEBUG", logger="aiostream"), allocations() as asked:
            with ais.use_stream(s):
                first, second = ais.DeviceBuffer(N, DEV), ais.DeviceBuffer(N, DEV)
    finally:
        FAKE.fake_cuda_clear_error()
    assert asked == {
        "cuMemAllocAsync": [(801, 0)],  # asked once: never again
        "cuMemAlloc": [(0, ptr(first)), (0, ptr(second))],
    }
    said = [r.getMessage() for r in caplog.records if "memory pools" in r.getMessage()]
    assert said == ["cuda:0 has no memory pools: using cuMemAlloc"]
    del first, second
    gc.collect()


@needs_stand_in
def test_the_backend_shares_only_memory_the_driver_can_share(own_backend: Any) -> None:
    """``DeviceBuffer.ipc_handle`` refuses a buffer made without ``interprocess=True`` before
    it reaches the backend; the backend keeps the driver's rule too (``cuIpcGetMemHandle``
    takes memory of ``cuMemAlloc`` only): stream-ordered memory is refused with what to do,
    and memory of ``cuMemAlloc`` gets this process's id and the driver's 64-byte handle."""
    with allocations() as asked:
        pooled = ais.DeviceBuffer(N, DEV)
    assert asked["cuMemAllocAsync"] == [(0, ptr(pooled))]  # stream-ordered memory
    with pytest.raises(ValueError) as info:
        own_backend.memory_ipc_handle(handle_of(pooled))
    assert str(info.value) == (
        "this memory cannot be shared with other processes: the driver shares memory of "
        "cuMemAlloc only; create the buffer with DeviceBuffer(nbytes, device, interprocess=True)"
    )
    plain = ais.DeviceBuffer(N, DEV, interprocess=True)
    handle = own_backend.memory_ipc_handle(handle_of(plain))
    assert len(handle) == 4 + 64 and int.from_bytes(handle[:4], "little") == os.getpid()
    del pooled, plain
    gc.collect()
