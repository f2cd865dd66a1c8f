"""DLPack: device buffers exported (``__dlpack__``, ``__dlpack_device__``) and other libraries'
arrays wrapped (``from_dlpack``).

On virtual devices the memory is exported as host memory, which NumPy reads; on CUDA (a GPU or
the stand-in driver) the consumer's stream is ordered after the buffer's work on the device,
and ``from_dlpack`` is tested with stand-in producers that hand over capsules of other device
buffers (PyTorch, CuPy and JAX themselves run in the GPU suite). Every export must be released
once the test is over: the ``exports`` fixture notes each buffer exported, which the export
keeps alive until the consumer is done with it.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import aiostream as ais
from tests.helpers.stand_in import OK

needs_cuda = pytest.mark.cuda
DEV = "cuda:0"


# DLPack's C structures (dlpack.h, version 1.0): what a consumer reads in a capsule


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


READ_ONLY = 1 << 0  # DLPACK_FLAG_BITMASK_READ_ONLY
INT = 0  # kDLInt


def capsule_name(capsule: object) -> str:
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    return get_name(capsule).decode()


def managed(capsule: object) -> Any:
    """The DLManagedTensorVersioned inside an unused versioned capsule (to read or spoil it)."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return DLManagedTensorVersioned.from_address(get(capsule, b"dltensor_versioned"))


