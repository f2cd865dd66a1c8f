"""Host and device buffers, copies, the link model, poison and the race detector."""

from __future__ import annotations

import gc

import anyio
import numpy as np
import pytest

import aiostream as ais
from aiostream.testing import VirtualTime
from tests.helpers import virtual_loops
from tests.helpers.fuzzing import memory_cap

anyio_backend = virtual_loops.anyio_backend  # the module's loops: asyncio and trio

pytestmark = pytest.mark.anyio


def test_host_buffer_views_share_memory(virtual_device: ais.Device) -> None:
    buf = ais.HostBuffer(16)
    assert (buf.nbytes, buf.pinned, buf.device) == (16, True, virtual_device)
    floats = buf.numpy(np.float32)
    floats[:] = [1, 2, 3, 4]
    assert buf.numpy(np.float32, (2, 2)).tolist() == [[1, 2], [3, 4]]
    assert buf.numpy().shape == (16,)
    assert not ais.HostBuffer(8, pinned=False).pinned
    assert "16 bytes" in repr(buf)


def test_a_view_keeps_its_buffer_alive(virtual_device: ais.Device) -> None:
    """The buffer lives while a view of it does (through the view's ``.base``), on every
    backend: freed pinned memory is unmapped on CUDA, and a view outliving it would crash."""
    before = ais.virtual.stats().buffers
    view = ais.HostBuffer(64).numpy(np.float32, (4, 4))
    gc.collect()
    assert ais.virtual.stats().buffers == before + 1
    view[:] = 2.0
    assert view.sum() == 32.0
    row = view[1]  # a view of the view keeps it too
    del view
    gc.collect()
    assert ais.virtual.stats().buffers == before + 1 and row.tolist() == [2.0] * 4
    del row
    gc.collect()
    assert ais.virtual.stats().buffers == before


@pytest.mark.aiostream(devices=2)
async def test_a_host_buffer_serves_copies_on_any_device(virtual_time: VirtualTime) -> None:
    host, out = ais.HostBuffer(16, device="virtual:0"), ais.HostBuffer(16, device="virtual:0")
    host.numpy()[:] = 3
    s1 = ais.Stream("virtual:1")
    dev = ais.DeviceBuffer(16, "virtual:1")
    ais.copy_async(dev, host, stream=s1)
    ais.copy_async(out, dev, stream=s1)
    await s1.synchronize()
    assert out.numpy().tolist() == [3] * 16


@pytest.mark.aiostream(devices=2)
def test_record_stream_names_a_stream_of_the_buffers_device(virtual_device: ais.Device) -> None:
    buf = ais.DeviceBuffer(16)
    buf.record_stream(ais.Stream())
    buf.view(np.float32).record_stream(ais.default_stream())
    with pytest.raises(TypeError, match="stream must be an aiostream.Stream, got 0"):
        buf.record_stream(0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the buffer is on virtual:0, the stream on virtual:1"):
        buf.record_stream(ais.Stream("virtual:1"))


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        ((-1,), {}, ValueError, "nbytes must be >= 0"),
        (("8",), {}, TypeError, "nbytes must be an int"),
        ((8,), {"pinned": 1}, TypeError, "pinned must be True or False"),
    ],
)
def test_host_buffer_bad_input(
    virtual_device: ais.Device, args: tuple, kwargs: dict, exc: type, match: str
) -> None:
    with pytest.raises(exc, match=match):
        ais.HostBuffer(*args, **kwargs)


def test_views_must_fit(virtual_device: ais.Device) -> None:
    buf = ais.HostBuffer(10)
    with pytest.raises(ValueError, match="whole number of float32"):
        buf.numpy(np.float32)
    with pytest.raises(ValueError, match=r"shape \(3, 3\) of uint8 needs 9 bytes"):
        buf.numpy(np.uint8, (3, 3))
    dev = ais.DeviceBuffer(8)
    with pytest.raises(ValueError, match="needs 16 bytes"):
        dev.view(np.float32, (4,))
    with pytest.raises(ValueError, match="non-negative ints"):
        dev.view(np.uint8, (-8,))


