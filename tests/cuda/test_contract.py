"""The CUDA backend keeps the driver's documented contract: contexts, memory lifetimes, stream
order, faults and exit.

Run where ``cuda:0`` works: on a GPU, and against the strict stand-in driver, which
``test_fake_driver.py`` runs this file on (with one and two devices). The stand-in counts every
breach of the contract it sees, and the process fails at exit on any; tests that need its hooks
(a kernel that reads memory, fault injection) skip on a GPU. Tests of what happens at exit run
a program of their own in a subprocess.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import aiostream as ais
from aiostream import _backends
from tests.helpers.process import run_python
from tests.helpers.stand_in import (
    EVENTS,
    FAKE,
    MODULES,
    PINNED,
    STREAMS,
    hurry,
    keeping_the_contract,
    needs_stand_in,
    touch,
)

pytestmark = pytest.mark.cuda

DEV = "cuda:0"
N = 4096


@pytest.fixture(autouse=True)
def contract() -> Iterator[None]:
    """Each test starts with no violation counted, and must end with none."""
    with keeping_the_contract():
        yield
        ais.set_wait_strategy(None)


def two_devices() -> None:
    if ais.device_count("cuda") < 2:
        pytest.skip("needs two CUDA devices")


def ptr(buf: ais.DeviceBuffer) -> int:
    return int(buf.__cuda_array_interface__["data"][0])


def current_context() -> int:
    from cuda.bindings import driver

    err, ctx = driver.cuCtxGetCurrent()
    assert int(err) == 0
    return int(ctx)


@contextlib.contextmanager
def primary_context(index: int = 0) -> Iterator[Any]:
    """Device ``index``'s primary context, retained and made current for the block (a user's
    own driver calls); the bindings' module is what the block gets."""
    from cuda.bindings import driver as cu

    device = cu.cuDeviceGet(index)[1]
    ctx = cu.cuDevicePrimaryCtxRetain(device)[1]
    assert cu.cuCtxPushCurrent(ctx) == (cu.CUresult.CUDA_SUCCESS,)
    try:
        yield cu
    finally:
        cu.cuCtxPopCurrent()
        cu.cuDevicePrimaryCtxRelease(device)


# ---------------------------------------------------------------------- 1, 2: contexts


def test_work_runs_from_a_thread_that_never_had_a_context() -> None:
    """No default stream touched, from a fresh thread: every call makes its context current."""
    failures: list[BaseException] = []

    def work() -> None:
        try:
            s = ais.Stream(DEV)
            up = ais.HostBuffer(N, device=DEV)
            down = ais.HostBuffer(N, device=DEV)
            up.numpy()[:] = 3
            with ais.use_stream(s):
                dev = ais.DeviceBuffer(N, DEV)
            ais.copy_async(dev, up, stream=s)
            ais.delay(0.005, stream=s)
            ais.copy_async(down, dev, stream=s)
            e = s.record_event(ais.Event(DEV, enable_timing=True))
            assert not e.query()
            other = ais.Stream(DEV)
            other.wait_event(e)

            async def awaits() -> None:
                for strategy in ais._waiting.STRATEGIES:
                    ais.delay(0.002, stream=other)
                    await other.record_event().synchronize(strategy=strategy)
                await e.synchronize()

            anyio.run(awaits)
            e.synchronize_blocking()
            assert (down.numpy() == 3).all()
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not failures, failures[0]


def _battery() -> list[tuple[str, Callable[[], object]]]:
    """Every public call that reaches the driver, in an order that lets each work."""
    state: dict[str, Any] = {}

    def setup() -> None:
        state["s"] = ais.Stream(DEV, priority=-1)
        state["e"] = ais.Event(DEV, enable_timing=True)
        state["h"] = ais.HostBuffer(N, device=DEV)

    def buffers() -> None:
        with ais.use_stream(state["s"]):
            state["d"] = ais.DeviceBuffer(N, DEV)
        state["d2"] = ais.DeviceBuffer(N, DEV)  # on the current (default) stream

    def copies() -> None:
        ais.copy_async(state["d"], state["h"], stream=state["s"])
        ais.copy_async(state["h"], state["d"])  # the current (default) stream

    def events() -> None:
        ais.delay(0.001, stream=state["s"])
        state["e"].record(state["s"])
        state["s"].wait_event(state["e"])
        ais.default_stream(DEV).wait_stream(state["s"])
        state["e"].query()
        state["s"].query()
        ais.default_stream(DEV).query()

    async def awaits() -> None:
        for strategy in ais._waiting.STRATEGIES:
            ais.delay(0.002, stream=state["s"])
            await state["s"].synchronize(strategy=strategy)
            assert current_context() == before
        await state["e"].synchronize()
        await ais.default_stream(DEV).synchronize()

    def timing() -> None:
        start = ais.Event(DEV, enable_timing=True)
        start.record(state["s"])
        state["e"].record(state["s"])
        state["e"].synchronize_blocking()
        start.elapsed_time(state["e"])

    def interop() -> None:
        ext = ais.as_stream(state["s"].stream_id, DEV)
        ais.as_event(state["e"].event_id, DEV).query()
        ais.delay(0.0, stream=ext)
        ipc = ais.Event(DEV, interprocess=True)
        ipc.record(state["s"])
        handle = ipc.ipc_handle()
        if FAKE is not None:  # a GPU opens it in another process only
            ais.Event.from_ipc_handle(DEV, handle).query()

    async def loader() -> None:
        source = [np.full(64, i, np.float32) for i in range(4)]
        async with ais.DataLoader(source, device=DEV, prefetch=2) as batches:
            async for _ in batches:
                ais.delay(0.0005)
        await ais.current_stream(DEV).synchronize()

    def drop() -> None:
        state["d"].record_stream(ais.default_stream(DEV))
        state.clear()
        gc.collect()  # finalizers: buffers, events, streams released on this thread

    before = current_context()
    return [
        ("Stream, Event, HostBuffer", setup),
        ("DeviceBuffer", buffers),
        ("copy_async", copies),
        ("record, wait_event, wait_stream, query", events),
        ("synchronize, every strategy", lambda: anyio.run(awaits)),
        ("elapsed_time, synchronize_blocking", timing),
        ("as_stream, as_event, IPC", interop),
        ("DataLoader", lambda: anyio.run(loader)),
        ("record_stream, collection of everything", drop),
    ]


def test_the_callers_current_context_is_left_as_it_was() -> None:
    """PyTorch and CuPy read their current device from the thread's current context: after any
    aiostream call on cuda:0 it is what it was (another device's context, or none)."""
    from cuda.bindings import driver

    other = None
    if ais.device_count("cuda") > 1:
        other = driver.cuDevicePrimaryCtxRetain(driver.cuDeviceGet(1)[1])[1]
    assert int(driver.cuCtxSetCurrent(other)[0]) == 0
    try:
        before = current_context()
        assert before == (int(other) if other is not None else 0)
        for what, call in _battery():
            call()
            assert current_context() == before, f"{what} changed the current context"
    finally:
        driver.cuCtxSetCurrent(None)
        if other is not None:
            driver.cuDevicePrimaryCtxRelease(driver.cuDeviceGet(1)[1])


# ---------------------------------------------------------------------- 3, 4: host memory


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


# ---------------------------------------------------------------------- 5, 6: device memory


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


def test_markers_of_frees_go_back_to_a_bounded_pool() -> None:
    """Each free records a marker on every stream that used the memory; once those complete
    the device keeps a few for reuse and destroys the rest: 200 buffers each used on 10
    streams, all freed with their work pending, leave at most ``MARKER_POOL`` idle markers
    (``FAKE_CUDA_NO_POOLS`` runs it where the frees wait on the host for their markers)."""
    from aiostream._backends.cuda.devices import MARKER_POOL

    backend = _backends.get("cuda")
    streams = [ais.Stream(DEV) for _ in range(10)]
    before = backend.held(0)["events"]  # type: ignore[attr-defined]
    bufs = [ais.DeviceBuffer(N, DEV) for _ in range(200)]
    for s in streams:
        ais.delay(0.02, stream=s)
        for buf in bufs:
            buf.record_stream(s)
    del buf, bufs
    gc.collect()
    for s in streams:
        s.synchronize_blocking()
    ais.DeviceBuffer(N, DEV)  # a free or an allocation collects the completed ones
    gc.collect()
    after = backend.held(0)["events"]  # type: ignore[attr-defined]
    assert after <= before + MARKER_POOL + 1, (before, after)


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


# ---------------------------------------------------------------------- 7, 8: across devices


async def test_a_host_buffer_of_one_device_serves_copies_on_another(anyio_backend: object) -> None:
    two_devices()
    up = ais.HostBuffer(N, device="cuda:0")
    down = ais.HostBuffer(N, device="cuda:0")
    up.numpy()[:] = 7
    s1 = ais.Stream("cuda:1")
    with ais.use_stream(s1):
        dev = ais.DeviceBuffer(N, "cuda:1")
    ais.copy_async(dev, up, stream=s1)
    ais.copy_async(down, dev, stream=s1)
    await s1.synchronize()
    assert (down.numpy() == 7).all()


async def test_the_default_streams_of_two_devices_are_told_apart(anyio_backend: object) -> None:
    two_devices()
    host = ais.HostBuffer(N, device="cuda:0")
    host.numpy()[:] = 5
    on = [ais.DeviceBuffer(N, f"cuda:{i}") for i in (0, 1)]  # on each default stream
    for i, dev in enumerate(on):
        ais.delay(0.01, stream=ais.default_stream(f"cuda:{i}"))
        ais.copy_async(dev, host)  # one host buffer, both devices' default streams
    del host
    gc.collect()  # freed after both copies, however they are keyed
    for i in (0, 1):
        await ais.default_stream(f"cuda:{i}").synchronize()
    backend = _backends.get("cuda")
    keys = {backend.stream_default(i).key for i in (0, 1)}  # type: ignore[attr-defined]
    assert len(keys) == 2


