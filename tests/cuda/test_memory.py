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
from tests.helpers.cuda import DEV, N, allocations, held, primary_context, ptr
from tests.helpers.faults import calls, failing
from tests.helpers.gate import gate, gated
from tests.helpers.protocol import backend, handle_of
from tests.helpers.stand_in import FAKE, PINNED, STREAMS

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


def users_read(stream: ais.Stream, address: int, nbytes: int) -> ais.HostBuffer:
    """Device work on ``stream`` that reads ``nbytes`` at ``address`` (device memory) when it
    runs, submitted by the user's own driver call, which aiostream does not see (as a user's
    kernel using a buffer): a copy into the pinned buffer returned, where the bytes land."""
    out = ais.HostBuffer(nbytes, device=DEV)
    with primary_context(stream.device_index) as cu:
        result = cu.cuMemcpyDtoHAsync(
            out.numpy().ctypes.data, cu.CUdeviceptr(address), nbytes, cu.CUstream(stream.stream_id)
        )
    assert result == (cu.CUresult.CUDA_SUCCESS,), result
    return out


def filled(value: int, stream: ais.Stream) -> ais.DeviceBuffer:
    """A device buffer of ``N`` bytes allocated on ``stream``, each byte ``value`` once the
    stream's work so far is done."""
    host = ais.HostBuffer(N, device=DEV)
    host.numpy()[:] = value
    with ais.use_stream(stream):
        buf = ais.DeviceBuffer(N, DEV)
    ais.copy_async(buf, host, stream=stream)
    return buf


def host_frees(seen: dict[str, list[Any]]) -> set[int]:
    """The pinned memory aiostream freed (``cuMemFreeHost``) with success, as a spy saw it."""
    return {int(args[0]) for args, result in seen["cuMemFreeHost"] if int(result[0]) == 0}


# ----------------------------------------------------------- host memory


def test_pinned_memory_dropped_in_another_thread_is_freed() -> None:
    kept = [ais.HostBuffer(N, device=DEV) for _ in range(3)]
    addresses = {buf.numpy().ctypes.data for buf in kept}
    gc.collect()
    pinned = FAKE.fake_cuda_live(PINNED) if FAKE is not None else 0

    def drop() -> None:
        kept.clear()
        gc.collect()

    with calls("cuMemFreeHost") as seen:
        t = threading.Thread(target=drop)
        t.start()
        t.join()
    assert addresses <= host_frees(seen), seen
    if FAKE is not None:
        assert FAKE.fake_cuda_live(PINNED) == pinned - 3


async def test_pinned_memory_is_freed_after_the_copies_that_use_it(anyio_backend: object) -> None:
    """A HostBuffer dropped while copies on a held stream will still read or write it is
    freed (``cuMemFreeHost``) only once they have completed, also when an allocation in
    between collects the frees that are due: no free while they are held, the copies move
    the right bytes, and the stand-in sees no free of memory that pending copies use."""
    s = ais.Stream(DEV)
    with ais.use_stream(s):
        dev = ais.DeviceBuffer(N, DEV)
    up, down = ais.HostBuffer(N, device=DEV), ais.HostBuffer(N, device=DEV)
    kept = ais.HostBuffer(N, device=DEV)
    up.numpy()[:] = 6
    dropped = {up.numpy().ctypes.data, down.numpy().ctypes.data}
    with calls("cuMemFreeHost") as seen:
        with gated(s):  # the copies run once the test lets them
            ais.copy_async(dev, up, stream=s)  # read from up, written to down: both dropped
            ais.copy_async(down, dev, stream=s)
            ais.copy_async(kept, dev, stream=s)
            view = kept.numpy()
            del up, down
            gc.collect()
            ais.HostBuffer(64, device=DEV)  # an allocation frees what is due, and only that
            assert not s.query()
            assert not dropped & host_frees(seen), seen
        await s.synchronize()
        assert (view == 6).all()
        gc.collect()
        ais.HostBuffer(64, device=DEV)  # what is due now is freed
        assert dropped <= host_frees(seen), seen


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
    with gated(t):  # the copies on t run once the test lets them
        ais.copy_async(written, up, stream=t)
        ais.copy_async(dev, up, stream=t)
        ais.copy_async(down, dev, stream=t)
        del dev, written
        gc.collect()
        assert not t.query()
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