def test_sizes_no_machine_holds_get_clear_errors(virtual_device: ais.Device) -> None:
    for make in (lambda n: ais.HostBuffer(n), lambda n: ais.DeviceBuffer(n)):
        with pytest.raises(ValueError, match=r"nbytes must be below 2\*\*63"):
            make(1 << 70)
    with pytest.raises(ais.DeviceError, match="cannot allocate 1152921504606846976 bytes of"):
        ais.HostBuffer(1 << 60)
    buf, dev = ais.HostBuffer(16), ais.DeviceBuffer(16)
    with pytest.raises(ValueError, match="needs 1180591620717411303424 bytes"):
        buf.numpy(np.uint8, 1 << 70)
    with pytest.raises(ValueError, match="needs 1180591620717411303424 bytes"):
        dev.view(np.uint8, 1 << 70)
    for dtype in ([], {}):
        with pytest.raises(ValueError, match="has no size"):
            buf.numpy(dtype)


@pytest.mark.aiostream(memory=1000)
def test_a_virtual_device_refuses_memory_it_does_not_have(virtual_device: ais.Device) -> None:
    import gc

    first = ais.DeviceBuffer(600)
    with pytest.raises(
        ais.DeviceError,
        match="virtual:0 is out of memory: 600 bytes asked, 400 "
        r"of 1000 free \(aiostream.virtual.reset\(memory=...\) sets the size\)",
    ):
        ais.DeviceBuffer(600)
    with pytest.raises(ais.DeviceError, match="out of memory"):
        ais.DeviceBuffer(1 << 60)  # the default 16 GiB would refuse it too
    ais.HostBuffer(600)  # host memory is not the device's
    del first
    gc.collect()
    second = ais.DeviceBuffer(1000)  # freed memory is free again; the device did not fail
    assert second.nbytes == 1000


@pytest.mark.aiostream(memory=1 << 50)  # a device of a petabyte, the most a virtual one has
def test_memory_the_host_cannot_hold_is_refused_by_its_device(virtual_device: ais.Device) -> None:
    """The simulator keeps every buffer's bytes in host memory: where the machine cannot hold
    them, the allocation is refused with a DeviceError of the device, as a driver refuses
    pinned memory, whether host or device memory was asked."""
    with pytest.raises(ais.DeviceError) as host:
        ais.HostBuffer(1 << 62)  # more than any machine has: refused at once
    assert host.value.device == "virtual:0"
    assert "4611686018427387904 bytes of host memory" in str(host.value)

    with memory_cap():  # the host cannot hold it, on any machine: refused at once
        with pytest.raises(ais.DeviceError) as device:
            ais.DeviceBuffer(1 << 50)  # free on the device
    assert device.value.device == "virtual:0"
    message = str(device.value)  # the size asked, the cause, and the setting to change
    assert "out of memory: 1125899906842624 bytes asked" in message
    assert "the host could not hold it" in message and "reset(memory=...)" in message


def test_device_buffer_views_and_interop(virtual_device: ais.Device) -> None:
    dev = ais.DeviceBuffer(16, "virtual:0")
    assert (dev.nbytes, dev.device, dev.dtype, dev.shape) == (16, virtual_device, np.uint8, (16,))
    typed = dev.view(np.float32, (2, 2))
    assert (typed.dtype, typed.shape, typed.nbytes) == (np.float32, (2, 2), 16)
    assert not hasattr(dev, "__cuda_array_interface__")  # CUDA buffers only
    del dev
    gc.collect()
    assert ais.virtual.stats().buffers == 1  # the view keeps its base alive
    del typed