@pytest.mark.parametrize("strategy", ["hybrid", "callback"])
async def test_the_default_stream_is_submitted_to_by_others_unseen(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, strategy: str, own_backend: Any
) -> None:
    """The default stream (handle 0) is every library's, never aiostream's alone, even before
    its handle was handed out (a backend of the test's own: no earlier test handed it out):
    after an announced wait on it, work another library puts there unseen keeps it busy until
    the driver says it is done (not "idle because its last work was our host function")."""
    monkeypatch.setattr(ais._waiting, "HYBRID_HANDOFF_S", 0.0)
    d = ais.default_stream(DEV)
    ais.delay(0.001, stream=d)
    with anyio.fail_after(5):
        await d.synchronize(strategy=strategy)
    elsewhere = ais.Stream(DEV)
    ais.delay(0.2, stream=elsewhere)
    gate = elsewhere.record_event()
    with primary_context(0) as cu:  # another library's wait on the default stream
        result = cu.cuStreamWaitEvent(cu.CUstream(0), cu.CUevent(gate.event_id), 0)
    assert result == (cu.CUresult.CUDA_SUCCESS,)
    assert not d.query()
    with anyio.fail_after(5):
        await d.synchronize()
    assert d.query() and gate.query()
    device_finishes()  # the announced wait's mark lands before the close


# ---------------------------------------------------------------------- every result checked


def _submissions() -> dict[str, Callable[[dict[str, Any]], object]]:
    """Public calls, each making the driver call its name starts with (first, if more)."""

    def marked_alloc(o: dict[str, Any]) -> object:
        with ais.use_stream(o["s"]):  # recorded after the allocation: its marker
            return ais.DeviceBuffer(N, DEV)

    def busy_wait(o: dict[str, Any]) -> object:
        ais.delay(0.01, stream=o["s"])
        return o["s"].synchronize_blocking()

    def timing(o: dict[str, Any]) -> object:
        o["t0"].record(o["s"])
        o["t1"].record(o["s"])
        o["t1"].synchronize_blocking()
        return o["t0"].elapsed_time(o["t1"])

    def opened(o: dict[str, Any]) -> object:
        from aiostream._backends.cuda import CudaBackend

        backend = CudaBackend()  # opens its devices on first use
        try:
            return backend.priority_range(0)
        finally:
            backend.close()

    def marker_capture(o: dict[str, Any]) -> object:
        watcher = _backends.get("cuda")._devices.get(0).watcher  # type: ignore[attr-defined]
        watcher.memops = False  # a driver without stream memory operations: marker events
        try:
            return busy_wait(o)
        finally:
            watcher.memops = True

    def used_elsewhere_early(o: dict[str, Any]) -> object:
        ais.delay(0.05, stream=o["s"])
        with ais.use_stream(o["s"]):  # its allocation is ordered after the kernel
            buf = ais.DeviceBuffer(N, DEV)
        other = ais.Stream(DEV)  # waits for the allocation's marker before it uses the buffer
        return ais.copy_async(o["h"], buf, stream=other)

    def consumer_ordered(o: dict[str, Any]) -> object:
        consumer = ais.Stream(DEV)  # ordered after the buffer's users, on the device
        return o["d"].__dlpack__(stream=consumer.stream_id, max_version=(1, 0))

    def shared_opened(o: dict[str, Any]) -> object:
        import struct

        from aiostream.buffers import _IPC_HEADER

        handle = bytearray(o["shared"].ipc_handle())
        at = struct.calcsize(_IPC_HEADER)  # the memory's part starts with the exporter's pid
        handle[at : at + 4] = (os.getpid() + 1).to_bytes(4, "little")  # another process's
        return ais.DeviceBuffer.from_ipc_handle(DEV, bytes(handle))

    from aiostream.__main__ import info

    return {
        "cuStreamCreateWithPriority": lambda o: ais.Stream(DEV, priority=-1),
        "cuEventCreate": lambda o: ais.Event(DEV).record(o["s"]),
        "cuEventRecord": lambda o: o["e"].record(o["s"]),
        "cuEventRecord (the marker of a stream-ordered allocation)": marked_alloc,
        "cuEventQuery": lambda o: o["e"].query(),
        "cuStreamQuery": lambda o: o["s"].query(),
        "cuStreamWaitEvent": lambda o: o["s"].wait_event(o["e"]),
        "cuLaunchKernel": lambda o: ais.delay(0.001, stream=o["s"]),
        "cuMemHostAlloc": lambda o: ais.HostBuffer(N, device=DEV),
        "cuMemAllocAsync": lambda o: ais.DeviceBuffer(N, DEV),
        "cuMemAlloc (a buffer to share)": lambda o: ais.DeviceBuffer(N, DEV, interprocess=True),
        "cuStreamWaitEvent (a buffer used on another stream before its allocation completed)": (
            used_elsewhere_early
        ),
        "cuStreamWaitEvent (a DLPack consumer's stream)": consumer_ordered,
        "cuIpcOpenEventHandle (opening a shared buffer)": shared_opened,
        "cuMemcpyHtoDAsync": lambda o: ais.copy_async(o["d"], o["h"], stream=o["s"]),
        "cuMemcpyDtoHAsync": lambda o: ais.copy_async(o["h"], o["d"], stream=o["s"]),
        "cuMemcpyDtoDAsync": lambda o: ais.copy_async(o["d2"], o["d"], stream=o["s"]),
        "cuStreamWriteValue32 (a stream's capture)": busy_wait,
        "cuEventElapsedTime": timing,
        "cuStreamGetPriority": lambda o: ais.ExternalStream(o["s"].stream_id, DEV),
        "cuIpcGetEventHandle": lambda o: o["ipc"].ipc_handle(),
        "cuIpcOpenEventHandle": lambda o: ais.Event.from_ipc_handle(DEV, o["ipc_handle"]),
        "cuCtxPushCurrent": lambda o: o["s"].query(),
        "cuDeviceGetName (python -m aiostream info)": lambda o: info(),
        "cuDeviceGet (python -m aiostream info)": lambda o: info(),
        "cuDeviceGet (a backend opening its device)": opened,
        "cuEventRecord (a stream's capture, without stream memory operations)": marker_capture,
        "cuIpcGetMemHandle": lambda o: ais.DeviceBuffer(N, DEV, interprocess=True).ipc_handle(),
    }


@needs_stand_in
@pytest.mark.parametrize("what", list(_submissions()))
def test_every_driver_result_is_checked(what: str) -> None:
    """A driver call that fails raises a CudaError naming the call and its code, where the call
    was made, and leaves the device usable (the failure was not a sticky one)."""
    s = ais.Stream(DEV)
    with ais.use_stream(s):
        objects = {
            "s": s,
            "e": s.record_event(),
            "h": ais.HostBuffer(N, device=DEV),
            "d": ais.DeviceBuffer(N, DEV),
            "d2": ais.DeviceBuffer(N, DEV),
            "ipc": ais.Event(DEV, interprocess=True),
            "shared": ais.DeviceBuffer(N, DEV, interprocess=True),
            "t0": ais.Event(DEV, enable_timing=True),
            "t1": ais.Event(DEV, enable_timing=True),
        }
    objects["ipc"].record(s)
    objects["ipc_handle"] = objects["ipc"].ipc_handle()
    s.synchronize_blocking()
    gc.collect()  # no finalizer makes a driver call of its own meanwhile
    call = what.split(" ", 1)[0]
    assert FAKE.fake_cuda_fail_call(call.encode(), 1, 999)
    try:
        with pytest.raises(ais.CudaError) as info:
            _submissions()[what](objects)
    finally:
        FAKE.fake_cuda_clear_error()
    assert info.value.code == 999 and info.value.name == "CUDA_ERROR_UNKNOWN", info.value
    assert f"{call} failed on {DEV}" in str(info.value)
    ais.delay(0.001, stream=s)  # and the device works on
    s.synchronize_blocking()
    assert s.query()


# ---------------------------------------------------------------------- a backend of the test's own


@pytest.fixture
def own_backend() -> Iterator[Any]:
    """A CUDA backend of the test's own, installed for the test (objects made meanwhile use
    it) and closed after it, as the process's exit closes the shared one."""
    from aiostream._backends.cuda import CudaBackend

    ais.Stream(DEV)  # the shared backend holds the context: the test's close never resets it
    # what earlier tests dropped is released now, not during the test: their work ends (on
    # the stand-in) and is over, an allocation frees the memory that waited for it (and the
    # streams that waited for their memory), and a sweep gives back idle flag memory
    hurry()
    with primary_context() as cu:
        cu.cuCtxSynchronize()
    gc.collect()
    ais.DeviceBuffer(1, DEV)
    _backends.get("cuda").held(0)
    backend = CudaBackend()
    old = _backends.replace("cuda", backend)
    try:
        yield backend
    finally:
        _backends.restore("cuda", old)
        backend.close()


def live() -> list[int]:
    """The stand-in's count of each kind of live handle (streams, events, contexts, ...)."""
    return [FAKE.fake_cuda_live(kind) for kind in range(6)]


def context_refs() -> list[int]:
    """The stand-in's count of references to the primary contexts of cuda:0 and cuda:1."""
    return [FAKE.fake_cuda_context_refs(index) for index in (0, 1)]


def device_finishes() -> None:
    """Wait until cuda:0 has finished all its work, as a program's last synchronize does."""
    with primary_context() as cu:
        assert cu.cuCtxSynchronize() == (cu.CUresult.CUDA_SUCCESS,)


