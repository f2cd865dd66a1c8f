"""Semantics every backend keeps (docs/design.md section 3), run on every backend and every loop."""

from __future__ import annotations

import anyio
import pytest

import aiostream as ais
from tests.helpers.deadlines import deadline
from tests.helpers.waits import assert_quiet

pytestmark = pytest.mark.anyio

SHORT = 0.02  # seconds of device work: long enough to be pending, short enough to be quick
#: seconds of device work a query made at once still finds pending, on a loaded machine too
PENDING = 0.2
#: seconds of device work still pending after a short wait: wide margin for a loaded machine
LONG = 0.5


def quiet(device: ais.Device) -> None:
    if device.type == "virtual":
        assert_quiet()


async def test_record_query_synchronize(aiostream_device: ais.Device) -> None:
    s = ais.Stream(aiostream_device)
    ais.delay(PENDING, stream=s)
    e = s.record_event()
    assert e.query() is False
    assert s.query() is False
    await e.synchronize()
    assert e.query() is True
    assert s.query() is True
    quiet(aiostream_device)


async def test_a_record_after_a_completed_wait_is_complete(aiostream_device: ais.Device) -> None:
    """Nothing of the user's is pending once a wait on all of a stream's work returned: an
    event recorded then, and the same event recorded again, are complete at once."""
    s = ais.Stream(aiostream_device)
    ais.delay(SHORT, stream=s)
    e = s.record_event()
    await e.synchronize()
    later = s.record_event()
    e.record(s)
    assert later.query() and e.query() and s.query()
    quiet(aiostream_device)


async def test_stream_synchronize_waits_for_all_work(aiostream_device: ais.Device) -> None:
    s = ais.Stream(aiostream_device)
    ais.delay(SHORT, stream=s)
    ais.delay(SHORT, stream=s)
    await s.synchronize()
    assert s.query()
    quiet(aiostream_device)


async def test_never_recorded_event_is_complete(aiostream_device: ais.Device) -> None:
    e = ais.Event(aiostream_device)
    assert e.query() is True
    assert e.event_id == 0
    await e.synchronize()
    e.wait(ais.Stream(aiostream_device))  # waiting for it is a no-op


async def test_an_event_shared_before_its_first_record_is_complete(
    aiostream_device: ais.Device,
) -> None:
    """An interprocess event has its handle from ``ipc_handle()`` on, before any record: it
    and the event opened from the handle have captured no work, so they are complete."""
    e = ais.Event(aiostream_device, interprocess=True)
    handle = e.ipc_handle()
    opened = ais.Event.from_ipc_handle(aiostream_device, handle)
    for event in (e, opened):
        assert event.query() is True
        with deadline(5, "an event that captured no work"):
            await event.synchronize()
        event.synchronize_blocking()
        event.wait(ais.Stream(aiostream_device))
    quiet(aiostream_device)


async def test_work_on_one_stream_runs_in_order(aiostream_device: ais.Device) -> None:
    s = ais.Stream(aiostream_device)
    ais.delay(SHORT, stream=s)
    first = s.record_event()
    ais.delay(SHORT, stream=s)
    second = s.record_event()
    await second.synchronize()
    assert first.query()


async def test_wait_event_orders_streams_on_the_device(aiostream_device: ais.Device) -> None:
    producer, consumer = ais.Stream(aiostream_device), ais.Stream(aiostream_device)
    ais.delay(PENDING, stream=producer)
    ready = producer.record_event(ais.Event(aiostream_device, enable_timing=True))
    consumer.wait_event(ready)  # the host does not wait
    assert not ready.query()
    done = consumer.record_event(ais.Event(aiostream_device, enable_timing=True))
    await done.synchronize()
    assert ready.query()
    elapsed = ready.elapsed_time(done)
    if aiostream_device.type == "virtual":
        assert elapsed == 0.0  # done is ready the instant ready completes: exact device time
    else:  # after ready (never before it), and not held back by anything else (a second:
        # a wide margin for the stand-in driver's threads on a loaded machine)
        assert 0.0 <= elapsed < 1000.0


async def test_wait_stream(aiostream_device: ais.Device) -> None:
    a, b = ais.Stream(aiostream_device), ais.Stream(aiostream_device)
    ais.delay(SHORT, stream=a)
    b.wait_stream(a)
    await b.record_event().synchronize()
    assert a.query()