async def test_round_trip_through_the_device(virtual_time: VirtualTime) -> None:
    host_in, host_out = ais.HostBuffer(64), ais.HostBuffer(64)
    a, b = ais.DeviceBuffer(64), ais.DeviceBuffer(64)
    host_in.numpy(np.int64)[:] = np.arange(8)
    s = ais.Stream()
    ais.copy_async(a, host_in, stream=s)
    ais.copy_async(b, a, stream=s)
    ais.copy_async(host_out, b, stream=s)
    await s.synchronize()
    assert host_out.numpy(np.int64).tolist() == list(range(8))
    assert [r.engine for r in ais.virtual.timeline()] == ["h2d", "compute", "d2h"]


@pytest.mark.aiostream(bandwidth=1e6, latency=0.001, d2d_bandwidth=4e6)
async def test_copies_take_latency_plus_size_over_bandwidth(virtual_time: VirtualTime) -> None:
    host, dev, dev2 = ais.HostBuffer(4000), ais.DeviceBuffer(4000), ais.DeviceBuffer(4000)
    ais.copy_async(dev, host)
    ais.copy_async(dev2, dev)
    await ais.current_stream().synchronize()
    h2d, d2d = ais.virtual.timeline()
    assert h2d.end - h2d.start == pytest.approx(0.005, abs=1e-9)  # 1 ms + 4000 B / 1 MB/s
    assert d2d.end - d2d.start == pytest.approx(0.002, abs=1e-9)  # 1 ms + 4000 B / 4 MB/s
    assert virtual_time.now() == pytest.approx(0.007, abs=1e-9)


async def test_default_copies_are_near_a_pcie_4_x16_link(virtual_time: VirtualTime) -> None:
    """``reset()``'s defaults: 25 GB/s each way, 1 TB/s device to device, 10 us per copy."""
    host, dev, dev2 = ais.HostBuffer(25_000), ais.DeviceBuffer(25_000), ais.DeviceBuffer(25_000)
    ais.copy_async(dev, host)
    ais.copy_async(dev2, dev)
    ais.copy_async(host, dev2)
    await ais.current_stream().synchronize()
    assert [(r.engine, round((r.end - r.start) * 1e9)) for r in ais.virtual.timeline()] == [
        ("h2d", 10_000 + 1_000),  # 25,000 B at 25 GB/s: 1 us
        ("compute", 10_000 + 25),  # at 1 TB/s: 25 ns
        ("d2h", 10_000 + 1_000),
    ]


async def test_reading_before_the_copy_lands_sees_poison(virtual_time: VirtualTime) -> None:
    dev, out = ais.DeviceBuffer(32), ais.HostBuffer(32)
    src = ais.HostBuffer(32)
    src.numpy()[:] = 7
    s = ais.Stream()
    ais.copy_async(dev, src, stream=s)
    ais.copy_async(out, dev, stream=s)
    early = out.numpy().copy()  # taken while the copy flies
    assert set(early.tolist()) <= {0, ais.virtual.POISON}
    await s.synchronize()
    assert (out.numpy() == 7).all()  # with the wait: the data
    (race,) = ais.virtual.races(clear=True)
    assert race.nbytes == 32
    submitted = "(submitted at t=0.000000000s)"
    assert race.copy == f"'copy d2h' on virtual:0 stream {s.stream_id} {submitted}"
    assert str(race).startswith(
        f"host access to a 32-byte buffer while {race.copy} was in flight\n  File "
    )


async def test_a_race_report_says_when_the_copy_was_submitted(virtual_time: VirtualTime) -> None:
    """The submission time of the copy in flight, in the device's seconds, to the nanosecond."""
    await anyio.sleep(1.0)  # virtual time: the device clock reads 1 s
    dev, out = ais.DeviceBuffer(32), ais.HostBuffer(32)
    s = ais.Stream()
    ais.copy_async(out, dev, stream=s)
    out.numpy().copy()  # while the copy flies
    await s.synchronize()
    (race,) = ais.virtual.races(clear=True)
    assert (
        race.copy == f"'copy d2h' on virtual:0 stream {s.stream_id} (submitted at t=1.000000000s)"
    )