async def test_a_slot_left_draining_while_the_watcher_sleeps_is_freed_once_it_lands(
    anyio_backend: object, own_backend: Any
) -> None:
    """An event dropped before its work ends leaves its mark's slot draining. The watcher,
    asleep until posted (nothing watched, no slot in use when it went to sleep), is posted,
    and looks every ``DRAIN_S`` until the value lands: the slot is then free, though nothing
    else wakes it. The first slot of a backend's flag memory is slot 0 (a slot freed is the
    next taken), so this holds for it."""
    from aiostream._backends.cuda.watcher import DRAIN_S

    watcher = own_backend._devices.get(0).watcher
    s = ais.Stream(DEV)
    ais.delay(0.01, stream=s)
    await s.record_event().synchronize(strategy="thread")  # the watcher runs; slot 0 is free
    gc.collect()
    assert watcher.thread is not None
    if not watcher.memops:
        pytest.skip("this device writes no values (its marks are marker events): no slots")

    def used() -> int:
        with watcher.lock:  # read only: held() would sweep the flags itself
            return int(watcher.flags.used())

    with anyio.fail_after(5):  # asleep for good: no post of the wait's left to wake it
        while used() or watcher.sleeping_until != float("inf"):
            await anyio.sleep(0.001)
        await anyio.sleep(0.05)
        assert watcher.sleeping_until == float("inf")
    t = ais.Stream(DEV)  # waited on by nobody: a record on it launches no host function
    ais.delay(3600.0 if FAKE is not None else 0.2, stream=t)
    e = t.record_event()  # held by the record only: nothing watched, nothing posted
    assert watcher.sleeping_until == float("inf")
    slot = e._handle.mark.slot
    assert slot == 0 and used() == 1
    del e
    gc.collect()  # the record's hold goes before the value landed: the slot drains
    assert used() == 1
    hurry()  # the kernel ends now (on a GPU, in its time)
    with anyio.fail_after(4 * DRAIN_S + (0.0 if FAKE is not None else 0.2)):
        while used():
            await anyio.sleep(0.005)


@needs_stand_in
async def test_close_releases_every_handle_the_backend_made(
    anyio_backend: object, own_backend: Any
) -> None:
    """What runs at exit releases every stream and event (opened from an IPC handle too),
    even those the program still holds, and the buffers, internal stream, markers, flag memory
    and module: the driver's counts are back where they were, and a second close does nothing.
    (A buffer still held at close is freed after markers recorded then, which close never
    waits for: on a loaded machine it may be left to the exit, so the test drops it first.)"""
    before = live()
    s, t = ais.Stream(DEV), ais.Stream(DEV)
    ipc = ais.Event(DEV, interprocess=True)
    ipc.record(s)
    opened = ais.Event.from_ipc_handle(DEV, ipc.ipc_handle())
    host = ais.HostBuffer(N, device=DEV)
    with ais.use_stream(s):
        shared = ais.DeviceBuffer(N, DEV)
    ais.copy_async(shared, host, stream=t)  # used on two streams: freed on an internal one
    ais.delay(0.001, stream=s)  # the module of the sleep kernel
    with anyio.fail_after(5):
        await s.record_event().synchronize(strategy="thread")  # the watcher and its flags
        await t.synchronize()
    del shared, host
    gc.collect()
    held = own_backend.held(0)
    assert held["streams"] == 1 and held["events"] >= 1, held  # the free stream, markers
    assert live() != before
    # close leaves a context with work pending (a free, a host function) to the exit: let the
    # device finish first, as a program's last synchronize would
    device_finishes()
    own_backend.close()
    assert live() == before, (before, live())  # the program still holds s, t, ipc, opened
    own_backend.close()
    assert live() == before
    del s, t, ipc, opened
    gc.collect()  # their finalizers release nothing twice (the fixture checks the driver)
    assert live() == before


def test_a_closed_backend_opens_no_device(own_backend: Any) -> None:
    """After the close at exit, a device not used before is not opened (its context would be
    retained for nothing, and never released): making anything on it says why."""
    from aiostream._backends.cuda.devices import CLOSED

    own_backend.close()
    for make in (lambda: ais.Stream(DEV), lambda: ais.DeviceBuffer(N, DEV)):
        with pytest.raises(ais.AiostreamError) as info:
            make()
        assert str(info.value) == CLOSED
    assert not own_backend._devices.by_index


@needs_stand_in
def test_close_releases_each_device_s_own_context(own_backend: Any) -> None:
    """A backend that used only ``cuda:1`` holds a reference to its primary context, and
    close gives back that one: device 0's references are never touched."""
    two_devices()
    refs = context_refs()
    ais.Stream("cuda:1").record_event().synchronize_blocking()  # its mark's slot is free
    assert context_refs() == [refs[0], refs[1] + 1]
    own_backend.close()
    assert context_refs() == refs


@needs_stand_in
async def test_a_loader_on_one_device_opens_no_other(
    anyio_backend: object, own_backend: Any
) -> None:
    """A DataLoader on ``cuda:1`` makes its copy stream, its device buffers and its pinned
    staging buffers there: the default device's context is never opened (on a GPU it would
    take device memory the program never asked for)."""
    two_devices()
    refs = context_refs()
    source = (np.full(64, i, np.float32) for i in range(4))
    out = ais.HostBuffer(256, device="cuda:1")
    seen = []
    async with ais.DataLoader(source, device="cuda:1", prefetch=2) as loader:
        async for batch in loader:
            assert batch.data.device == ais.device("cuda:1")
            ais.copy_async(out, batch.data)  # on the current stream, which waits for the batch
            await ais.current_stream("cuda:1").synchronize()
            seen.append(float(out.numpy(np.float32).mean()))
    assert seen == [0.0, 1.0, 2.0, 3.0]
    assert context_refs() == [refs[0], refs[1] + 1]


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
def test_close_leaves_a_context_with_work_pending_on_a_stream_still_held(
    own_backend: Any,
) -> None:
    """Closed while a kernel runs on a stream the program still holds (aiostream's streams
    are non-blocking: the legacy default stream, idle, says nothing of them), the backend
    destroys its handles but leaves its reference to the context to the exit: releasing it
    could wait for the kernel, or reset the context under it."""
    s = ais.Stream(DEV)
    refs = FAKE.fake_cuda_context_refs(0)
    ais.delay(0.5, stream=s)
    own_backend.close()
    assert FAKE.fake_cuda_context_refs(0) == refs  # kept: the shared backend's and this one's
    # the exit's release, done here: the shared backend's reference keeps the context alive
    assert FAKE.fake_cuda_hold_primary(0, 0) == 0
    assert FAKE.fake_cuda_context_refs(0) == refs - 1
    del s


@needs_stand_in
def test_close_leaves_a_context_with_work_pending_on_a_stream_dropped(own_backend: Any) -> None:
    """Dropped while a kernel runs, a stream is destroyed at once (the driver lets its work
    run on) and a marker recorded on it first stands for that work: closed meanwhile, with no
    wait anywhere (no completion flag in use), the backend still sees the work through that
    marker and leaves its reference to the context to the exit."""
    s = ais.Stream(DEV)
    refs = FAKE.fake_cuda_context_refs(0)
    ais.delay(0.5, stream=s)
    del s
    gc.collect()
    assert own_backend.held(0)["slots"] == 0, own_backend.held(0)
    own_backend.close()
    assert FAKE.fake_cuda_context_refs(0) == refs  # kept: the exit releases it
    assert FAKE.fake_cuda_hold_primary(0, 0) == 0  # the exit's release, done here
    assert FAKE.fake_cuda_context_refs(0) == refs - 1


def test_a_stream_held_past_the_close_refuses_every_use(own_backend: Any) -> None:
    """The close at exit destroys the streams and events the program still holds: their
    later uses raise, saying why, and neither reach the driver nor hand another library a
    handle that names nothing (or another object the driver made since)."""
    from aiostream._backends.cuda.devices import CLOSED

    s = ais.Stream(DEV)
    event = s.record_event()
    host = ais.HostBuffer(N, device=DEV)
    event.synchronize_blocking()
    del host
    gc.collect()
    device_finishes()
    own_backend.close()
    uses = (
        s.query,
        event.query,
        lambda: s.record_event(),
        lambda: ais.delay(0.001, stream=s),
        s.__cuda_stream__,  # handles for other libraries: destroyed, so none is handed out
        lambda: event.event_id,
    )
    for use in uses:
        with pytest.raises(ais.AiostreamError) as info:
            use()
        assert str(info.value) == CLOSED