async def test_elapsed_time_measures_device_work(aiostream_device: ais.Device) -> None:
    s = ais.Stream(aiostream_device)
    ais.delay(SHORT, stream=s)  # the start completes when this ends, whenever the host goes on
    start = s.record_event(ais.Event(aiostream_device, enable_timing=True))
    ais.delay(SHORT, stream=s)
    end = s.record_event(ais.Event(aiostream_device, enable_timing=True))
    await end.synchronize()
    elapsed = start.elapsed_time(end)
    if aiostream_device.type == "virtual":
        assert elapsed == SHORT * 1000  # exact: device time is kept in integer nanoseconds
    else:  # milliseconds, not seconds or microseconds, and at least the work's duration
        assert SHORT * 1000 * 0.99 <= elapsed < SHORT * 1000 * 50


async def test_elapsed_time_needs_both_events_complete(aiostream_device: ais.Device) -> None:
    busy, idle = ais.Stream(aiostream_device), ais.Stream(aiostream_device)
    ais.delay(LONG, stream=busy)
    start = busy.record_event(ais.Event(aiostream_device, enable_timing=True))
    end = idle.record_event(ais.Event(aiostream_device, enable_timing=True))
    await end.synchronize()
    for first, last in ((start, end), (end, start)):  # the start is pending, the end is not
        with pytest.raises(ais.NotReadyError) as info:
            first.elapsed_time(last)
        assert str(info.value) == (
            "elapsed_time() needs both events complete; await synchronize() on the later one first"
        )
    await start.synchronize()
    assert start.elapsed_time(end) < 0.0 < end.elapsed_time(start)
    quiet(aiostream_device)


async def test_event_id_zero_until_recorded_then_distinct_and_stable(
    aiostream_device: ais.Device,
) -> None:
    s = ais.Stream(aiostream_device)
    e1, e2 = ais.Event(aiostream_device), ais.Event(aiostream_device)
    assert e1.event_id == 0 and e2.event_id == 0
    e1.record(s)
    e2.record(s)
    id1 = e1.event_id
    assert id1 != 0 and e2.event_id != 0 and id1 != e2.event_id
    e1.record(s)
    assert e1.event_id == id1


async def test_cancelled_wait_leaks_nothing_and_work_goes_on(aiostream_device: ais.Device) -> None:
    s = ais.Stream(aiostream_device)
    ais.delay(LONG, stream=s)
    e = s.record_event()
    with anyio.move_on_after(SHORT) as scope:
        await e.synchronize()
    assert scope.cancelled_caught
    if aiostream_device.type == "virtual":
        assert ais.virtual.stats().waits == 0
    assert not e.query()  # the device work goes on
    await e.synchronize()
    quiet(aiostream_device)


async def test_rerecord_does_not_move_a_started_wait(aiostream_device: ais.Device) -> None:
    s = ais.Stream(aiostream_device)
    ais.delay(SHORT, stream=s)
    e = s.record_event()
    resumed_with: list[bool] = []

    started = anyio.Event()

    async def waiter() -> None:
        started.set()  # the main task runs again only once this task is suspended in the wait
        await e.synchronize()
        resumed_with.append(later.query())

    later = ais.Stream(aiostream_device)
    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await started.wait()
        ais.delay(LONG, stream=later)
        e.record(later)  # moves the event; the started wait keeps its capture
    assert resumed_with == [False]
    await e.synchronize()


async def test_synchronize_blocking_in_a_worker_thread(aiostream_device: ais.Device) -> None:
    s = ais.Stream(aiostream_device)
    ais.delay(SHORT, stream=s)
    e = s.record_event()
    await anyio.to_thread.run_sync(e.synchronize_blocking)
    assert e.query()
    ais.delay(SHORT, stream=s)
    await anyio.to_thread.run_sync(s.synchronize_blocking)
    assert s.query()
    quiet(aiostream_device)


async def test_synchronize_blocking_refuses_to_block_the_loop(aiostream_device: ais.Device) -> None:
    s = ais.Stream(aiostream_device)
    ais.delay(PENDING, stream=s)  # pending: a wait would block
    e = s.record_event()
    with pytest.raises(ais.AiostreamError, match="await event.synchronize"):
        e.synchronize_blocking()
    with pytest.raises(ais.AiostreamError, match="await stream.synchronize"):
        s.synchronize_blocking()
    await s.synchronize()
    quiet(aiostream_device)


async def test_many_tasks_each_wait_for_their_own_stream(aiostream_device: ais.Device) -> None:
    order: list[int] = []

    async def worker(i: int) -> None:
        s = ais.Stream(aiostream_device)
        with ais.use_stream(s):
            ais.delay(SHORT * (4 - i))
            e = ais.Event(aiostream_device)
            e.record()
        await e.synchronize()
        order.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(worker, i)
    assert sorted(order) == [0, 1, 2, 3]
    quiet(aiostream_device)