async def test_a_race_report_ends_at_the_read(virtual_time: VirtualTime) -> None:
    """Where a race report says the host read: the 8 innermost frames outside aiostream, the
    last one the read itself."""
    dev, out = ais.DeviceBuffer(32), ais.HostBuffer(32)
    ais.copy_async(out, dev)
    early = out.numpy().copy()  # taken while the copy flies
    await ais.current_stream().synchronize()
    (race,) = ais.virtual.races(clear=True)
    frames = race.where.split('  File "')[1:]  # the 8 innermost, up to the read
    assert len(frames) == 8, race.where
    assert "in test_a_race_report_ends_at_the_read" in frames[-1]
    assert "early = out.numpy().copy()" in frames[-1]
    assert early.nbytes == 32


@pytest.mark.aiostream(bandwidth=8.0)  # 8 bytes take a second
async def test_destination_is_poisoned_from_the_copy_start(virtual_time: VirtualTime) -> None:
    out, dev = ais.HostBuffer(8), ais.DeviceBuffer(8)
    s = ais.Stream()
    ais.delay(1.0, stream=s)  # the copy runs from t=1 to t=2
    ais.copy_async(out, dev, stream=s)
    assert (out.numpy() == 0).all()  # a race, and not started yet: the old contents
    await anyio.sleep(1.5)
    assert (out.numpy() == ais.virtual.POISON).all()  # started: poison until it lands
    await s.synchronize()
    assert (out.numpy() == 0).all()  # landed: the device buffer's zeros
    assert len(ais.virtual.races(clear=True)) == 2


async def test_ordered_reads_are_not_poisoned(virtual_time: VirtualTime) -> None:
    src, out = ais.HostBuffer(8), ais.HostBuffer(8)
    src.numpy()[:] = 3
    dev = ais.DeviceBuffer(8)
    s = ais.Stream()
    ais.copy_async(out, dev, stream=s)  # reads dev's zeros ...
    ais.copy_async(dev, src, stream=s)  # ... before this copy starts writing it
    await s.synchronize()
    assert (out.numpy() == 0).all()
    ais.virtual.assert_no_races()


@pytest.mark.aiostream(bandwidth=1000.0)  # the copy is in flight for 8 ms of real time
def test_assert_no_races_lists_where(virtual_device: ais.Device) -> None:
    out, dev = ais.HostBuffer(8), ais.DeviceBuffer(8)
    ais.copy_async(out, dev)
    out.numpy()
    with pytest.raises(AssertionError, match="1 unsynchronised host access") as info:
        ais.virtual.assert_no_races()
    assert "test_assert_no_races_lists_where" in str(info.value)
    ais.virtual.assert_no_races()  # cleared
    ais.current_stream().synchronize_blocking()
    out.numpy()  # after the wait: no race
    ais.virtual.assert_no_races()


async def test_buffers_live_until_their_copy_completes(virtual_time: VirtualTime) -> None:
    out = ais.HostBuffer(8)
    src = ais.HostBuffer(8)
    src.numpy()[:] = 9
    dev = ais.DeviceBuffer(8)
    s = ais.Stream()
    ais.copy_async(dev, src, stream=s)
    ais.copy_async(out, dev, stream=s)
    del src, dev
    gc.collect()
    assert ais.virtual.stats().buffers == 1  # freed by their owners ...
    await s.synchronize()
    assert (out.numpy() == 9).all()  # ... yet the copies read them intact


