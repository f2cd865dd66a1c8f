"""The CUDA backend's marker events, white-box: each device's bounded pool of markers (the
markers of memory frees, and the marks of devices that write no values), and the frees that
wait in the device's list for their markers.

These read the pool's bound (``MARKER_POOL``), the device's markers and its list of frees,
or switch a device's value writes off, so they live here.
"""

from __future__ import annotations

import gc
from typing import Any

import anyio
import pytest

import aiostream as ais
from aiostream import _backends
from tests.helpers.cuda import (
    DEV,
    N,
    a_failed_call_is_raised_where_it_was_made,
    device_finishes,
    primary_context,
    program,
)
from tests.helpers.faults import calls, failing, succeeded
from tests.helpers.protocol import STRATEGIES
from tests.helpers.stand_in import EVENTS, FAKE, PINNED

NOT_SUPPORTED = 801  # CUDA_ERROR_NOT_SUPPORTED: a driver without stream memory operations

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


# -------------------------------------------------------------- the pool


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


def test_a_device_keeps_so_many_idle_markers_and_destroys_the_rest(own_backend: Any) -> None:
    """Markers given back go to the device's pool until it holds ``MARKER_POOL``; the rest are
    destroyed at once. Close destroys the pool and every marker in use; one of those given
    back after close is neither kept nor destroyed a second time."""
    from aiostream._backends.cuda.devices import MARKER_POOL

    def destroyed(made: dict[str, list[Any]]) -> list[int]:
        return [int(args[0]) for args, result in made["cuEventDestroy"] if int(result[0]) == 0]

    ais.Stream(DEV)
    dev = own_backend._devices.get(0)
    before = FAKE.fake_cuda_live(EVENTS) if FAKE is not None else 0
    with calls("cuEventCreate", "cuEventDestroy") as made:
        markers = [dev.marker() for _ in range(MARKER_POOL + 3)]
        assert succeeded(made["cuEventCreate"]) == MARKER_POOL + 3
        assert [int(m) for m in markers] == [int(r[1]) for _, r in made["cuEventCreate"]]
        for marker in markers[:-1]:
            dev.give_back(marker)
        assert dev.markers == markers[:MARKER_POOL]
        # the pool and one in use are left; the two given back past the pool, destroyed
        assert destroyed(made) == [int(m) for m in markers[MARKER_POOL:-1]]
        if FAKE is not None:
            assert FAKE.fake_cuda_live(EVENTS) == before + MARKER_POOL + 1
        assert dev.marker() is markers[MARKER_POOL - 1]  # taken from the pool, last in first out
        own_backend.close()
        gone = destroyed(made)
        assert {int(m) for m in markers} <= set(gone)  # every marker, in the pool or in use
        assert len(gone) == len(set(gone))  # each destroyed once
        if FAKE is not None:
            assert FAKE.fake_cuda_live(EVENTS) == before
        for marker in markers:
            dev.give_back(marker)  # neither kept nor destroyed a second time
        assert dev.markers == []
        assert destroyed(made) == gone
    if FAKE is not None:
        assert FAKE.fake_cuda_live(EVENTS) == before


def test_an_event_destroyed_gives_back_the_marker_its_record_took(own_backend: Any) -> None:
    """A device found unable to write values at an event's record (stream memory operations
    unsupported) marks that record with an internal marker event, which the event holds:
    destroyed, the event gives it back to the device's pool."""
    with failing("cuStreamWriteValue32", code=NOT_SUPPORTED) as fault:
        s = ais.Stream(DEV)
        ais.delay(0.001, stream=s)
        e = s.record_event()
    assert fault.failed
    dev = own_backend._devices.get(0)
    assert not dev.watcher.memops and not dev.markers
    del e
    gc.collect()
    assert len(dev.markers) == 1
    device_finishes()