def test_device_memory_is_freed_after_kernels_on_its_allocation_stream() -> None:
    """A buffer dropped while the user's work on its allocation stream (which aiostream does
    not see) still reads it is freed after that work: the work reads the buffer's bytes (the
    stand-in, strict, also counts a read of freed memory)."""
    s = ais.Stream(DEV)
    buf = filled(3, s)
    with gated(s):
        read = users_read(s, ptr(buf), N)  # the user's kernel reading it, held
        del buf
        gc.collect()
        ais.DeviceBuffer(N, DEV)  # an allocation frees what is due, and only that
    s.synchronize_blocking()  # the contract fixture checks that nothing read freed memory
    assert (read.numpy() == 3).all()


def test_device_memory_is_freed_after_kernels_on_recorded_streams() -> None:
    """A buffer the user's work on another stream reads (``record_stream``) is freed after
    that work, though aiostream never saw it: held, the work still reads the buffer's bytes
    once let go, and the free waits for it (the stand-in also counts a read of freed memory)."""
    s, t = ais.Stream(DEV), ais.Stream(DEV)
    buf = filled(4, s)
    s.synchronize_blocking()
    buf.record_stream(t)
    with gated(t):
        read = users_read(t, ptr(buf), N)  # the user's kernel on t, held
        del buf
        gc.collect()
        ais.DeviceBuffer(N, DEV)  # an allocation frees what is due, and only that
    t.synchronize_blocking()
    s.synchronize_blocking()
    assert (read.numpy() == 4).all()


@pytest.mark.parametrize("use", ["copy", "record_stream"])
def test_a_stream_ordered_allocation_is_ordered_before_its_first_use_elsewhere(use: str) -> None:
    """A buffer allocated on a held stream and used first on another (an aiostream copy, or
    the user's work after ``record_stream``): that use waits, on the device, for the
    allocation, so the other stream stays busy until the allocation's stream is let go."""
    s, t = ais.Stream(DEV), ais.Stream(DEV)
    host = ais.HostBuffer(N, device=DEV)
    reads = []  # kept until t is done: aiostream sees no use of them
    with gated(s):  # the allocation completes once the test lets it
        with ais.use_stream(s):
            buf = ais.DeviceBuffer(N, DEV)
        if use == "copy":
            ais.copy_async(buf, host, stream=t)
        else:
            buf.record_stream(t)
            reads.append(users_read(t, ptr(buf), N))
        time.sleep(0.05)  # t would be done by now, were it not waiting for s
        assert not t.query()
    t.synchronize_blocking()
    s.synchronize_blocking()