@needs_stand_in
def test_memory_still_held_at_close_is_left_to_the_exit_and_still_reads(
    own_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Closed while the program still holds a pinned buffer (and a view of it), the backend
    does not free it, and leaves its reference to the context to the exit: the view reads,
    as an atexit handler registered before aiostream's would read it, and the debug log says
    so. Dropped after the close, it is still not freed: the process's end frees it."""
    host = ais.HostBuffer(N, device=DEV)
    address = host._handle.ptr
    view = host.numpy()
    view[:] = 5
    refs, pinned = FAKE.fake_cuda_context_refs(0), FAKE.fake_cuda_live(PINNED)
    with caplog.at_level("DEBUG", logger="aiostream"):
        own_backend.close()
    assert (
        "cuda:0: 1 buffer(s) still held at close: left to the exit, with the context"
    ) in caplog.messages
    assert FAKE.fake_cuda_context_refs(0) == refs and FAKE.fake_cuda_live(PINNED) == pinned
    assert int(view.sum()) == 5 * N
    del host, view
    gc.collect()
    assert FAKE.fake_cuda_live(PINNED) == pinned
    # what the exit does, done here (the shared backend's reference keeps the context)
    with primary_context() as cu:
        assert cu.cuMemFreeHost(address) == (cu.CUresult.CUDA_SUCCESS,)
    assert FAKE.fake_cuda_hold_primary(0, 0) == 0
    assert FAKE.fake_cuda_context_refs(0) == refs - 1


@needs_stand_in
async def test_devices_that_write_no_values_wait_on_marker_events(
    anyio_backend: object, own_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Where ``cuStreamWriteValue32`` is not supported, marks are internal events (the debug
    log says so once), waits of every strategy still end with their work, and each marker
    goes back to its pool when its last wait and event let go of it."""
    from aiostream._backends.cuda.devices import MARKER_POOL

    assert FAKE.fake_cuda_fail_call(b"cuStreamWriteValue32", 1, 801)  # NOT_SUPPORTED
    s, t = ais.Stream(DEV), ais.Stream(DEV)
    with caplog.at_level("DEBUG", logger="aiostream"):
        s.record_event()
        s.record_event()
    said = "cuda:0: no cuStreamWriteValue32: events mark waits"
    assert caplog.messages.count(said) == 1, caplog.messages
    t.__cuda_stream__()  # handed out: its event waits get no host function
    for _ in range(MARKER_POOL + 2):
        for strategy in ("hybrid", "poll", "thread", "callback"):
            for stream in (s, t):
                ais.delay(0.002, stream=stream)
                e = stream.record_event()
                ais.delay(0.002, stream=stream)
                with anyio.fail_after(5):
                    await e.synchronize(strategy=strategy)
                    assert e.query()
                    await stream.synchronize(strategy=strategy)
                assert stream.query()
                del e
    gc.collect()
    held = own_backend.held(0)
    assert held["slots"] == 0 and held["watched"] == 0, held  # no flag written: markers
    assert held["events"] <= MARKER_POOL + 1, held  # given back to the pool


async def a_wait_failing_once(s: ais.Stream, strategy: str, call: str) -> None:
    """Await ``s`` with the driver's next ``call`` failing: the wait raises that error, with
    the call, device and code; the next wait gets the driver's own answers and ends with the
    work."""
    assert FAKE.fake_cuda_fail_call(call.encode(), 1, 999)
    try:
        with anyio.fail_after(5), pytest.raises(ais.CudaError) as info:
            await s.synchronize(strategy=strategy)
    finally:
        FAKE.fake_cuda_clear_error()
    assert str(info.value) == f"{call} failed on cuda:0: CUDA_ERROR_UNKNOWN (999)"
    with anyio.fail_after(5):
        await s.synchronize(strategy=strategy)
    assert s.query()


@needs_stand_in
@pytest.mark.parametrize("strategy", ["hybrid", "poll"])  # the strategies that query
async def test_a_failed_query_of_a_marker_event_is_raised_with_its_call(
    anyio_backend: object, own_backend: Any, strategy: str
) -> None:
    """Where marks are internal events, a wait asks the driver whether its marker completed:
    an error the driver returns then ends the wait with that error, naming the call."""
    assert FAKE.fake_cuda_fail_call(b"cuStreamWriteValue32", 1, 801)  # NOT_SUPPORTED
    s = ais.Stream(DEV)
    ais.delay(0.05, stream=s)
    await a_wait_failing_once(s, strategy, "cuEventQuery")  # the first: the marker's


@needs_stand_in
@pytest.mark.parametrize("strategy", sorted(ais._waiting.WAKE))
async def test_a_wait_whose_host_function_cannot_be_launched_is_polled(
    anyio_backend: object, caplog: pytest.LogCaptureFixture, strategy: str
) -> None:
    """A wait handed to the watcher launches a host function to announce its work; if the
    driver refuses it, the wait is polled instead (a failed device is told by the health
    check) and still ends with its work."""
    s = ais.Stream(DEV)
    ais.delay(0.02, stream=s)
    assert FAKE.fake_cuda_fail_call(b"cuLaunchHostFunc", 1, 999)
    try:
        with anyio.fail_after(5), caplog.at_level("DEBUG", logger="aiostream"):
            await s.synchronize(strategy=strategy)
        assert s.query()
    finally:
        FAKE.fake_cuda_clear_error()
    assert "cuda:0: no host function for a wait" in caplog.messages


@needs_stand_in
@pytest.mark.parametrize("strategy", sorted(ais._waiting.WAKE))
async def test_a_failed_host_function_on_a_handed_out_stream_is_raised(
    anyio_backend: object, strategy: str
) -> None:
    """On a stream handed out (others may submit to it unseen), a wait's host function is
    launched when the wait begins; if the driver refuses it, the wait raises the driver's
    error with its call, and the next wait is the driver's own again."""
    s = ais.Stream(DEV)
    s.__cuda_stream__()
    ais.delay(0.02, stream=s)
    await a_wait_failing_once(s, strategy, "cuLaunchHostFunc")


@needs_stand_in
@pytest.mark.parametrize("strategy", sorted(ais._waiting.WAKE))
async def test_an_allocation_after_an_awaited_mark_makes_the_stream_busy_again(
    anyio_backend: object, strategy: str
) -> None:
    """A stream awaited with a host function is idle once the work before its mark is done,
    the host function still queued or not; work submitted after the mark makes it busy
    again, a stream-ordered allocation too (here followed by a kernel that reads it)."""
    s = ais.Stream(DEV)
    ais.delay(0.02, stream=s)
    with anyio.fail_after(5):
        await s.synchronize(strategy=strategy)
    assert s.query()
    with ais.use_stream(s):
        buf = ais.DeviceBuffer(N, DEV)  # cuMemAllocAsync on s
    touch(s, ptr(buf), N, 0.3)
    assert not s.query()
    with anyio.fail_after(5):
        await s.synchronize(strategy=strategy)
    assert s.query()


@needs_stand_in
async def test_a_wait_that_cannot_make_the_health_event_raises_the_driver_s_error(
    anyio_backend: object, own_backend: Any
) -> None:
    """A device's health is asked of an event of the watcher's, made on the first check: if
    the driver cannot make it, the wait that checks raises that error with its call, and the
    next check makes it."""
    s = ais.Stream(DEV)
    ais.delay(0.05, stream=s)
    watcher = own_backend._devices[0].watcher
    assert watcher.health is None
    assert FAKE.fake_cuda_fail_call(b"cuEventCreate", 1, 999)
    try:
        with anyio.fail_after(5), pytest.raises(ais.CudaError) as info:
            await s.synchronize(strategy="poll")
    finally:
        FAKE.fake_cuda_clear_error()
    assert str(info.value) == "cuEventCreate failed on cuda:0: CUDA_ERROR_UNKNOWN (999)"
    assert watcher.health is None
    with anyio.fail_after(5):
        await s.synchronize(strategy="poll")
    assert watcher.health is not None and s.query()


@needs_stand_in
async def test_flag_memory_shrinks_only_from_its_last_chunk_and_only_once_that_is_idle(
    anyio_backend: object, own_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Completion flags live in chunks of pinned memory, taken first-free-first: a chunk is
    given back to the driver only from the end, once nothing uses it (the device may still
    write a slot of any chunk in use), and every chunk but the first goes when all are idle.
    Chunks of four slots here, so that a few waits span several."""
    from aiostream._backends.cuda import watcher

    monkeypatch.setattr(watcher, "CHUNK", 4)  # this backend has no chunk yet
    pinned = FAKE.fake_cuda_live(3)
    quick, slow = ais.Stream(DEV), ais.Stream(DEV)
    ais.delay(0.05, stream=quick)
    first = [quick.record_event() for _ in range(4)]  # the first chunk's four slots
    ais.delay(3600.0, stream=slow)
    last = [slow.record_event() for _ in range(4)]  # the second chunk's
    try:
        with anyio.fail_after(5):
            for e in first:
                await e.synchronize()
        del first
        gc.collect()
        held = own_backend.held(0)  # after a sweep: the first chunk is idle, the last is not
        assert (held["chunks"], held["slots"]) == (2, 4), held
        assert FAKE.fake_cuda_live(3) == pinned + 2
    finally:
        hurry()
    with anyio.fail_after(5):
        for e in last:
            await e.synchronize()
            assert e.query()
    del last
    gc.collect()
    held = own_backend.held(0)
    assert (held["chunks"], held["slots"]) == (1, 0), held
    assert FAKE.fake_cuda_live(3) == pinned + 1  # the second chunk went back to the driver


@needs_stand_in
async def test_a_full_chunk_of_flags_takes_back_its_landed_slots_before_growing(
    anyio_backend: object, own_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When every slot is taken, a new mark first frees the slots whose values have landed
    (held by events no one has asked since) and takes one of those: flag memory grows only
    when the slots are all still pending. Chunks of four slots here."""
    from aiostream._backends.cuda import watcher

    monkeypatch.setattr(watcher, "CHUNK", 4)  # this backend has no chunk yet
    s = ais.Stream(DEV)
    ais.delay(0.001, stream=s)
    events = [s.record_event() for _ in range(4)]  # the chunk's four slots
    device_finishes()  # their values land; nothing of aiostream's looks
    ais.delay(3600.0, stream=s)  # the fifth mark's value does not land during the test
    try:
        fifth = s.record_event()
        held = own_backend.held(0)
        assert (held["chunks"], held["slots"]) == (1, 1), held
    finally:
        hurry()
    with anyio.fail_after(5):
        for e in [*events, fifth]:
            await e.synchronize()  # the events whose slots were taken back are complete
            assert e.query()


@needs_stand_in
async def test_a_new_backend_announces_callback_waits_with_a_host_function(
    anyio_backend: object, own_backend: Any
) -> None:
    """Each backend looks up the driver's ``cuLaunchHostFunc`` (``cuGetProcAddress``) when it
    first uses a device: a callback wait on it is announced by one host function, not left to
    polling; and the flags of its first wait are one chunk of pinned, portable, device-mapped
    memory of four bytes a slot."""
    from cuda.bindings import driver

    from aiostream._backends.cuda.watcher import CHUNK

    allocations = []
    alloc = driver.cuMemHostAlloc

    def spy(nbytes: int, flags: int) -> Any:
        allocations.append((nbytes, flags))
        return alloc(nbytes, flags)

    s = ais.Stream(DEV)
    ais.delay(3600.0, stream=s)
    calls = FAKE.fake_cuda_host_calls()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(driver, "cuMemHostAlloc", spy)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(s.synchronize, strategy="callback"))
                with anyio.fail_after(5):
                    while not own_backend.held(0)["watched"]:
                        await anyio.sleep(0)
                assert FAKE.fake_cuda_host_calls() - calls == 1
                tg.cancel_scope.cancel()
        finally:
            hurry()
    assert allocations == [(4 * CHUNK, 0x1 | 0x2)]  # PORTABLE | DEVICEMAP
    device_finishes()  # the cancelled wait's mark lands before the close


@needs_stand_in
def test_an_event_destroyed_gives_back_the_marker_its_record_took(own_backend: Any) -> None:
    """A device found unable to write values at an event's record (stream memory operations
    unsupported) marks that record with an internal marker event, which the event holds:
    destroyed, the event gives it back to the device's pool."""
    assert FAKE.fake_cuda_fail_call(b"cuStreamWriteValue32", 1, 801)  # NOT_SUPPORTED
    try:
        s = ais.Stream(DEV)
        ais.delay(0.001, stream=s)
        e = s.record_event()
        dev = own_backend._devices.get(0)
        assert not dev.watcher.memops and not dev.markers
        del e
        gc.collect()
        assert len(dev.markers) == 1
    finally:
        FAKE.fake_cuda_clear_error()
    device_finishes()


def test_a_record_of_an_event_handed_out_takes_no_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waits on an event whose handle is out query the event itself (others may record it
    unseen), so its records take no mark; an event of aiostream's own still takes one at each
    record where the device writes values."""
    from aiostream._backends.cuda.watcher import Watcher

    marked = []
    mark = Watcher.mark

    def spy(self: Watcher, *args: Any) -> Any:
        marked.append(args)
        return mark(self, *args)

    s = ais.Stream(DEV)
    handed = s.record_event()
    assert handed.event_id  # handed out now
    memops = _backends.get("cuda")._devices.get(0).watcher.memops  # type: ignore[attr-defined]
    monkeypatch.setattr(Watcher, "mark", spy)
    handed.record(s)
    handed.record(s)
    assert marked == []
    own = s.record_event()
    assert len(marked) == memops
    own.synchronize_blocking()
    assert handed.query()


@needs_stand_in
@pytest.mark.parametrize("lookup", ["not found", "no cuGetProcAddress"])
async def test_a_driver_without_cuLaunchHostFunc_has_every_wait_polled(
    anyio_backend: object, own_backend: Any, monkeypatch: pytest.MonkeyPatch, lookup: str
) -> None:
    """Where the driver has no ``cuLaunchHostFunc`` to give (or no ``cuGetProcAddress`` to
    ask), no wait is announced by a host function: a wait of every strategy is polled by the
    watcher or the loop, and ends with its work."""
    from cuda.bindings import driver

    def refuse(symbol: bytes, version: int, flags: int) -> Any:
        if lookup == "not found":
            return driver.CUresult.CUDA_ERROR_NOT_FOUND, 0, None
        raise RuntimeError("Function cuGetProcAddress not found")

    monkeypatch.setattr(driver, "cuGetProcAddress", refuse)
    s = ais.Stream(DEV)  # the device's first use by this backend: its watcher looks it up
    calls = FAKE.fake_cuda_host_calls()
    for strategy in ("callback", "hybrid", "thread", "poll"):
        ais.delay(0.005, stream=s)
        with anyio.fail_after(5):
            await s.synchronize(strategy=strategy)
        assert s.query(), strategy
    assert FAKE.fake_cuda_host_calls() == calls


@needs_stand_in
async def test_the_watcher_counts_the_watched_waits_announced_ahead_of_their_mark(
    anyio_backend: object,
) -> None:
    """On a stream handed out, a wait's host function comes right before its mark, which lands
    only after the host function returns: the watcher counts such waits while it watches them
    (it then polls for the mark after each post), each one, and none once they are gone."""
    watcher = _backends.get("cuda")._devices.get(0).watcher  # type: ignore[attr-defined]
    s = ais.Stream(DEV)
    s.__cuda_stream__()
    ais.delay(3600.0, stream=s)
    before = watcher.ahead
    try:
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(functools.partial(s.synchronize, strategy="callback"))
            with anyio.fail_after(5):
                while watcher.ahead < before + 2:
                    await anyio.sleep(0)
            await anyio.sleep(0.01)
            assert watcher.ahead == before + 2
            tg.cancel_scope.cancel()
    finally:
        hurry()
    assert watcher.ahead == before


@needs_stand_in  # opens an event's IPC handle in the process that made it
def test_an_event_recorded_on_a_stream_waits_in_that_stream_s_lane() -> None:
    """Work on one stream completes in order, the records of events on it included: a wait on
    such an event joins the stream's lane (the waiter polls only each lane's head), placed by
    where its record was; a wait on an event that others may record unseen (opened from an
    IPC handle, or whose handle was handed out) has a lane of its own."""
    from aiostream._objects import handle

    backend = _backends.get("cuda")
    s = ais.Stream(DEV)
    recorded = s.record_event()
    exported = ais.Event(DEV, interprocess=True)
    exported.record(s)
    opened = ais.Event.from_ipc_handle(DEV, exported.ipc_handle())  # its record is not ours
    ais.delay(0.001, stream=s)
    targets = [
        backend.event_capture(handle(recorded), False),
        backend.stream_capture(handle(s), False),
        backend.event_capture(handle(opened), False),
        backend.event_capture(handle(exported), False),
    ]
    try:
        first, whole, *alone = targets
        assert first.lane == whole.lane and first.seq < whole.seq
        assert [target.lane for target in alone] == [
            ("event", opened.event_id),
            ("event", exported.event_id),
        ]
    finally:
        for target in targets:
            target.release()
    s.synchronize_blocking()


@needs_stand_in
async def test_waits_a_sweep_off_the_thread_finds_complete_are_called_back_by_the_thread(
    anyio_backend: object, own_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep made off the watcher's thread (for a full chunk of flags, or a count of what is
    held) may find watched waits complete: it leaves their callbacks to the thread and wakes
    it, and the waits end then, not at the thread's next look. Here the thread would look
    again only after 30 s, and the host function that announces the wait runs 30 s late."""
    from aiostream._backends.cuda import watcher

    monkeypatch.setattr(watcher, "HEALTH_S", 30.0)
    FAKE.fake_cuda_host_fn_delay(round(30e9))
    done = []

    async def wait(s: ais.Stream) -> None:
        await s.synchronize(strategy="callback")
        done.append(time.monotonic())

    try:
        s = ais.Stream(DEV)
        ais.delay(0.01, stream=s)
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait, s)
            with anyio.fail_after(5):
                while not own_backend.held(0)["watched"]:
                    await anyio.sleep(0)
            await anyio.sleep(0.05)  # the kernel ends: the mark lands, and no one looks
            assert not done
            own_backend.held(0)  # a sweep off the thread
            with anyio.fail_after(5):
                while not done:
                    await anyio.sleep(0.001)
    finally:
        FAKE.fake_cuda_host_fn_delay(0)
        hurry()
    device_finishes()  # the late host function runs before the close


