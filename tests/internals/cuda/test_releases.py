"""The CUDA backend's releases at close, white-box: a failed release of the program's
handles or of the backend's own (its markers, its free stream, its health event) is said
once, and the handle is left for the user to release; a closed backend opens no device.

These take the handles to release by hand from the backend's devices, or spy on its driver
object, so they live here; the rest of the close is tested in
``tests/cuda/test_close_and_exit.py``.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest

import aiostream as ais
from tests.helpers.cuda import DEV, N, close_with_a_failed_release, primary_context, ptr

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


# ------------------------------------------------------- failed releases


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


@pytest.mark.parametrize("call", ["cuStreamDestroy", "cuEventDestroy"])
def test_a_failed_release_of_the_backend_s_own_handles_is_said_at_close(
    own_backend: Any, caplog: pytest.LogCaptureFixture, call: str
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
    dev.watcher.check()  # its health event exists: close destroys it first, then the markers
    nth = 2 if call == "cuEventDestroy" else 1
    (failed,) = close_with_a_failed_release(own_backend, caplog, call, [], nth)
    assert own.get(failed) == ("stream" if call == "cuStreamDestroy" else "event")
    with primary_context() as cu:  # the handle the failed call left, released as a user would
        assert getattr(cu, call)(failed) == (cu.CUresult.CUDA_SUCCESS,)


# ------------------------------------------------------ a closed backend


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
