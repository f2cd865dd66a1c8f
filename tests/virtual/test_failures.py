"""Device errors on the virtual device: a failed operation, or a host function that raises,
fails its device (sticky, as on a GPU), wakes every wait on it with a ``DeviceError`` that
says which operation failed and when, and spares the other devices; host memory the machine
cannot give is a device error too. (Faults injected on purpose: test_faults.py.)
"""

from __future__ import annotations

import anyio
import pytest

import aiostream as ais
from aiostream.virtual import VirtualClock
from tests.helpers.waits import synchronize_keeping

pytestmark = pytest.mark.anyio


async def test_failed_operation_raises_device_error_and_sticks(clock: VirtualClock) -> None:
    s = ais.Stream()
    ais.virtual.submit(s, 1.0, error="illegal address", name="bad")
    e = s.record_event()
    assert e.query() is False  # not failed yet: it has not run
    clock.advance(1.0)
    with pytest.raises(ais.DeviceError, match="illegal address") as info:
        await e.synchronize()
    assert info.value.device == "virtual:0"
    assert "'bad'" in str(info.value)
    other = ais.Stream()
    with pytest.raises(ais.DeviceError, match="illegal address"):
        other.query()
    with pytest.raises(ais.DeviceError, match="illegal address"):
        ais.delay(0.1, stream=other)
    with pytest.raises(ais.DeviceError, match="illegal address"):
        await other.synchronize()
    ais.virtual.reset()
    s = ais.Stream()
    ais.delay(0, stream=s)
    await s.synchronize()


async def test_failure_wakes_every_waiting_task(clock: VirtualClock) -> None:
    s = ais.Stream()
    ais.virtual.submit(s, 1.0, error="ecc error")
    events = [s.record_event() for _ in range(3)]
    errors: list[BaseException] = []
    async with anyio.create_task_group() as tg:
        for e in events:
            tg.start_soon(synchronize_keeping, e, errors)
        await anyio.wait_all_tasks_blocked()
        clock.advance(1.0)
    assert len(errors) == 3
    assert len({id(e) for e in errors}) == 3  # each task raises its own exception object
    assert ais.virtual.stats().waits == 0


def test_other_devices_are_not_failed(clock: VirtualClock) -> None:
    ais.virtual.reset(devices=2, clock=clock)
    ais.virtual.submit(ais.Stream("virtual:0"), 0.0, error="boom")
    with pytest.raises(ais.DeviceError):
        ais.Stream("virtual:0").query()
    assert ais.Stream("virtual:1").query()


def test_a_device_failing_spares_the_work_of_other_devices_waiting_on_one_event() -> None:
    """Work of two devices waits for one event; one device fails meanwhile: its waiting work is
    aborted, and the other device's still starts when the event completes."""
    clk = VirtualClock()
    ais.virtual.reset(devices=2, clock=clk)
    s0, t0, s1 = ais.Stream("virtual:0"), ais.Stream("virtual:0"), ais.Stream("virtual:1")
    ais.delay(1.0, stream=s0)
    e = s0.record_event()
    s1.wait_event(e)  # first in line behind the event: aborted by the failure
    ais.delay(0.5, stream=s1)
    t0.wait_event(e)
    ais.virtual.submit(t0, 0.25, engine="h2d")  # (the compute slot is s0's until t=1.0)
    ais.virtual.submit(ais.Stream("virtual:1"), 0.0, error="boom")
    with pytest.raises(ais.DeviceError, match="boom"):
        s1.query()
    clk.advance(1.0)
    assert e.query() and not t0.query()
    clk.advance(0.25)
    assert t0.query()


def test_a_device_error_says_which_operation_failed_and_when(clock: VirtualClock) -> None:
    s = ais.Stream()
    ais.delay(0.25, stream=s)
    ais.virtual.submit(s, 0.5, error="boom", name="step 7")
    clock.advance(1.0)
    with pytest.raises(ais.DeviceError) as caught:
        s.query()
    assert str(caught.value) == (
        "virtual:0: operation 'step 7' on stream 1 failed at t=0.750000000s: boom"
    )


# ---------------------------------------------------------------------- host functions that raise


async def test_a_host_function_that_raises_fails_its_device(
    anyio_backend: object, clock: VirtualClock
) -> None:
    s = ais.Stream()
    ais.virtual.submit(s, 0.5, name="callback", fn=lambda: 1 / 0)
    ais.virtual.submit(s, 0.5, name="after")
    clock.advance(2.0)  # runs the function, in this thread; the error goes to the device
    with anyio.fail_after(5):
        with pytest.raises(ais.DeviceError, match="'callback'.*ZeroDivisionError") as info:
            await s.synchronize()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    with pytest.raises(ais.DeviceError):  # sticky, as device errors are
        s.query()
    with pytest.raises(ais.DeviceError):
        ais.Stream().synchronize_blocking()
    assert ais.virtual.stats().waits == 0
    assert ais.virtual.stats().operations == 0
    assert [(r.name, r.error is not None) for r in ais.virtual.timeline()] == [
        ("callback", True),
        ("after", True),
    ]


async def test_a_waiter_on_a_raising_host_function_wakes_with_the_error(
    anyio_backend: object,
) -> None:
    s = ais.Stream()
    ais.virtual.submit(s, 0.01, fn=lambda: 1 / 0)
    with anyio.fail_after(5):
        with pytest.raises(ais.DeviceError) as info:
            await s.synchronize()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert ais.virtual.stats().waits == 0


async def test_a_host_function_raising_keyboard_interrupt_fails_the_device_then_goes_on(
    clock: VirtualClock,
) -> None:
    """Ctrl-C arriving in a host function reaches the thread that ran it (here, the one that
    advanced the clock), with the device already consistent: failed, nothing left running,
    and every wait raising the device's error with the interrupt as its cause."""

    def interrupted() -> None:
        raise KeyboardInterrupt

    s = ais.Stream()
    ais.virtual.submit(s, 1.0, name="callback", fn=interrupted)
    ais.virtual.submit(s, 1.0, name="after")
    with pytest.raises(KeyboardInterrupt):
        clock.advance(2.0)
    with pytest.raises(ais.DeviceError, match="'callback'.*KeyboardInterrupt") as info:
        await s.synchronize()
    assert isinstance(info.value.__cause__, KeyboardInterrupt)
    assert ais.virtual.stats().operations == 0
    assert [(r.name, r.end) for r in ais.virtual.timeline()] == [("callback", 1.0), ("after", 1.0)]


# ---------------------------------------------------------------------- host memory


def test_host_memory_the_machine_cannot_give_is_a_device_error() -> None:
    with pytest.raises(ais.DeviceError, match="cannot allocate 1152921504606846976 bytes"):
        ais.HostBuffer(1 << 60)
    assert ais.HostBuffer(16).nbytes == 16  # the backend goes on