class Exports:
    """The buffers exported (``__dlpack__``) during a test, as weak references: an export keeps
    its buffer alive until the consumer is done with it (or until its capsule, never
    consumed, is collected), so those alive once the test has let go of them are exports
    still pending."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref[ais.DeviceBuffer]] = []

    def pending(self) -> int:
        """How many of the buffers exported are still alive."""
        return sum(ref() is not None for ref in self.refs)

    def settle(self) -> None:
        """Collect, until the exports handed out are all released (a released foreign buffer
        is freed once its streams' work is seen complete, at the next allocation on CUDA)."""
        for _ in range(200):
            gc.collect()
            if not self.pending():
                return
            for index in range(ais.device_count("cuda") if OK else 0):
                ais.DeviceBuffer(1, f"cuda:{index}")  # its device frees what may be freed
            time.sleep(0.005)


@pytest.fixture(autouse=True)
def exports(monkeypatch: pytest.MonkeyPatch) -> Iterator[Exports]:
    """Each buffer the test exports is noted; once the test is over, every export must be
    released."""
    noted = Exports()
    export = ais.DeviceBuffer.__dlpack__

    def noting(self: ais.DeviceBuffer, *args: Any, **kwargs: Any) -> Any:
        capsule = export(self, *args, **kwargs)
        noted.refs.append(weakref.ref(self))
        return capsule

    monkeypatch.setattr(ais.DeviceBuffer, "__dlpack__", noting)
    yield noted
    noted.settle()
    assert noted.pending() == 0, "an exported tensor was never released"


def filled(values: list[float], device: str, stream: ais.Stream | None = None) -> ais.DeviceBuffer:
    """A float32 device buffer that a copy on ``stream`` fills with ``values``."""
    host = ais.HostBuffer(4 * len(values), device=device)
    host.numpy(np.float32)[:] = values
    buf = ais.DeviceBuffer(host.nbytes, device)
    ais.copy_async(buf, host, stream=stream)
    return buf.view(np.float32)


# ---------------------------------------------------------------------- virtual: host memory


def test_a_virtual_buffer_is_exported_as_host_memory_without_a_copy(
    clock: ais.virtual.VirtualClock,
) -> None:
    buf = filled([1, 2, 3, 4, 5, 6], "virtual:0")
    clock.advance(1.0)
    assert buf.__dlpack_device__() == (1, 0)  # kDLCPU, 0
    grid = np.from_dlpack(buf.view(np.float32, (2, 3)))
    assert grid.tolist() == [[1, 2, 3], [4, 5, 6]]
    grid[1, 2] = 60  # the consumer's array is the buffer's memory
    out = ais.HostBuffer(24, device="virtual:0")
    ais.copy_async(out, buf)
    clock.advance(1.0)
    assert out.numpy(np.float32).tolist() == [1, 2, 3, 4, 5, 60]
    assert ais.virtual.races() == []


def test_the_export_keeps_the_buffer_alive(
    clock: ais.virtual.VirtualClock, exports: Exports
) -> None:
    before = ais.virtual.stats().buffers
    array = np.from_dlpack(filled([7, 8], "virtual:0"))
    clock.advance(1.0)
    gc.collect()
    assert ais.virtual.stats().buffers == before + 1  # held by the array alone
    assert array.tolist() == [7, 8]
    del array
    gc.collect()
    assert ais.virtual.stats().buffers == before and exports.pending() == 0


def test_a_capsule_never_consumed_releases_the_buffer(
    clock: ais.virtual.VirtualClock, exports: Exports
) -> None:
    before = ais.virtual.stats().buffers
    capsule = ais.DeviceBuffer(8, "virtual:0").__dlpack__()
    gc.collect()
    assert ais.virtual.stats().buffers == before + 1 and exports.pending() == 1
    del capsule
    gc.collect()
    assert ais.virtual.stats().buffers == before and exports.pending() == 0


@pytest.mark.parametrize("device", ["virtual:0", pytest.param(DEV, marks=needs_cuda)])
def test_a_consumer_that_refuses_the_capsule_raises_its_own_error(
    device: str, exports: Exports, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NumPy refuses a tensor of 70 dimensions (and any CUDA memory) after taking the capsule,
    and drops it with its error set: that error reaches the caller, nothing is reported as
    unraisable, and the export is released."""
    unraisable: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    buf = ais.DeviceBuffer(4, device).view(np.float32, (1,) * 70)
    with pytest.raises(RuntimeError) as refused:
        np.from_dlpack(buf)
    assert type(refused.value) is not SystemError  # noqa: E721
    assert "DLPack" in str(refused.value) or "device" in str(refused.value)
    del buf, refused
    gc.collect()
    assert unraisable == []
    assert exports.pending() == 0


def test_reading_an_export_while_a_copy_lands_is_a_race(clock: ais.virtual.VirtualClock) -> None:
    ais.virtual.reset(clock=clock, bandwidth=16.0)  # 16 bytes take a second
    buf = filled([5, 5, 5, 5], "virtual:0")
    clock.advance(0.5)  # the copy runs from 0 to 1 s
    early = np.from_dlpack(buf)
    assert set(early.view(np.uint8).tolist()) == {ais.virtual.POISON}
    races = ais.virtual.races(clear=True)
    assert len(races) == 1 and "'copy h2d'" in races[0].copy
    assert "test_reading_an_export_while_a_copy_lands_is_a_race" in races[0].where
    clock.advance(1.0)
    assert early.tolist() == [5, 5, 5, 5]
    assert np.from_dlpack(buf).tolist() == [5, 5, 5, 5]  # after the copy: no race
    assert ais.virtual.races() == []


def test_versioned_capsules_when_the_consumer_reads_them() -> None:
    buf = ais.DeviceBuffer(8, "virtual:0")
    assert capsule_name(buf.__dlpack__()) == "dltensor"
    assert capsule_name(buf.__dlpack__(max_version=(0, 8))) == "dltensor"
    assert capsule_name(buf.__dlpack__(max_version=(1, 0))) == "dltensor_versioned"
    assert capsule_name(buf.__dlpack__(max_version=(2, 3))) == "dltensor_versioned"
    capsule = buf.view(np.int16, (2, 2)).__dlpack__(max_version=(1, 1))
    read = managed(capsule)  # as a consumer reads it
    tensor = read.dl_tensor
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    dtype = (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes)
    nbytes = shape[0] * shape[1] * tensor.dtype.bits * tensor.dtype.lanes // 8
    assert (shape, dtype, nbytes) == ((2, 2), (INT, 16, 1), 8)
    assert (tensor.device.device_type, tensor.device.device_id) == (1, 0)
    assert not read.flags & READ_ONLY
    del read, tensor, capsule  # never consumed: the next sweep releases the export


def test_an_empty_virtual_buffer_is_exported_with_no_address() -> None:
    """A buffer of no bytes has no memory to point at: its tensor's data is NULL, as DLPack
    allows for a tensor of no elements, and a consumer reads an empty array."""
    buf = ais.DeviceBuffer(0, "virtual:0")
    capsule = buf.__dlpack__(max_version=(1, 0))
    tensor = managed(capsule).dl_tensor
    assert tensor.data is None and tensor.shape[0] == 0
    del capsule
    assert np.from_dlpack(buf).shape == (0,)


def test_export_arguments_are_checked_as_the_standard_says() -> None:
    buf = ais.DeviceBuffer(8, "virtual:0")
    with pytest.raises(BufferError, match=r"copy=True\) is not supported"):
        buf.__dlpack__(copy=True)
    with pytest.raises(BufferError, match=r"not on \(2, 0\)"):
        buf.__dlpack__(dl_device=(2, 0))
    assert capsule_name(buf.__dlpack__(dl_device=(1, 0), copy=False)) == "dltensor"
    with pytest.raises(ValueError, match="stream must be None for memory exported as host"):
        buf.__dlpack__(stream=5)
    with pytest.raises(TypeError, match="max_version must be None or a"):
        buf.__dlpack__(max_version="1.0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dl_device must be None or a"):
        buf.__dlpack__(dl_device=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="copy must be True, False or None"):
        buf.__dlpack__(copy=1)  # type: ignore[arg-type]
    for dtype in ("V4", ">f4"):
        with pytest.raises(BufferError, match="has no DLPack equivalent"):
            buf.view(dtype).__dlpack__()
    ais.virtual.reset()
    with pytest.raises(ais.StaleHandleError):
        buf.__dlpack__()


def test_from_dlpack_refuses_host_arrays_and_points_to_host_buffers() -> None:
    with pytest.raises(ValueError) as refused:
        ais.from_dlpack(np.arange(4.0))
    assert str(refused.value) == (
        "from_dlpack() wraps CUDA device memory, and this array is in host memory (DLPack "
        "device type 1, CPU): put it in an aiostream.HostBuffer (HostBuffer(a.nbytes, "
        "device=...).numpy(a.dtype, a.shape)[:] = a) and copy it to a DeviceBuffer with "
        "copy_async"
    )
    with pytest.raises(ValueError, match="in host memory"):
        ais.from_dlpack(ais.DeviceBuffer(8, "virtual:0"))  # a virtual buffer is host memory
    with pytest.raises(TypeError) as caught:
        ais.from_dlpack([1.0, 2.0])
    assert str(caught.value) == (
        "from_dlpack() needs an array that speaks DLPack (__dlpack__ and __dlpack_device__: "
        "a PyTorch tensor, a CuPy or JAX array); got [1.0, 2.0] of type list"
    )
    with pytest.raises(ValueError) as negative:
        ais.from_dlpack(_Producer(None, device=(2, -1)))
    assert str(negative.value) == "the DLPack device id must be >= 0, got -1"
    with pytest.raises(ValueError, match="DLPack device type 13"):
        ais.from_dlpack(_Producer(None, device=(13, 0)))
    with pytest.raises(TypeError, match=r"must return \(device_type, device_id\)"):
        ais.from_dlpack(_Producer(None, device="cuda"))


# ---------------------------------------------------------------------- CUDA: stream order


class _Producer:
    """A stand-in for PyTorch or CuPy: hands over a capsule of an aiostream buffer (its
    ``__dlpack__`` with the consumer's arguments), and remembers what it was asked."""

    def __init__(self, buf: Any, *, device: object = (2, 0), legacy: bool = False) -> None:
        self.buf, self.device, self.legacy = buf, device, legacy
        self.asked: list[dict[str, Any]] = []
        self.spoil: Any = None

    def __dlpack_device__(self) -> object:
        return self.device

    def __dlpack__(self, **kwargs: Any) -> Any:
        self.asked.append(kwargs)
        if self.legacy and "max_version" in kwargs:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        capsule = self.buf.__dlpack__(**kwargs)
        if self.spoil is not None:
            self.spoil(managed(capsule))
        return capsule


@needs_cuda
async def test_cuda_the_consumer_stream_waits_on_the_device_never_the_host(
    anyio_backend: Any,
) -> None:
    work, consumer = ais.Stream(DEV), ais.Stream(DEV)
    ais.delay(0.3, stream=work)
    buf = filled([1, 2, 3, 4], DEV, work)  # lands after 0.3 s
    buf.__dlpack__(stream=consumer.stream_id, max_version=(1, 0))
    assert not work.query()  # no host wait for the buffer's work
    after = consumer.record_event()
    assert not after.query()  # the consumer's later work waits for it
    await after.synchronize()
    assert work.query()


@needs_cuda
def test_cuda_the_consumer_stream_waits_for_the_other_users_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Exported to a stream, a buffer makes that stream wait for every other stream that used
    it (one ``cuStreamWaitEvent`` each), and not for itself: its own work is in order already."""
    from cuda.bindings import driver

    waits = []
    wait = driver.cuStreamWaitEvent

    def spy(stream: Any, event: Any, flags: int) -> Any:
        waits.append(int(stream))
        return wait(stream, event, flags)

    work, other = ais.Stream(DEV), ais.Stream(DEV)
    with ais.use_stream(work):
        buf = ais.DeviceBuffer(64, DEV)
    monkeypatch.setattr(driver, "cuStreamWaitEvent", spy)
    buf.__dlpack__(stream=work.stream_id, max_version=(1, 0))
    assert waits == []  # its only user is the consumer itself
    buf.record_stream(other)  # (its first use waits for the allocation)
    waits.clear()
    buf.__dlpack__(stream=work.stream_id, max_version=(1, 0))
    assert waits == [work.stream_id]  # the consumer waits once, for the other user
    work.synchronize_blocking()


@needs_cuda
async def test_cuda_stream_values_of_the_standard(anyio_backend: Any) -> None:
    work = ais.Stream(DEV)
    ais.delay(0.3, stream=work)
    buf = filled([1, 2], DEV, work)
    consumer = ais.Stream(DEV)
    buf.__dlpack__(stream=-1)  # no synchronization
    await consumer.record_event().synchronize()
    assert not work.query()  # the consumer did not wait for it
    buf.__dlpack__()  # None: the legacy default stream waits
    assert not ais.default_stream(DEV).record_event().query()
    for bad, error in ((0, "stream=0 is ambiguous"), (-2, "must be -1"), (1 << 64, "pointer")):
        with pytest.raises(ValueError, match=error):
            buf.__dlpack__(stream=bad)
    with pytest.raises(TypeError, match="stream must be an int"):
        buf.__dlpack__(stream=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="copy=False forbids one"):
        buf.__dlpack__(dl_device=(1, 0), copy=False)
    with pytest.raises(BufferError, match=r"not on \(1, 0\).*HostBuffer"):
        buf.__dlpack__(dl_device=(1, 0))
    assert buf.__dlpack_device__() == (2, 0)
    await work.synchronize()


@needs_cuda
async def test_cuda_from_dlpack_wraps_without_a_copy_in_stream_order(anyio_backend: Any) -> None:
    work, mine = ais.Stream(DEV), ais.Stream(DEV)
    ais.delay(0.3, stream=work)
    source = filled([1, 2, 3, 4, 5, 6], DEV, work)
    producer = _Producer(source.view(np.float32, (2, 3)))
    wrapped = ais.from_dlpack(producer, stream=mine)
    assert producer.asked == [{"stream": mine.stream_id, "max_version": (1, 0)}]
    assert (wrapped.dtype, wrapped.shape, wrapped.nbytes) == (np.float32, (2, 3), 24)
    ptr = wrapped.__cuda_array_interface__["data"][0]
    assert ptr == source.__cuda_array_interface__["data"][0]  # the same memory
    assert wrapped.__cuda_array_interface__["stream"] == mine.stream_id
    out = ais.HostBuffer(24, device=DEV)
    ais.copy_async(out, wrapped, stream=mine)  # ordered after the producer's work
    await mine.synchronize()
    assert out.numpy(np.float32).tolist() == [1, 2, 3, 4, 5, 6]


@needs_cuda
async def test_cuda_the_wrapped_buffer_keeps_the_producer_alive(
    anyio_backend: Any, exports: Exports
) -> None:
    source = filled([9, 8], DEV)
    producer = _Producer(source)
    alive = weakref.ref(producer)
    wrapped = ais.from_dlpack(producer)
    del producer, source
    gc.collect()
    assert alive() is not None and exports.pending() == 1
    out = ais.HostBuffer(8, device=DEV)
    ais.copy_async(out, wrapped)
    await ais.current_stream(DEV).synchronize()
    assert out.numpy(np.float32).tolist() == [9, 8]
    del wrapped
    exports.settle()
    assert alive() is None and exports.pending() == 0


@needs_cuda
async def test_cuda_the_producer_is_released_only_after_the_work_that_used_it(
    anyio_backend: Any,
    exports: Exports,
) -> None:
    wrapped = ais.from_dlpack(_Producer(filled([3, 4], DEV)))
    s = ais.Stream(DEV)
    ais.delay(0.3, stream=s)
    ais.copy_async(ais.DeviceBuffer(8, DEV), wrapped, stream=s)  # uses it after 0.3 s
    del wrapped
    gc.collect()
    ais.DeviceBuffer(1, DEV)  # an allocation frees what may be freed
    assert exports.pending() == 1  # the copy still needs it
    await s.synchronize()
    exports.settle()
    assert exports.pending() == 0


@needs_cuda
async def test_cuda_the_producer_is_released_after_the_consumer_stream_s_work(
    anyio_backend: Any,
    exports: Exports,
) -> None:
    """Work of another library on the stream given to from_dlpack uses the memory (a copy
    from it, made by its own driver call, held by a gate): the producer's memory is released
    only after it, though aiostream never saw that work, which reads the producer's bytes."""
    from tests.helpers.cuda import primary_context
    from tests.helpers.gate import gated, sweep

    mine = ais.Stream(DEV)
    wrapped = ais.from_dlpack(_Producer(filled([3, 4], DEV)), stream=mine)
    out = ais.HostBuffer(8, device=DEV)
    with gated(mine):
        with primary_context() as cu:  # the other library's work, which reads it
            address = wrapped.__cuda_array_interface__["data"][0]
            copied = cu.cuMemcpyDtoHAsync(
                out.numpy().ctypes.data, cu.CUdeviceptr(address), 8, cu.CUstream(mine.stream_id)
            )
        assert copied == (cu.CUresult.CUDA_SUCCESS,)
        del wrapped
        gc.collect()
        ais.DeviceBuffer(1, DEV)  # an allocation frees what may be freed
        assert exports.pending() == 1  # the work still reads it
    await mine.synchronize()
    assert sweep() == 0  # the gate's word is freed (the tests here reset contexts)
    exports.settle()
    assert exports.pending() == 0
    assert out.numpy(np.float32).tolist() == [3, 4]


@needs_cuda
def test_cuda_a_legacy_producer_is_asked_again_without_max_version() -> None:
    producer = _Producer(filled([1.5], DEV), legacy=True)
    wrapped = ais.from_dlpack(producer)
    assert [sorted(a) for a in producer.asked] == [["max_version", "stream"], ["stream"]]
    assert wrapped.dtype == np.float32 and wrapped.shape == (1,)


@needs_cuda
def test_cuda_capsules_from_dlpack_cannot_wrap_are_refused_and_released(exports: Exports) -> None:
    def strided(m: Any) -> None:
        m.dl_tensor.strides[0] = 2

    def bfloat16(m: Any) -> None:
        m.dl_tensor.dtype.code = 4  # kDLBfloat

    def elsewhere(m: Any) -> None:
        m.dl_tensor.device.device_type = 13

    for spoil, error in (
        (strided, "not C-contiguous"),
        (bfloat16, "no NumPy equivalent"),
        (elsewhere, r"capsule describes DLPack device \(13, 0\)"),
    ):
        producer = _Producer(filled([1, 2, 3, 4], DEV))
        producer.spoil = spoil
        with pytest.raises(BufferError, match=error):
            ais.from_dlpack(producer)
        del producer
        exports.settle()
        assert exports.pending() == 0, spoil.__name__
    with pytest.raises(TypeError, match="stream must be an aiostream.Stream"):
        ais.from_dlpack(_Producer(filled([1], DEV)), stream=1)  # type: ignore[arg-type]


@needs_cuda
async def test_cuda_memory_a_producer_exported_read_only_is_not_written(
    anyio_backend: Any,
) -> None:
    """A capsule whose flags say read-only (DLPack 1.x): the buffer wrapped (and its views)
    is refused as a copy's destination, read as a source, and exported read-only again."""

    def read_only(m: Any) -> None:
        m.flags |= 1  # DLPACK_FLAG_BITMASK_READ_ONLY

    producer = _Producer(filled([1, 2, 3, 4], DEV))
    producer.spoil = read_only
    wrapped = ais.from_dlpack(producer)
    host = ais.HostBuffer(wrapped.nbytes, device=DEV)
    for dst in (wrapped, wrapped.view(np.uint8)):
        with pytest.raises(ValueError) as caught:
            ais.copy_async(dst, host)
        assert str(caught.value) == (
            "dst is read-only: its DLPack producer exported it so (the capsule's read-only "
            "flag); copy into a buffer of your own"
        )
    ais.copy_async(host, wrapped)  # reading it is what it is for
    await ais.current_stream(DEV)
    assert host.numpy(np.float32).tolist() == [1, 2, 3, 4]
    again = wrapped.__dlpack__(max_version=(1, 0))
    assert managed(again).flags & 1
    assert wrapped.__cuda_array_interface__["data"][1] is True  # read-only
    with pytest.raises(BufferError, match="a legacy .* capsule cannot say"):
        wrapped.__dlpack__()  # a consumer of DLPack 0.x could write it
    writable = ais.from_dlpack(_Producer(filled([5], DEV)))
    ais.copy_async(writable, ais.HostBuffer(4, device=DEV))  # a writable one is written
    await ais.current_stream(DEV)
    del again


@needs_cuda
def test_cuda_from_dlpack_on_a_second_device() -> None:
    if ais.device_count("cuda") < 2:
        pytest.skip("needs two CUDA devices")
    source = filled([1, 2], "cuda:1")
    wrapped = ais.from_dlpack(_Producer(source, device=(2, 1)))
    assert wrapped.device == ais.Device("cuda", 1)
    with pytest.raises(ValueError, match="the stream on cuda:0"):
        ais.from_dlpack(_Producer(source, device=(2, 1)), stream=ais.Stream(DEV))


async def test_a_round_trip_through_numpy_on_every_loop(anyio_backend: Any) -> None:
    """The async path: a copy awaited, then the export read (virtual, real time)."""
    buf = filled([1, 2, 3], "virtual:0")
    await ais.current_stream("virtual:0").synchronize()
    assert np.from_dlpack(buf).tolist() == [1, 2, 3]
    await anyio.sleep(0)
    ais.virtual.assert_no_races()
