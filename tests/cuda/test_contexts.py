"""The CUDA backend and the devices' contexts: every call makes its device's primary context
current and leaves the caller's as it was, from any thread; objects of one device never open
another's context, and a device that fails to open gives its own back; two devices' default
streams, both handle 0, are told apart.

Run where ``cuda:0`` works: on a GPU, and in CI's CUDA lane against the strict stand-in
driver (``tests/fake_cuda``), with one and two devices. The stand-in counts every breach of
the driver's contract it sees (the ``contract`` fixture fails a test that made one); its count
of context references is checked besides where it is the driver. Faults, and the contexts
retained and released, are seen at cuda-python's bindings (``tests/helpers/faults.py``), on
any driver.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import aiostream as ais
from tests.helpers.cuda import DEV, N, context_refs, current_context, two_devices
from tests.helpers.faults import calls, failing
from tests.helpers.protocol import STRATEGIES
from tests.helpers.stand_in import FAKE, hurry

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


# -------------------------------------------------------------- contexts


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
            ais.delay(0.5, stream=s)  # still running when queried, on a busy machine too
            ais.copy_async(down, dev, stream=s)
            e = s.record_event(ais.Event(DEV, enable_timing=True))
            assert not e.query()
            hurry()  # the stand-in ends it now; a GPU runs it out
            other = ais.Stream(DEV)
            other.wait_event(e)

            async def awaits() -> None:
                for strategy in STRATEGIES:
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
        for strategy in STRATEGIES:
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


# ------------------------------- one device's objects, another's context

RETAIN, RELEASE = "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease"


def devices(made: list[Any]) -> list[int]:
    """The devices whose primary context the calls :func:`calls` saw retained (or
    released), in order, those that worked."""
    return [int(args[0]) for args, result in made if int(result[0]) == 0]


def test_close_releases_each_device_s_own_context(own_backend: Any) -> None:
    """A backend that used only ``cuda:1`` holds a reference to its primary context, and
    close gives back that one: device 0's references are never touched."""
    two_devices()
    refs = context_refs() if FAKE is not None else []
    with calls(RETAIN, RELEASE) as seen:
        ais.Stream("cuda:1").record_event().synchronize_blocking()  # its mark's slot is free
        assert devices(seen[RETAIN]) == [1] and not seen[RELEASE]
        if FAKE is not None:
            assert context_refs() == [refs[0], refs[1] + 1]
        own_backend.close()
    assert devices(seen[RETAIN]) == devices(seen[RELEASE]) == [1]
    if FAKE is not None:
        assert context_refs() == refs


async def test_a_loader_on_one_device_opens_no_other(
    anyio_backend: object, own_backend: Any
) -> None:
    """A DataLoader on ``cuda:1`` makes its copy stream, its device buffers and its pinned
    staging buffers there: the default device's context is never opened (on a GPU it would
    take device memory the program never asked for)."""
    two_devices()
    refs = context_refs() if FAKE is not None else []
    source = (np.full(64, i, np.float32) for i in range(4))
    seen = []
    with calls(RETAIN, RELEASE) as contexts:
        out = ais.HostBuffer(256, device="cuda:1")
        async with ais.DataLoader(source, device="cuda:1", prefetch=2) as loader:
            async for batch in loader:
                assert batch.data.device == ais.device("cuda:1")
                ais.copy_async(out, batch.data)  # on the current stream: it waits for the batch
                await ais.current_stream("cuda:1").synchronize()
                seen.append(float(out.numpy(np.float32).mean()))
    assert seen == [0.0, 1.0, 2.0, 3.0]
    assert devices(contexts[RETAIN]) == [1] and not contexts[RELEASE]
    if FAKE is not None:
        assert context_refs() == [refs[0], refs[1] + 1]


def test_a_device_that_fails_to_open_gives_back_its_own_context(own_backend: Any) -> None:
    """A device whose opening fails after its primary context was retained (here the query of
    its stream priorities) releases that context, its own: the error names the call and the
    device, and no device's references change."""
    two_devices()
    refs = context_refs() if FAKE is not None else []
    with calls(RETAIN, RELEASE) as seen:
        with failing("cuCtxGetStreamPriorityRange"), pytest.raises(ais.CudaError) as info:
            ais.Stream("cuda:1")
    assert info.value.device == "cuda:1" and "cuCtxGetStreamPriorityRange" in str(info.value)
    assert devices(seen[RETAIN]) == devices(seen[RELEASE]) == [1]
    if FAKE is not None:
        assert context_refs() == refs


# -------------------------------------------------------- across devices


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
    """Every device's default stream is handle 0: a host buffer copied from on both devices'
    default streams is freed after both copies, however the streams are told apart. cuda:0's
    copy waits behind a kernel that outlasts cuda:1's (on the stand-in, until the test ends
    it): an allocation made once cuda:1 is done frees nothing cuda:0's copy still reads (the
    stand-in counts a copy from freed memory, and makes none), and that copy moves the bytes."""
    two_devices()
    host = ais.HostBuffer(N, device="cuda:0")
    host.numpy()[:] = 5
    on = [ais.DeviceBuffer(N, f"cuda:{i}") for i in (0, 1)]  # on each default stream
    ais.delay(3600.0 if FAKE is not None else 0.3, stream=ais.default_stream("cuda:0"))
    ais.delay(0.01, stream=ais.default_stream("cuda:1"))
    for dev in on:
        ais.copy_async(dev, host)  # one host buffer, both devices' default streams
    del host
    gc.collect()  # freed after both copies, however they are keyed
    await ais.default_stream("cuda:1").synchronize()
    ais.HostBuffer(64, device="cuda:0")  # an allocation frees what is due: not the host buffer
    hurry()  # cuda:0's kernel ends now (on a GPU, in its time), then its copy runs
    back = ais.HostBuffer(N, device="cuda:0")
    ais.copy_async(back, on[0])
    await ais.default_stream("cuda:0").synchronize()
    assert (back.numpy() == 5).all()
    ais.HostBuffer(64, device="cuda:0")  # both copies are done: an allocation frees it now