@needs_stand_in
def test_a_device_keeps_so_many_idle_markers_and_destroys_the_rest(own_backend: Any) -> None:
    """Markers given back go to the device's pool until it holds ``MARKER_POOL``; the rest are
    destroyed at once. Close destroys the pool and every marker in use; one of those given
    back after close is neither kept nor destroyed a second time."""
    from aiostream._backends.cuda.devices import MARKER_POOL

    ais.Stream(DEV)
    dev = own_backend._devices.get(0)
    before = FAKE.fake_cuda_live(EVENTS)
    markers = [dev.marker() for _ in range(MARKER_POOL + 3)]
    assert FAKE.fake_cuda_live(EVENTS) == before + MARKER_POOL + 3
    for marker in markers[:-1]:
        dev.give_back(marker)
    assert dev.markers == markers[:MARKER_POOL]
    assert FAKE.fake_cuda_live(EVENTS) == before + MARKER_POOL + 1  # the pool and one in use
    assert dev.marker() is markers[MARKER_POOL - 1]  # taken from the pool, last in first out
    own_backend.close()
    assert FAKE.fake_cuda_live(EVENTS) == before
    for marker in markers:
        dev.give_back(marker)  # the stand-in would count a second destroy as a violation
    assert dev.markers == []
    assert FAKE.fake_cuda_live(EVENTS) == before


def test_host_memory_the_machine_cannot_hold_is_refused_by_its_device() -> None:
    """Pageable host memory for a CUDA device is the machine's: more than it has is refused
    with a DeviceError of that device, as pinned memory the driver cannot give is."""
    with pytest.raises(ais.DeviceError) as refused:
        ais.HostBuffer(1 << 62, pinned=False, device=DEV)
    assert refused.value.device == DEV
    assert str(refused.value) == (
        f"{DEV}: cannot allocate {1 << 62} bytes of host memory (the machine does not have it)"
    )


def _nothing(device: str) -> None:
    return None


def _delay(s: ais.Stream) -> ais.Stream:
    """A kernel on ``s`` (the sleep kernel is loaded on its first use)."""
    ais.delay(0.001, stream=s)
    return s


def _delayed(device: str) -> ais.Stream:
    """A stream busy for long enough that a wait for it must mark its work."""
    s = ais.Stream(device)
    ais.delay(0.2, stream=s)
    return s


def _waited(s: ais.Stream) -> None:
    """``s``'s work waited for: the wait's mark takes a completion flag."""
    s.synchronize_blocking()


@needs_stand_in
@pytest.mark.parametrize(
    ("call", "ready", "make"),
    [
        ("cuDevicePrimaryCtxRetain", _nothing, lambda _: ais.Stream(DEV)),  # the first use
        ("cuCtxGetStreamPriorityRange", _nothing, lambda _: ais.Stream(DEV)),
        ("cuEventCreate", _nothing, lambda _: ais.DeviceBuffer(N, DEV)),  # the first marker
        ("cuModuleLoadData", ais.Stream, _delay),  # the sleep kernel, on first use
        ("cuModuleGetFunction", ais.Stream, _delay),
        ("cuMemHostAlloc", _delayed, _waited),  # the first completion flag: its pinned memory
        ("cuMemHostGetDevicePointer", _delayed, _waited),
    ],
    ids=[
        "retaining the context",
        "opening the device",
        "a marker",
        "loading the sleep kernel",
        "finding the sleep kernel",
        "the completion flags' memory",
        "the completion flags' device address",
    ],
)
def test_driver_calls_of_the_backend_s_own_are_checked(
    own_backend: Any, call: str, ready: Callable[[str], Any], make: Callable[[Any], object]
) -> None:
    """Calls the backend makes for itself (opening a device, the first marker of its pool, its
    sleep kernel, its completion flags) raise a CudaError naming the call and the device when
    they fail, leave nothing behind, and the next try works."""
    prepared = ready(DEV)
    before = live()
    assert FAKE.fake_cuda_fail_call(call.encode(), 1, 999)
    try:
        with pytest.raises(ais.CudaError) as info:
            make(prepared)
    finally:
        FAKE.fake_cuda_clear_error()
    assert str(info.value).startswith(f"{call} failed on {DEV}: CUDA_ERROR_UNKNOWN (999)")
    kept = call == "cuModuleGetFunction"  # the module loaded is kept: the next try uses it
    assert live() == [n + (kept and kind == MODULES) for kind, n in enumerate(before)]
    made = make(prepared)
    loaded = call.startswith("cuModule")
    assert FAKE.fake_cuda_live(MODULES) == before[MODULES] + loaded  # once, however many tries
    ais.current_stream(DEV).synchronize_blocking()
    del made
    gc.collect()