@pytest.mark.parametrize("shapes", ["same", "changing"])
async def test_loader_buffers_are_freed_after_the_consumers_kernels(
    anyio_backend: object, shapes: str
) -> None:
    """The loader frees its buffers at close and on a shape change: never before the kernels
    the consumer ran with them, and its copy stream never uses a buffer before its
    allocation: each of the consumer's reads (the user's work, unseen) finds its batch."""
    consumer = ais.Stream(DEV)
    ais.delay(0.02, stream=consumer)  # allocations on the consumer's stream complete late
    source = [np.full(64 + (i if shapes == "changing" else 0), i, np.float32) for i in range(6)]
    reads = []
    with ais.use_stream(consumer):
        async with ais.DataLoader(source, device=DEV, prefetch=2) as loader:
            async for batch in loader:
                ais.delay(0.005, stream=consumer)
                reads.append(users_read(consumer, ptr(batch.data), batch.data.nbytes))
    await consumer.synchronize()
    await anyio.sleep(0.01)
    for i, read in enumerate(reads):
        assert (read.numpy(np.float32) == i).all(), i


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
    kernel on them, on the consumer's stream (not the closing task's current stream): held,
    the kernel still reads its batch once let go."""
    reads: list[ais.HostBuffer] = []
    releases: list[Any] = []

    async def indices() -> Any:
        source = (np.full(1024, i, np.float32) for i in range(4))
        async with ais.DataLoader(source, device=DEV, prefetch=2) as loader:
            async for batch in loader:
                stream = ais.current_stream(DEV)
                releases.append(gate(stream))  # the consumer's kernel runs once let go
                reads.append(users_read(stream, ptr(batch.data), batch.data.nbytes))
                yield batch.index

    consumer = ais.Stream(DEV)
    agen = indices()
    with ais.use_stream(consumer):
        assert await agen.__anext__() == 0
    (release,) = releases
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
    try:
        gc.collect()  # the pass and its buffers are freed now, the kernel still held
        assert not consumer.query()
    finally:
        release()
    await consumer.synchronize()  # the stand-in counts a kernel reading freed memory
    assert (reads[0].numpy(np.float32) == 0).all()


def test_freeing_never_waits_on_the_host() -> None:
    """Dropping buffers whose streams have work pending returns at once: their frees are
    ordered on the device, or wait in a list for markers, never in a host wait (a wait for
    held work would never return: the stream is let go only after)."""
    s = ais.Stream(DEV)
    with gated(s):  # work that outlasts the test, were it waited for
        ais.delay(0.001, stream=s)
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


def test_a_dropped_stream_lives_until_the_last_buffer_that_used_it_is_freed() -> None:
    """A stream its owner dropped while buffers that it used are alive is destroyed once the
    last of them is freed (their frees record on it), not before, and not never."""
    s, t = ais.Stream(DEV), ais.Stream(DEV)
    ais.DeviceBuffer(N, DEV).record_stream(t)  # the device's free stream is made, if it uses one
    gc.collect()
    before = FAKE.fake_cuda_live(STREAMS) if FAKE is not None else 0
    handle = t.stream_id
    with ais.use_stream(s):
        first, second = ais.DeviceBuffer(N, DEV), ais.DeviceBuffer(N, DEV)
    for buf in (first, second):
        buf.record_stream(t)
    ais.delay(0.005, stream=t)
    with calls("cuStreamDestroy") as seen:

        def destroyed() -> int:  # how many times t was destroyed
            made = seen["cuStreamDestroy"]
            return sum(1 for args, res in made if int(args[0]) == handle and int(res[0]) == 0)

        del t, buf
        gc.collect()
        assert destroyed() == 0  # both buffers hold t
        if FAKE is not None:
            assert FAKE.fake_cuda_live(STREAMS) == before
        del first
        gc.collect()
        assert destroyed() == 0  # the second still does
        if FAKE is not None:
            assert FAKE.fake_cuda_live(STREAMS) == before
        del second
        gc.collect()
        assert destroyed() == 1  # the last hold gone: t destroyed
        if FAKE is not None:
            assert FAKE.fake_cuda_live(STREAMS) == before - 1
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


def test_a_device_without_memory_pools_allocates_with_cu_mem_alloc(
    own_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``cuMemAllocAsync`` answering CUDA_ERROR_NOT_SUPPORTED (a device or driver without
    stream-ordered memory): the buffer comes from ``cuMemAlloc``, the device is never asked
    again, and the debug log says so once."""
    s = ais.Stream(DEV)
    with caplog.at_level("DEBUG", logger="aiostream"), allocations() as asked:
        # the failure sits above the spy, which sees only the calls that reach the driver
        with failing("cuMemAllocAsync", code=801) as fault:  # CUDA_ERROR_NOT_SUPPORTED
            with ais.use_stream(s):
                first, second = ais.DeviceBuffer(N, DEV), ais.DeviceBuffer(N, DEV)
    assert fault.failed and fault.made == 1  # asked once: never again
    assert asked == {"cuMemAllocAsync": [], "cuMemAlloc": [(0, ptr(first)), (0, ptr(second))]}
    said = [r.getMessage() for r in caplog.records if "memory pools" in r.getMessage()]
    assert said == ["cuda:0 has no memory pools: using cuMemAlloc"]
    del first, second
    gc.collect()


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