def test_copy_async_bad_input(virtual_device: ais.Device) -> None:
    h8, h4, d8 = ais.HostBuffer(8), ais.HostBuffer(4), ais.DeviceBuffer(8)
    with pytest.raises(ValueError, match="equal sizes, got dst 4 and src 8"):
        ais.copy_async(h4, d8)
    with pytest.raises(ValueError, match="for host to host use numpy"):
        ais.copy_async(h8, h8)
    with pytest.raises(TypeError, match="dst must be a HostBuffer or DeviceBuffer"):
        ais.copy_async(np.zeros(8, np.uint8), d8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="src must be a HostBuffer or DeviceBuffer"):
        ais.copy_async(d8, b"12345678")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stream must be an aiostream.Stream"):
        ais.copy_async(d8, h8, stream=0)  # type: ignore[arg-type]


@pytest.mark.aiostream(devices=2)
def test_copies_stay_on_one_device(virtual_device: ais.Device) -> None:
    d0, d1 = ais.DeviceBuffer(8, "virtual:0"), ais.DeviceBuffer(8, "virtual:1")
    with pytest.raises(ValueError, match="within one device, got virtual:1 and virtual:0"):
        ais.copy_async(d0, d1)
    with pytest.raises(ValueError, match="on virtual:0, but the stream is on virtual:1"):
        ais.copy_async(d0, ais.HostBuffer(8), stream=ais.Stream("virtual:1"))


@pytest.mark.aiostream(devices=2)
@pytest.mark.parametrize(
    "anyio_backend",
    ["asyncio", pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"), "trio"],
)
async def test_a_copy_between_devices_names_the_way_round_which_works(
    virtual_device: ais.Device, anyio_backend: object
) -> None:
    d0, d1 = ais.DeviceBuffer(16, "virtual:0"), ais.DeviceBuffer(16, "virtual:1")
    with pytest.raises(ValueError, match=r"stage it through host memory: .*HostBuffer\(16\)"):
        ais.copy_async(d1, d0)
    source = ais.HostBuffer(16)
    source.numpy(np.float32)[:] = [1, 2, 3, 4]
    s0, s1 = ais.Stream("virtual:0"), ais.Stream("virtual:1")
    ais.copy_async(d0, source, stream=s0)
    staging = ais.HostBuffer(16)  # the way the error says
    ais.copy_async(staging, d0, stream=s0)
    s1.wait_event(s0.record_event())
    ais.copy_async(d1, staging, stream=s1)
    out = ais.HostBuffer(16, device="virtual:1")
    ais.copy_async(out, d1, stream=s1)
    await s1
    assert out.numpy(np.float32).tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "anyio_backend", [pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")]
)
async def test_round_trip_on_uvloop_in_real_time(virtual_device: ais.Device) -> None:
    """uvloop cannot fake time, so here the virtual device runs on the monotonic clock."""
    src, out, dev = ais.HostBuffer(32), ais.HostBuffer(32), ais.DeviceBuffer(32)
    src.numpy(np.int32)[:] = np.arange(8)
    s = ais.Stream()
    ais.copy_async(dev, src, stream=s)
    ais.copy_async(out, dev, stream=s)
    await s.synchronize()
    assert out.numpy(np.int32).tolist() == list(range(8))
    ais.virtual.assert_no_races()


def test_sharing_refusals_say_what_to_do() -> None:
    """A buffer not made to be shared, and bytes that are no buffer's handle, are refused
    with what to do instead."""
    with pytest.raises(ValueError) as info:
        ais.DeviceBuffer(16, "virtual:0").ipc_handle()
    assert "DeviceBuffer(nbytes, device, interprocess=True)" in str(info.value)
    handle = ais.DeviceBuffer(16, "virtual:0", interprocess=True).ipc_handle()
    for bad in (b"", handle[:-1], handle + b"\0", b"X" + handle[1:]):
        with pytest.raises(ValueError) as info:
            ais.DeviceBuffer.from_ipc_handle("virtual:0", bad)
        assert "not a DeviceBuffer IPC handle" in str(info.value)
        assert "DeviceBuffer.ipc_handle() returned" in str(info.value)