@pytest.mark.parametrize("part", ["memory", "event"])
def test_a_shared_buffer_handle_of_the_wrong_size_says_what_to_pass(part: str) -> None:
    """A handle whose header is aiostream's but whose memory or event part is not the CUDA
    backend's size is refused before any driver call, saying what to pass."""
    import struct

    from aiostream.buffers import _IPC_HEADER

    handle = ais.DeviceBuffer(N, DEV, interprocess=True).ipc_handle()
    at = struct.calcsize(_IPC_HEADER)
    magic, nbytes, mem_len, event_len = struct.unpack_from(_IPC_HEADER, handle)
    memory, event = handle[at : at + mem_len], handle[at + mem_len :]
    if part == "memory":
        memory += b"\0"
    else:
        event = event[:-1]
    header = struct.pack(_IPC_HEADER, magic, nbytes, len(memory), len(event))
    with pytest.raises(ValueError) as info:
        ais.DeviceBuffer.from_ipc_handle(DEV, header + memory + event)
    assert str(info.value) == (
        "not an IPC handle of CUDA device memory: pass the bytes that DeviceBuffer.ipc_handle() "
        "returned in the exporting process"
    )


@needs_stand_in
@pytest.mark.parametrize("code", [1, 999])
def test_a_shared_buffer_the_driver_cannot_open_says_so(code: int) -> None:
    """``cuIpcOpenMemHandle`` refusing a handle: CUDA_ERROR_INVALID_VALUE (a handle from no
    live export) says what to pass, with the driver's error as its cause; any other code is
    the driver's error itself. Nothing opened is left open."""
    import struct

    from aiostream.buffers import _IPC_HEADER

    buf = ais.DeviceBuffer(N, DEV, interprocess=True)
    handle = bytearray(buf.ipc_handle())
    at = struct.calcsize(_IPC_HEADER)  # the memory's part starts with the exporter's pid
    handle[at : at + 4] = (os.getpid() + 1).to_bytes(4, "little")  # as if from another process
    before = live()
    assert FAKE.fake_cuda_fail_call(b"cuIpcOpenMemHandle", 1, code)
    try:
        with pytest.raises((ValueError, ais.CudaError)) as info:
            ais.DeviceBuffer.from_ipc_handle(DEV, bytes(handle))
    finally:
        FAKE.fake_cuda_clear_error()
    driver = info.value.__cause__ if code == 1 else info.value
    name = "CUDA_ERROR_INVALID_VALUE" if code == 1 else "CUDA_ERROR_UNKNOWN"
    assert isinstance(driver, ais.CudaError)
    assert str(driver).startswith(f"cuIpcOpenMemHandle failed on {DEV}: {name} ({code})")
    if code == 1:
        assert type(info.value) is ValueError and str(info.value) == (
            "the driver cannot open this memory IPC handle (CUDA_ERROR_INVALID_VALUE): pass the "
            "bytes that DeviceBuffer.ipc_handle() returned in another process, while the "
            "exported buffer is alive"
        )
    assert live() == before  # the exporter's event, opened first, is closed again


@needs_stand_in
def test_the_backend_shares_only_memory_the_driver_can_share(own_backend: Any) -> None:
    """``DeviceBuffer.ipc_handle`` refuses a buffer made without ``interprocess=True`` before
    it reaches the backend; the backend keeps the driver's rule too (``cuIpcGetMemHandle``
    takes memory of ``cuMemAlloc`` only): stream-ordered memory is refused with what to do,
    and memory of ``cuMemAlloc`` gets this process's id and the driver's 64-byte handle."""
    pooled = ais.DeviceBuffer(N, DEV)
    assert pooled._handle.pooled
    with pytest.raises(ValueError) as info:
        own_backend.memory_ipc_handle(pooled._handle)
    assert str(info.value) == (
        "this memory cannot be shared with other processes: the driver shares memory of "
        "cuMemAlloc only; create the buffer with DeviceBuffer(nbytes, device, interprocess=True)"
    )
    plain = ais.DeviceBuffer(N, DEV, interprocess=True)
    handle = own_backend.memory_ipc_handle(plain._handle)
    assert len(handle) == 4 + 64 and int.from_bytes(handle[:4], "little") == os.getpid()
    del pooled, plain
    gc.collect()


def close_with_a_failed_release(
    backend: Any, caplog: pytest.LogCaptureFixture, call: str, let_go: list[Any], nth: int = 1
) -> None:
    """Close ``backend`` with the ``nth`` next ``call`` failing, once what ``let_go`` holds
    (the program's last references to some objects) is dropped and collected: close says
    the failed release once, with its call, device and code."""
    assert FAKE.fake_cuda_fail_call(call.encode(), nth, 999)
    try:
        let_go.clear()
        gc.collect()
        with caplog.at_level("WARNING", logger="aiostream"):
            backend.close()
    finally:
        FAKE.fake_cuda_clear_error()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        f"aiostream could not release 1 CUDA handle(s) (the first: {call} failed on cuda:0: "
        "CUDA_ERROR_UNKNOWN (999)); the driver reclaims them with the context"
    ]


@needs_stand_in
@pytest.mark.parametrize(
    "what",
    [
        "cuMemFree",
        "cuStreamDestroy",
        "cuStreamDestroy (a stream held at close)",
        "cuEventDestroy",
        "cuDevicePrimaryCtxRelease",
    ],
)
def test_a_failed_release_is_said_once_at_close_with_its_call_and_device(
    own_backend: Any, caplog: pytest.LogCaptureFixture, what: str
) -> None:
    """Releases never raise (they run in finalizers); one that fails is counted, and close
    says so once, with the failed call's name, device and code: memory freed once its
    allocation's marker completes, a stream dropped (its finalizer releases it), an event the
    program still holds at close (a stream too), the primary context at close."""
    call, held = what.split(" ", 1)[0], what.endswith("held at close)")
    s, e = ais.Stream(DEV), ais.Event(DEV)
    buf = ais.DeviceBuffer(N, DEV, interprocess=True)  # not pooled: cuMemFree
    address = ptr(buf)
    e.record(s)
    s.synchronize_blocking()  # nothing pending: close releases the context too
    dev = own_backend._devices[0]
    (stream,) = dev.streams
    (event,) = dev.events
    dev.watcher.check()  # its health event exists: close destroys it first, then the events
    let_go = [buf, s]  # finalizers: cuStreamDestroy, cuMemFree (now, or at close)
    kept = s if held else None
    del buf, s
    nth = 2 if call == "cuEventDestroy" else 1
    close_with_a_failed_release(own_backend, caplog, call, let_go, nth)
    del kept
    with primary_context() as cu:  # what the failed call left, released as a user would
        left = {
            "cuMemFree": lambda: cu.cuMemFree(cu.CUdeviceptr(address)),
            "cuStreamDestroy": lambda: cu.cuStreamDestroy(cu.CUstream(int(stream.ptr))),
            "cuEventDestroy": lambda: cu.cuEventDestroy(cu.CUevent(int(event.ptr))),
            "cuDevicePrimaryCtxRelease": lambda: cu.cuDevicePrimaryCtxRelease(cu.cuDeviceGet(0)[1]),
        }[call]()
        assert left == (cu.CUresult.CUDA_SUCCESS,)


@needs_stand_in
@pytest.mark.parametrize("failing", ["the query of its marker", "its free"])
def test_a_free_in_a_context_that_cannot_be_made_current_is_said_at_close(
    own_backend: Any, caplog: pytest.LogCaptureFixture, failing: str
) -> None:
    """A pinned buffer dropped while a copy used it is freed at the next allocation once the
    copy's marker is over, and the marker goes back to the pool. Where its context cannot be
    made current to ask the marker, nothing runs there any more: the marker counts as over
    and the buffer is freed. Where it cannot be made current to free it, the free is given
    up, and close says so once, with the call, device and code."""
    s = ais.Stream(DEV)
    host, buf = ais.HostBuffer(N, device=DEV), ais.DeviceBuffer(N, DEV)
    ais.delay(0.01, stream=s)
    ais.copy_async(buf, host, stream=s)
    del host
    gc.collect()
    dev = own_backend._devices[0]
    ((mem, marks),) = dev.freeing
    device_finishes()
    pinned = FAKE.fake_cuda_live(PINNED)
    assert FAKE.fake_cuda_fail_call(b"cuCtxPushCurrent", 1 if "query" in failing else 2, 999)
    try:
        ais.HostBuffer(N, device=DEV)  # an allocation reaps first; its own push succeeds
    finally:
        FAKE.fake_cuda_clear_error()
    assert not dev.freeing
    assert all(marker in dev.markers for _, marker in marks)  # back in the pool
    del buf, s
    gc.collect()
    with caplog.at_level("WARNING", logger="aiostream"):
        own_backend.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if "query" in failing:
        assert FAKE.fake_cuda_live(PINNED) == pinned - 1 and warnings == []
    else:
        assert FAKE.fake_cuda_live(PINNED) == pinned  # given up: the exit frees it
        with primary_context() as cu:  # as the exit would (the shared backend keeps the context)
            assert cu.cuMemFreeHost(mem.ptr) == (cu.CUresult.CUDA_SUCCESS,)
        assert warnings == [
            "aiostream could not release 1 CUDA handle(s) (the first: cuCtxPushCurrent failed "
            "on cuda:0: CUDA_ERROR_UNKNOWN (999)); the driver reclaims them with the context"
        ]


