"""Fault injection on the virtual device: ``fail_next``, ``slow_next`` and ``stall``, observed by
awaiting code under virtual time, and stalls, which nest, on a manual clock.
"""

from __future__ import annotations

import anyio
import pytest

import aiostream as ais
from aiostream.testing import VirtualTime
from aiostream.virtual import VirtualClock
from tests.helpers import virtual_loops

anyio_backend = virtual_loops.anyio_backend  # the module's loops: asyncio and trio

pytestmark = pytest.mark.anyio


async def test_fail_next_on_a_stream(virtual_time: VirtualTime) -> None:
    good, bad = ais.Stream(), ais.Stream()
    ais.virtual.fail_next(stream=bad, message="illegal memory access")
    ais.delay(1.0, stream=good)
    await good.synchronize()  # before the fault: fine
    ais.delay(1.0, stream=bad)
    with pytest.raises(ais.DeviceError, match="illegal memory access"):
        await bad.synchronize()
    assert virtual_time.now() == 2.0
    with pytest.raises(ais.DeviceError, match="illegal memory access"):
        await good.synchronize()  # sticky: the device stays failed


async def test_fail_next_counts_and_matches_the_engine(virtual_time: VirtualTime) -> None:
    s = ais.Stream()
    ais.virtual.fail_next(2, engine="d2h", message="copy failed")
    ais.virtual.submit(s, 1.0, engine="h2d")  # another engine: not matched
    ais.virtual.submit(s, 1.0, engine="compute")
    await s.synchronize()
    ais.virtual.submit(s, 1.0, engine="d2h")
    with pytest.raises(ais.DeviceError, match="copy failed"):
        await s.synchronize()
    errors = [r.error for r in ais.virtual.timeline()]
    assert errors == [None, None, "copy failed"]


async def test_slow_next_stretches_operations(virtual_time: VirtualTime) -> None:
    s = ais.Stream()
    ais.virtual.slow_next(3, n=2, stream=s)
    for _ in range(3):
        ais.delay(1.0, stream=s)
    await s.synchronize()
    assert virtual_time.now() == 7.0  # 3 + 3 + 1
    assert [r.end - r.start for r in ais.virtual.timeline()] == [3.0, 3.0, 1.0]


async def test_stall_holds_an_engine_until_released(virtual_time: VirtualTime) -> None:
    s, other = ais.Stream(), ais.Stream()
    resumed_at: list[float] = []
    stall = ais.virtual.stall("h2d")
    ais.virtual.submit(s, 1.0, engine="h2d", name="upload")
    ais.delay(1.0, stream=other)  # other engines go on

    async def waiter() -> None:
        await s.synchronize()
        resumed_at.append(virtual_time.now())

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await other.synchronize()
        await anyio.sleep(9.0)
        assert resumed_at == [] and not s.query()
        assert "stalled" in repr(stall)
        stall.release()
        stall.release()  # idempotent
    assert resumed_at == [11.0]
    upload = next(r for r in ais.virtual.timeline() if r.name == "upload")
    assert (upload.start, upload.end) == (10.0, 11.0)


async def test_stall_as_a_context_manager(virtual_time: VirtualTime) -> None:
    s = ais.Stream()
    with ais.virtual.stall("compute") as stall:
        ais.delay(1.0, stream=s)
        await anyio.sleep(2.0)
        assert not s.query()
    assert stall.released
    await s.synchronize()
    assert virtual_time.now() == 3.0


async def test_operations_running_when_stalled_go_on(virtual_time: VirtualTime) -> None:
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    ais.delay(1.0, stream=s)
    await anyio.sleep(0.5)
    with ais.virtual.stall("compute"):
        await anyio.sleep(1.0)
    await s.synchronize()
    assert [(r.start, r.end) for r in ais.virtual.timeline()] == [(0.0, 1.0), (1.5, 2.5)]


def test_stalls_nest(clock: VirtualClock) -> None:
    a = ais.virtual.stall("h2d")
    b = ais.virtual.stall("h2d")
    s = ais.Stream()
    ais.virtual.submit(s, 1.0, engine="h2d", name="copy")
    a.release()
    clock.advance(5.0)
    assert ais.virtual.timeline() == []  # b still holds the engine
    assert repr(b).endswith("stalled>")
    b.release()
    b.release()  # idempotent: it does not release a stall it does not hold
    clock.advance(1.0)
    assert [(r.name, r.start, r.end) for r in ais.virtual.timeline()] == [("copy", 5.0, 6.0)]


def test_a_released_stall_does_not_release_a_later_one(clock: VirtualClock) -> None:
    a = ais.virtual.stall("compute")
    a.release()
    b = ais.virtual.stall("compute")
    a.release()
    s = ais.Stream()
    ais.virtual.submit(s, 1.0)
    clock.advance(2.0)
    assert not s.query()
    b.release()
    clock.advance(1.0)
    assert s.query()


@pytest.mark.aiostream(devices=2)
def test_fault_injection_rejects_bad_input(virtual_device: ais.Device) -> None:
    s = ais.Stream()
    with pytest.raises(ValueError, match="engine must be one of"):
        ais.virtual.fail_next(engine="gpu")
    with pytest.raises(ValueError, match="n must be >= 1"):
        ais.virtual.fail_next(0, stream=s)
    with pytest.raises(TypeError, match="message must be a str"):
        ais.virtual.fail_next(stream=s, message=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stream must be an aiostream.Stream"):
        ais.virtual.fail_next(stream="s")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="factor must be a finite number > 0"):
        ais.virtual.slow_next(0)
    with pytest.raises(TypeError, match="factor must be a number"):
        ais.virtual.slow_next("2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="engine must be one of"):
        ais.virtual.stall("gpu")
    with pytest.raises(ValueError, match="does not exist"):
        ais.virtual.stall("h2d", device="virtual:3")
    with pytest.raises(ValueError, match="not on virtual:1"):
        ais.virtual.fail_next(stream=s, device="virtual:1")


@pytest.mark.aiostream(devices=2)
def test_faults_are_per_device(virtual_device: ais.Device) -> None:
    ais.virtual.fail_next(device="virtual:1")
    ais.virtual.submit(ais.Stream("virtual:0"), 0.0)
    assert ais.Stream("virtual:0").query()
    ais.virtual.submit(ais.Stream("virtual:1"), 0.0)
    with pytest.raises(ais.DeviceError, match="injected fault"):
        ais.Stream("virtual:1").query()


async def test_a_failed_device_runs_nothing_more(virtual_time: VirtualTime) -> None:
    s, other = ais.Stream(), ais.Stream()
    ais.virtual.fail_next(stream=s, message="kernel crashed")
    ais.delay(1.0, stream=s)
    ais.delay(5.0, stream=s)  # queued behind the fault
    ais.delay(0.5, stream=other)
    ais.delay(5.0, stream=other)  # would run until t=6
    with pytest.raises(ais.DeviceError, match="kernel crashed"):
        await s.synchronize()
    assert virtual_time.now() == 1.0
    assert ais.virtual.stats().operations == 0
    ops = [(r.stream, r.start, r.end, r.error) for r in ais.virtual.timeline()]
    aborted = "aborted: the device had failed"
    # one compute slot: s's first kernel ran 0..1 and failed; everything after it is aborted
    assert ops == [
        (s.stream_id, 0.0, 1.0, "kernel crashed"),
        (s.stream_id, 1.0, 1.0, aborted),
        (other.stream_id, 1.0, 1.0, aborted),
        (other.stream_id, 1.0, 1.0, aborted),
    ]