async def test_devices_that_write_no_values_wait_on_marker_events(
    anyio_backend: object, own_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Where ``cuStreamWriteValue32`` is not supported, marks are internal events (the debug
    log says so once), waits of every strategy still end with their work, and each marker
    goes back to its pool when its last wait and event let go of it."""
    from aiostream._backends.cuda.devices import MARKER_POOL

    s, t = ais.Stream(DEV), ais.Stream(DEV)
    with failing("cuStreamWriteValue32", code=NOT_SUPPORTED) as fault:
        with caplog.at_level("DEBUG", logger="aiostream"):
            s.record_event()
            s.record_event()
    assert fault.made == 1  # asked once: the device writes no values from then on
    said = "cuda:0: no cuStreamWriteValue32: events mark waits"
    assert caplog.messages.count(said) == 1, caplog.messages
    t.__cuda_stream__()  # handed out: its event waits get no host function
    for _ in range(MARKER_POOL + 2):
        for strategy in STRATEGIES:
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


# --------------------------------------- frees waiting for their markers

NO_POOLS = """
import gc, numpy as np, anyio, aiostream as ais
from cuda.bindings import driver
from aiostream._backends.cuda.driver import ATTRIBUTE_MEMORY_POOLS_SUPPORTED
from tests.helpers.gate import gate, sweep

async def main():
    # the device says it has no memory pools, as a driver without them does (the stand-in
    # has none either, with FAKE_CUDA_NO_POOLS: a stream-ordered allocation would fail there)
    real = driver.cuDeviceGetAttribute
    def attribute(attr, device):
        err, value = real(attr, device)
        return (err, 0) if int(attr) == ATTRIBUTE_MEMORY_POOLS_SUPPORTED else (err, value)
    driver.cuDeviceGetAttribute = attribute
    s = ais.Stream("cuda:0")  # the device is opened
    driver.cuDeviceGetAttribute = real
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
    releases = [gate(t) for t in streams]  # pending however slow the machine
    for t in streams:
        ais.delay(0.001, stream=t)
        for b in bufs:
            b.record_stream(t)
    del b, bufs
    gc.collect()
    assert _backends.get("cuda").held(0)["events"] >= 200  # the frees wait for them
    for release in releases:  # the work goes on now
        release()
    for t in streams:
        await t.synchronize()
    sweep()  # the gates' words go back
    ais.DeviceBuffer(256, "cuda:0")  # an allocation frees what is done
    gc.collect()
    assert _backends.get("cuda").held(0)["events"] <= MARKER_POOL + 1
    print("ok", flush=True)

anyio.run(main)
"""


def test_devices_without_memory_pools_allocate_and_free_in_order() -> None:
    proc = program(NO_POOLS, FAKE_CUDA_NO_POOLS="1")
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


@pytest.mark.parametrize("what", ["the query of its marker", "its free"])
def test_a_free_in_a_context_that_cannot_be_made_current_is_said_at_close(
    own_backend: Any, caplog: pytest.LogCaptureFixture, what: str
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
    pinned = FAKE.fake_cuda_live(PINNED) if FAKE is not None else 0
    with calls("cuMemFreeHost") as made:
        with failing("cuCtxPushCurrent", 1 if "query" in what else 2) as fault:
            ais.HostBuffer(N, device=DEV)  # an allocation reaps first; its own push succeeds
        assert fault.failed
        assert not dev.freeing
        assert all(marker in dev.markers for _, marker in marks)  # back in the pool
        del buf, s
        gc.collect()
        # the buffer's stream-ordered free is over: close finds no work pending, which would
        # leave the sleep kernel's module to the exit (the exit would find it live)
        device_finishes()
        with caplog.at_level("WARNING", logger="aiostream"):
            own_backend.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    freed = [int(args[0]) for args, result in made["cuMemFreeHost"] if int(result[0]) == 0]
    if "query" in what:
        assert int(mem.ptr) in freed and warnings == []
        if FAKE is not None:
            assert FAKE.fake_cuda_live(PINNED) == pinned - 1
    else:
        assert int(mem.ptr) not in freed  # given up: the exit frees it
        if FAKE is not None:
            assert FAKE.fake_cuda_live(PINNED) == pinned
        with primary_context() as cu:  # as the exit would (the shared backend keeps the context)
            assert cu.cuMemFreeHost(mem.ptr) == (cu.CUresult.CUDA_SUCCESS,)
        assert warnings == [
            "aiostream could not release 1 CUDA handle(s) (the first: cuCtxPushCurrent failed "
            "on cuda:0: CUDA_ERROR_UNKNOWN (999): unknown error); the driver reclaims them "
            "with the context"
        ]


def _a_capture_with_marker_events(o: dict[str, Any]) -> object:
    """A stream's capture on a device that writes no values (a driver without stream memory
    operations): its mark is a marker event, recorded on the stream."""
    watcher = _backends.get("cuda")._devices.get(0).watcher  # type: ignore[attr-defined]
    watcher.memops = False
    try:
        ais.delay(0.01, stream=o["s"])
        return o["s"].synchronize_blocking()
    finally:
        watcher.memops = True


@pytest.mark.parametrize(
    "what", ["cuEventRecord (a stream's capture, without stream memory operations)"]
)
def test_every_driver_result_is_checked(what: str) -> None:
    """A driver call that fails raises a CudaError naming the call and its code, where the call
    was made, and leaves the device usable (the failure was not a sticky one): the case of
    ``tests/cuda/test_faults.py``'s test that switches the shared backend's value writes off
    for the while, which only its watcher can."""
    a_failed_call_is_raised_where_it_was_made(what, _a_capture_with_marker_events)