@needs_stand_in
def test_a_stream_dropped_while_its_context_fails_is_destroyed_and_said_at_close(
    own_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream dropped is asked whether work is pending on it (to keep a marker of that
    work for close), in its context; if the context cannot be made current, the stream is
    destroyed all the same, and close says the failure once, with its call, device and code."""
    streams = FAKE.fake_cuda_live(0)
    let_go = [ais.Stream(DEV)]
    close_with_a_failed_release(own_backend, caplog, "cuCtxPushCurrent", let_go)
    assert FAKE.fake_cuda_live(0) == streams


@needs_stand_in
@pytest.mark.parametrize("call", ["cuStreamDestroy", "cuEventDestroy"])
def test_a_failed_release_of_the_backend_s_own_handles_is_said_at_close(
    own_backend: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """The handles the backend made for itself (its markers, its free stream) are released
    at close after the program's; one that fails is said once, as every failed release is."""
    s, other = ais.Stream(DEV), ais.Stream(DEV)
    host = ais.HostBuffer(N, device=DEV)
    with ais.use_stream(s):
        buf = ais.DeviceBuffer(N, DEV)  # its allocation's marker
    ais.copy_async(host, buf, stream=other)
    other.synchronize_blocking()
    s.synchronize_blocking()  # no stream is dropped busy (which would leave a marker behind)
    del buf  # used on two streams: freed on the device's free stream
    del s, other, host  # the program's own handles are released before close
    gc.collect()
    dev = own_backend._devices[0]
    assert not dev.streams and not dev.events
    own = dict(dev.internal)  # the backend's own handles: markers ("event"), "stream"
    released: list[Any] = []  # the handles given to the call, the failed one first
    real = getattr(own_backend._cu, call)

    def spy(handle: Any) -> Any:
        released.append(handle)
        return real(handle)

    spy.__name__ = call  # as a release names the call it makes
    monkeypatch.setattr(own_backend._cu, call, spy)
    dev.watcher.check()  # its health event exists: close destroys it first, then the markers
    nth = 2 if call == "cuEventDestroy" else 1
    close_with_a_failed_release(own_backend, caplog, call, [], nth)
    failed = released[nth - 1]
    assert own.get(failed) == ("stream" if call == "cuStreamDestroy" else "event")
    with primary_context():  # the handle the failed call left, released as a user would
        assert real(failed) == (own_backend._cu.CUresult.CUDA_SUCCESS,)


@needs_stand_in
@pytest.mark.parametrize(
    "call",
    [
        "cuMemFreeHost",  # a host buffer used by no stream: freed at once
        "cuMemFreeAsync",  # a buffer used on its allocation stream only: freed there
        "cuStreamCreateWithPriority",  # the device's free stream, made on its first use
        "cuStreamWaitEvent",  # the free stream waiting for the buffer's streams
        "cuModuleUnload",  # the sleep kernel's module, at close
    ],
)
def test_a_failed_free_is_said_once_at_close_and_loses_nothing_else(
    own_backend: Any, caplog: pytest.LogCaptureFixture, call: str
) -> None:
    """The frees of memory dropped by the program, and the module unloaded at close: one that
    fails is said once at close with its call, device and code, as every failed release is
    (a buffer used on two streams is freed on the device's own free stream, after both)."""
    s, other = ais.Stream(DEV), ais.Stream(DEV)
    ais.delay(0.001, stream=s)  # the sleep kernel is loaded
    host = ais.HostBuffer(N, device=DEV)
    with ais.use_stream(s):
        buf = ais.DeviceBuffer(N, DEV)
    if call in ("cuStreamCreateWithPriority", "cuStreamWaitEvent"):
        ais.copy_async(host, buf, stream=other)  # a second stream uses it
    s.synchronize_blocking()
    other.synchronize_blocking()
    dropped = host if call == "cuMemFreeHost" else buf
    address, module = dropped._handle.ptr, own_backend._devices[0].module
    let_go = [host, buf]
    kept = (host, buf) if call == "cuModuleUnload" else ()  # held at close
    del dropped, host, buf
    close_with_a_failed_release(own_backend, caplog, call, let_go)
    del kept
    with primary_context() as cu:  # what the failed call left, released as a user would
        if call == "cuModuleUnload":
            assert cu.cuModuleUnload(module) == (cu.CUresult.CUDA_SUCCESS,)
        elif call == "cuMemFreeHost":
            assert cu.cuMemFreeHost(address) == (cu.CUresult.CUDA_SUCCESS,)
        else:  # stream-ordered memory: freed on a stream
            freed = cu.cuMemFreeAsync(cu.CUdeviceptr(address), cu.CUstream(0))
            assert freed == (cu.CUresult.CUDA_SUCCESS,)
            assert cu.cuCtxSynchronize() == (cu.CUresult.CUDA_SUCCESS,)


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
    with caplog.at_level("DEBUG", logger="aiostream"):
        buf = ais.DeviceBuffer(N, DEV)
    assert not buf._handle.pooled
    assert not [r for r in caplog.records if "memory pools" in r.getMessage()]
    del buf
    gc.collect()


@needs_stand_in
def test_a_device_that_fails_to_open_gives_back_its_own_context(own_backend: Any) -> None:
    """A device whose opening fails after its primary context was retained (here the query of
    its stream priorities) releases that context, its own: the error names the call and the
    device, and no device's references change."""
    two_devices()
    refs = context_refs()
    assert FAKE.fake_cuda_fail_call(b"cuCtxGetStreamPriorityRange", 1, 999)
    try:
        with pytest.raises(ais.CudaError) as info:
            ais.Stream("cuda:1")
    finally:
        FAKE.fake_cuda_clear_error()
    assert info.value.device == "cuda:1" and "cuCtxGetStreamPriorityRange" in str(info.value)
    assert context_refs() == refs


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
        with caplog.at_level("DEBUG", logger="aiostream"):
            with ais.use_stream(s):
                first, second = ais.DeviceBuffer(N, DEV), ais.DeviceBuffer(N, DEV)
    finally:
        FAKE.fake_cuda_clear_error()
    assert not first._handle.pooled and not second._handle.pooled
    said = [r.getMessage() for r in caplog.records if "memory pools" in r.getMessage()]
    assert said == ["cuda:0 has no memory pools: using cuMemAlloc"]
    del first, second
    gc.collect()


# ---------------------------------------------------------------------- in programs of their own


def program(code: str, *args: str, timeout: float = 60, **env: str) -> Any:
    """Run ``code`` (with ``args`` in ``sys.argv[1:]``) in a new interpreter with this
    process's driver; the stand-in's exit report (violations, leaks) ends up in stderr and the
    exit status."""
    return run_python("-c", textwrap.dedent(code), *args, timeout=timeout, **env)


FAULT_AT_EXIT = """
import ctypes, gc, anyio, aiostream as ais
lib = ctypes.CDLL("libcuda.so.1")
s = ais.Stream("cuda:0")
kept = [ais.HostBuffer(64, device="cuda:0"), ais.Event("cuda:0")]
with ais.use_stream(s):
    dev = ais.DeviceBuffer(64, "cuda:0")
dropped = [ais.Stream("cuda:0"), ais.HostBuffer(64, device="cuda:0")]
lib.fake_cuda_fail_next_launch(719)
ais.delay(0.01, stream=s)
try:
    s.synchronize_blocking()
except ais.CudaError as exc:
    print("failed", exc.name, flush=True)
del dev, s  # each release fails now: counted, never raised
dropped.clear()
gc.collect()
print("exiting", flush=True)
"""


@needs_stand_in
def test_a_faulted_program_exits_without_tracebacks() -> None:
    proc = program(FAULT_AT_EXIT)
    assert "failed CUDA_ERROR_LAUNCH_FAILED" in proc.stdout and "exiting" in proc.stdout
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    lines = proc.stderr.strip().splitlines()  # at most one line: what could not be released
    assert len(lines) <= 1, proc.stderr
    assert not lines or "could not release" in lines[0]


AFTER_CLOSE = """
import atexit, anyio, numpy as np, aiostream as ais

views = []

def report():  # registered before aiostream's first use: it runs after the backend closed
    print("read", int(np.concatenate(views).sum()), flush=True)
    for use in (lambda: stream.query(), lambda: stream.__cuda_stream__(),
                lambda: ais.copy_async(host, dev, stream=stream), lambda: event.event_id,
                lambda: ais.HostBuffer(8, device="cuda:0"), lambda: ais.Stream("cuda:0")):
        try:
            use()
        except ais.AiostreamError as exc:
            print("refused:", exc, flush=True)

atexit.register(report)

async def main():
    global stream, host, dev, event, plain
    stream = ais.Stream("cuda:0")
    host = ais.HostBuffer(64, device="cuda:0")
    dev = ais.DeviceBuffer(64, "cuda:0")
    host.numpy()[:] = 3
    ais.copy_async(dev, host, stream=stream)
    event = stream.record_event()
    await event.synchronize()
    plain = ais.HostBuffer(64, device="cuda:0")  # used on no stream: a free would be at once
    plain.numpy()[:] = 1
    views.extend([host.numpy(), plain.numpy()])  # pinned memory, read after the close

anyio.run(main)
"""


@needs_stand_in
def test_after_the_close_at_exit_views_still_read_and_every_use_says_why() -> None:
    """The backend closes at exit, before the atexit handlers registered earlier than its
    first use: they still read the host views of the buffers the program holds (left to the
    exit with their context, not freed under the views), and every use of a stream, event or
    buffer raises, naming the close, rather than calling the driver with a handle that names
    nothing (the stand-in counts that as a violation and fails the process)."""
    proc = program(AFTER_CLOSE)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "read 256", proc.stdout  # 64 bytes of 3, 64 of 1
    from aiostream._backends.cuda.devices import CLOSED

    assert lines[1:] == [f"refused: {CLOSED}"] * 6, proc.stdout
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


NO_POOLS = """
import gc, numpy as np, anyio, aiostream as ais
from tests.helpers.stand_in import hurry

async def main():
    s = ais.Stream("cuda:0")
    up, down = ais.HostBuffer(4096, device="cuda:0"), ais.HostBuffer(4096, device="cuda:0")
    up.numpy()[:] = 9
    for _ in range(3):
        with ais.use_stream(s):
            dev = ais.DeviceBuffer(4096, "cuda:0")
        ais.delay(0.01, stream=s)
        ais.copy_async(dev, up, stream=s)
        ais.copy_async(down, dev, stream=s)
        del dev
        gc.collect()  # freed (cuMemFree) only once the copies are done
    await s.synchronize()
    assert (down.numpy() == 9).all()
    # frees wait on the host for a marker on each stream that used the memory; once they
    # complete, the markers go back to a pool of at most MARKER_POOL
    from aiostream import _backends
    from aiostream._backends.cuda.devices import MARKER_POOL
    streams = [ais.Stream("cuda:0") for _ in range(4)]
    bufs = [ais.DeviceBuffer(256, "cuda:0") for _ in range(50)]
    for t in streams:
        ais.delay(60.0, stream=t)  # pending however slow the machine
        for b in bufs:
            b.record_stream(t)
    del b, bufs
    gc.collect()
    assert _backends.get("cuda").held(0)["events"] >= 200  # the frees wait for them
    hurry()  # the kernels end now
    for t in streams:
        await t.synchronize()
    ais.DeviceBuffer(256, "cuda:0")  # an allocation frees what is done
    gc.collect()
    assert _backends.get("cuda").held(0)["events"] <= MARKER_POOL + 1
    print("ok", flush=True)

anyio.run(main)
"""


@needs_stand_in
def test_devices_without_memory_pools_allocate_and_free_in_order() -> None:
    proc = program(NO_POOLS, FAKE_CUDA_NO_POOLS="1")
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


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


CANCELLED_AT_EXIT = """
import sys, time, anyio, aiostream as ais

loop, strategy, kernel_s = sys.argv[1], sys.argv[2], float(sys.argv[3])

async def main():
    s = ais.Stream("cuda:0")
    ais.delay(kernel_s, stream=s)
    with anyio.move_on_after(0.05):
        await s.synchronize(strategy=strategy)
    time.sleep(0.05)  # a thread is blocked on the kernel now
    print("leaving", flush=True)

anyio.run(main, backend=loop)
"""


@pytest.mark.parametrize(
    ("loop", "strategy"),
    [("asyncio", "thread"), ("asyncio", "hybrid"), ("trio", "thread"), ("asyncio", "callback")],
)
def test_exit_is_never_held_by_device_work(loop: str, strategy: str) -> None:
    """A wait cancelled while a long kernel runs: the interpreter exits at once; the context,
    busy with the kernel, is left to the exit (the stand-in allows its live handles then)."""
    kernel_s = "60" if FAKE is None else "6"
    start = time.monotonic()
    proc = program(CANCELLED_AT_EXIT, loop, strategy, kernel_s, timeout=30)
    took = time.monotonic() - start
    assert proc.returncode == 0 and "leaving" in proc.stdout, proc.stderr
    assert took < 5.0, f"exit took {took:.1f} s"
    assert "violation" not in proc.stderr, proc.stderr


DROPPED_AT_EXIT = """
import gc, anyio, aiostream as ais

async def main():
    s = ais.Stream("cuda:0")
    ais.delay(2.0, stream=s)
    e = s.record_event()  # its mark: a value the device will write into pinned memory
    with anyio.move_on_after(0.02):
        await e.synchronize()
    del s, e  # the stream is destroyed with its work pending
    gc.collect()
    print("leaving", flush=True)

anyio.run(main)
"""


@needs_stand_in
def test_exit_frees_no_flag_memory_that_a_dropped_streams_work_will_write() -> None:
    """At exit, flag memory that pending work will still write is left to the process's
    exit, also when the stream that work runs on is gone (it can no longer be queried)."""
    proc = program(DROPPED_AT_EXIT)
    assert proc.returncode == 0 and "leaving" in proc.stdout, proc.stderr
    assert "violation" not in proc.stderr, proc.stderr


DROPPED_BUSY_AT_EXIT = """
import gc, logging, aiostream as ais
logging.basicConfig(level=logging.DEBUG, format="%(name)s: %(message)s")
s = ais.Stream("cuda:0")
ais.delay(2.0, stream=s)
del s  # destroyed: the driver lets its work run on
gc.collect()
print("leaving", flush=True)
"""


@needs_stand_in
def test_exit_sees_work_pending_on_a_stream_already_destroyed() -> None:
    """A stream dropped with work pending is destroyed at once; at exit its context is still
    seen busy and left to the exit, not reset under that work (which could wait for it)."""
    proc = program(DROPPED_BUSY_AT_EXIT, FAKE_CUDA_TRACE="1")
    assert proc.returncode == 0 and "leaving" in proc.stdout, proc.stderr
    assert "reset with work pending" not in proc.stderr, proc.stderr
    assert "at exit: 0 violation(s), 0 handle(s) leaked at a context reset, 0 live" in (
        proc.stderr
    ), proc.stderr
    assert (
        "aiostream: cuda:0: work that may use its context is pending at close: the context is "
        "left to the exit\n"
    ) in proc.stderr, proc.stderr


USED_ELSEWHERE_AT_EXIT = """
import gc, logging, sys, anyio, aiostream as ais
logging.basicConfig(level=logging.DEBUG, format="%(name)s: %(message)s")

async def main():
    up = ais.HostBuffer(1 << 16, device="cuda:0")
    s1 = ais.Stream("cuda:1")
    with ais.use_stream(s1):
        dev = ais.DeviceBuffer(1 << 16, "cuda:1")
    if sys.argv[1] == "copy-pending":
        ais.delay(2.0, stream=s1)
        ais.copy_async(dev, up, stream=s1)  # reads cuda:0's pinned memory in 2 s
    else:  # the copy is over, but the work after it, which the free waits for, is not
        ais.copy_async(dev, up, stream=s1)
        await s1.synchronize()
        ais.delay(2.0, stream=s1)
    del up, dev, s1
    gc.collect()
    print("leaving", flush=True)

anyio.run(main)
"""


@needs_stand_in
@pytest.mark.parametrize("case", ["copy-pending", "later-work-pending"])
def test_exit_keeps_a_context_whose_memory_another_devices_pending_work_uses(case: str) -> None:
    """Pinned memory of cuda:0 that a copy on cuda:1 reads, dropped while cuda:1 has work
    pending (the copy, or work after it that the free must wait for): at exit cuda:0's
    context, idle itself, is left to the exit with that memory, not released (which would
    free it under the copy); nothing is reset under pending work, nothing leaks."""
    proc = program(USED_ELSEWHERE_AT_EXIT, case, FAKE_CUDA_DEVICES="2", FAKE_CUDA_TRACE="1")
    assert proc.returncode == 0 and "leaving" in proc.stdout, proc.stderr
    assert "at exit: 0 violation(s), 0 handle(s) leaked at a context reset, 0 live" in (
        proc.stderr
    ), proc.stderr
    assert "cuda:0 reset" not in proc.stderr, proc.stderr
    assert (
        "aiostream: cuda:0: 1 buffer(s) may still be in use by another device's pending work "
        "at close: they are left to the exit, with the context\n"
    ) in proc.stderr, proc.stderr


HELD_ELSEWHERE = """
import ctypes, anyio, aiostream as ais
lib = ctypes.CDLL("libcuda.so.1")
s = ais.Stream("cuda:0")
assert lib.fake_cuda_hold_primary(0, 1) == 0  # another library holds the primary context

async def main():
    ais.delay(0.2, stream=s)
    with anyio.move_on_after(0.02):
        await s.synchronize(strategy="callback")
    print("leaving", flush=True)

anyio.run(main)
"""


@needs_stand_in
def test_host_functions_pending_at_exit_run_no_python() -> None:
    """With the context held by another library, aiostream's release does not reset it: a
    host function still pending then runs after the interpreter has finalized. It is a C
    function, so that is harmless."""
    proc = program(HELD_ELSEWHERE)
    assert proc.returncode == 0 and "leaving" in proc.stdout, proc.stderr
    assert "violation" not in proc.stderr, proc.stderr


# ---------------------------------------------------------------------- streams held by memory


def test_memory_of_another_library_whose_release_fails_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A free never raises: a failing release of imported memory is logged, word for word."""

    def release() -> None:
        raise RuntimeError("its owner is gone")

    backend: Any = _backends.get("cuda")
    mem = backend.memory_wrap(0, 4096, 64, release)
    with caplog.at_level("WARNING", logger="aiostream"):
        backend.device_free(mem)
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert said == [
        "releasing memory of another library failed: RuntimeError('its owner is gone')"
    ], said


def test_the_watcher_thread_never_holds_the_exit() -> None:
    """The watcher is a daemon thread: the interpreter's exit never joins it."""
    s = ais.Stream(DEV)
    ais.delay(0.001, stream=s)
    s.synchronize_blocking()
    watchers = [t for t in threading.enumerate() if t.name == f"aiostream {DEV} watcher"]
    assert watchers and all(t.daemon for t in watchers), watchers


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
    backend = _backends.get("cuda")
    s, t = ais.Stream(DEV), ais.Stream(DEV)
    for _ in range(3):
        with ais.use_stream(s):
            buf = ais.DeviceBuffer(N, DEV)
        buf.record_stream(t)
        ais.delay(0.002, stream=t)
        del buf
        gc.collect()
    pools = backend._devices.get(0).pools  # type: ignore[attr-defined]
    assert backend.held(0)["streams"] == (1 if pools else 0)  # type: ignore[attr-defined]
    t.synchronize_blocking()
