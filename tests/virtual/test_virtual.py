"""The virtual backend: time model, engines, faults, clocks, reset, stats."""

from __future__ import annotations

import gc
import threading
import warnings
from typing import Any

import anyio
import pytest

import aiostream as ais
from aiostream.virtual import VirtualClock
from tests.helpers.waits import synchronize_keeping

pytestmark = pytest.mark.anyio


def spans() -> list[tuple[str, int, float, float]]:
    return [(r.name, r.stream, r.start, r.end) for r in ais.virtual.timeline()]


def test_one_engine_slot_serialises_streams_in_submission_order(clock: VirtualClock) -> None:
    a, b = ais.Stream(), ais.Stream()
    ais.virtual.submit(a, 1.0, name="a")
    ais.virtual.submit(b, 1.0, name="b")
    clock.advance(2.0)
    assert spans() == [("a", a.stream_id, 0.0, 1.0), ("b", b.stream_id, 1.0, 2.0)]


def test_engines_overlap_and_slots_add_parallelism() -> None:
    clock = VirtualClock()
    ais.virtual.reset(clock=clock, compute_slots=2)
    a, b, c = ais.Stream(), ais.Stream(), ais.Stream()
    ais.virtual.submit(a, 1.0, name="k1")
    ais.virtual.submit(b, 1.0, name="k2")
    ais.virtual.submit(c, 1.0, engine="h2d", name="copy")
    ais.virtual.submit(c, 1.0, name="k3")  # waits for its stream, then for a compute slot
    clock.advance(3.0)
    assert spans() == [
        ("k1", a.stream_id, 0.0, 1.0),
        ("k2", b.stream_id, 0.0, 1.0),
        ("copy", c.stream_id, 0.0, 1.0),
        ("k3", c.stream_id, 1.0, 2.0),
    ]


def test_higher_priority_stream_takes_the_free_slot_first(clock: VirtualClock) -> None:
    busy, low, high = ais.Stream(), ais.Stream(priority=0), ais.Stream(priority=-3)
    ais.virtual.submit(busy, 1.0, name="busy")
    clock.advance(0.5)
    ais.virtual.submit(low, 1.0, name="low")
    ais.virtual.submit(high, 1.0, name="high")
    clock.advance(3.0)
    assert [(n, s, e) for n, _, s, e in spans()] == [
        ("busy", 0.0, 1.0),
        ("high", 1.0, 2.0),
        ("low", 2.0, 3.0),
    ]


def test_the_default_stream_competes_at_the_default_priority(clock: VirtualClock) -> None:
    """The default stream has priority 0, as a stream made with none given: for a free slot
    it comes before such a stream by stream order alone, after a higher-priority one."""
    busy, other, high = ais.Stream(), ais.Stream(), ais.Stream(priority=-1)
    assert ais.default_stream().priority == other.priority == 0
    ais.virtual.submit(busy, 1.0, name="busy")
    clock.advance(0.5)
    ais.virtual.submit(other, 1.0, name="other")
    ais.virtual.submit(ais.default_stream(), 1.0, name="default")
    ais.virtual.submit(high, 1.0, name="high")
    clock.advance(4.0)
    assert [(n, s) for n, _, s, _ in spans()] == [
        ("busy", 0.0),
        ("high", 1.0),
        ("default", 2.0),
        ("other", 3.0),
    ]


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 2, 0)])
def test_submissions_at_one_instant_do_not_depend_on_their_order(
    clock: VirtualClock, order: tuple[int, ...]
) -> None:
    streams = [ais.Stream(), ais.Stream(), ais.Stream(priority=-1)]
    for i in order:
        ais.virtual.submit(streams[i], 1.0, name=f"op{i}")
    clock.advance(3.0)
    # the high-priority stream first, then stream order, whichever task submitted first
    assert [(n, s) for n, _, s, _ in spans()] == [("op2", 0.0), ("op0", 1.0), ("op1", 2.0)]


def test_an_operation_displaced_at_its_start_runs_its_whole_length_later(
    clock: VirtualClock,
) -> None:
    """An operation started at an instant gives its slot to a better one submitted at that
    same instant, and starts again when the slot is free: it runs its whole length from then,
    not to the end first planned for it."""
    low, high = ais.Stream(), ais.Stream(priority=-1)
    ais.virtual.submit(low, 1.0, name="low")  # starts at 0 while nothing else is there
    ais.virtual.submit(high, 0.25, name="high")  # same instant, better: takes the slot
    clock.advance(1.1)  # past the end first planned (1.0)
    assert high.query() and not low.query()
    clock.advance(0.15)
    assert low.query()
    assert [(n, s, e) for n, _, s, e in spans()] == [("high", 0.0, 0.25), ("low", 0.25, 1.25)]


def test_a_wait_handed_over_after_its_work_ended_is_told_at_once(clock: VirtualClock) -> None:
    """A waiter may hand a wait over just after the work ended (it checked a moment before):
    completed, failed, or dropped with its failed device, the callback runs at once, never
    left to wait for a completion that has already happened."""
    from aiostream import _backends, _objects

    backend: Any = _backends.get("virtual")
    told: list[str] = []

    def capture(s: ais.Stream) -> Any:
        return backend.stream_capture(_objects.handle(s), False)

    ok = ais.Stream()
    ais.virtual.submit(ok, 1.0)
    done = capture(ok)
    clock.advance(2.0)  # completed, on a device that works
    done.watch(lambda: told.append("completed"))
    assert told == ["completed"]
    failing, late = ais.Stream(), ais.Stream()
    ais.virtual.fail_next(stream=failing)
    ais.virtual.submit(failing, 1.0)
    ais.virtual.submit(late, 5.0)
    failed, dropped = capture(failing), capture(late)
    clock.advance(2.0)  # failing's work failed, and the device with it: late's is dropped
    failed.watch(lambda: told.append("failed"))
    dropped.watch(lambda: told.append("dropped"))
    assert told == ["completed", "failed", "dropped"]
    for target in (done, failed, dropped):
        target.release()


def test_start_waits_for_submission_stream_and_events(clock: VirtualClock) -> None:
    a, b = ais.Stream(), ais.Stream()
    ais.virtual.submit(a, 2.0, engine="h2d", name="upload")
    b.wait_event(a.record_event())
    clock.advance(0.5)
    ais.virtual.submit(b, 1.0, name="kernel")  # submitted at 0.5, ready at 2.0
    ais.virtual.submit(b, 1.0, engine="d2h", name="download")
    clock.advance(5.0)
    assert [(n, s, e) for n, _, s, e in spans()] == [
        ("upload", 0.0, 2.0),
        ("kernel", 2.0, 3.0),
        ("download", 3.0, 4.0),
    ]
    assert spans()[0][1] == a.stream_id


def test_zero_duration_and_records_need_no_slot(clock: VirtualClock) -> None:
    s = ais.Stream()
    ais.virtual.submit(s, 0.0, name="noop")
    assert s.query()
    assert spans() == [("noop", s.stream_id, 0.0, 0.0)]


def test_effects_apply_at_completion_not_submission(clock: VirtualClock) -> None:
    data: list[str] = []
    s = ais.Stream()
    ais.virtual.submit(s, 1.0, engine="h2d", fn=lambda: data.append("landed"))
    assert data == []
    clock.advance(0.999)
    assert s.query() is False and data == []
    clock.advance(0.001)
    assert s.query() is True and data == ["landed"]


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


async def test_virtual_clock_resumes_waits_only_when_advanced_past(clock: VirtualClock) -> None:
    s = ais.Stream()
    ais.delay(5.0, stream=s)
    e = s.record_event()
    resumed: list[float] = []

    async def waiter() -> None:
        await e.synchronize()
        resumed.append(clock.now())

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        clock.advance(4.9)
        await anyio.wait_all_tasks_blocked()
        await anyio.sleep(0.01)
        assert resumed == []
        clock.advance(0.1)
    assert resumed == [5.0]


async def test_clock_advanced_from_another_thread_wakes_the_loop(clock: VirtualClock) -> None:
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    thread = threading.Timer(0.02, clock.advance, args=(1.0,))
    thread.start()
    try:
        with anyio.fail_after(10):
            await s.synchronize()
    finally:
        thread.join()
    assert clock.now() == 1.0


def test_virtual_clock_rejects_bad_input() -> None:
    clock = VirtualClock(start=2.5)
    assert clock.now() == 2.5 and clock.now_ns() == 2_500_000_000
    assert repr(clock) == "VirtualClock(now=2.5)"
    # a start before zero is a reading like any other (only durations must not be negative)
    assert VirtualClock(start=-1.5).now_ns() == -1_500_000_000
    with pytest.raises(ValueError) as negative:
        clock.advance(-1)
    assert str(negative.value) == "seconds must be >= 0 seconds, got -1"
    with pytest.raises(TypeError) as text:
        clock.advance("1")  # type: ignore[arg-type]
    assert str(text.value) == "seconds must be a number of seconds (int or float), got '1'"
    with pytest.raises(ValueError, match="finite"):
        VirtualClock(float("inf"))


async def test_any_callable_can_be_the_clock() -> None:
    now = [10.0]
    ais.virtual.reset(clock=lambda: now[0])
    s = ais.Stream()
    start = s.record_event(ais.Event(enable_timing=True))
    ais.delay(0.25, stream=s)
    end = s.record_event(ais.Event(enable_timing=True))
    assert not end.query()
    now[0] = 10.25
    assert end.query()
    await end.synchronize()
    assert start.elapsed_time(end) == 250.0
    assert ais.virtual.now() == 10.25


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"devices": 0}, ValueError, "devices must be >= 1, got 0"),
        ({"compute_slots": 1.5}, TypeError, "compute_slots must be an int, got 1.5"),
        ({"h2d_slots": True}, TypeError, "h2d_slots must be an int, got True"),
        (
            {"clock": 3},
            TypeError,
            "clock must be None (the monotonic clock), a VirtualClock, or a callable returning "
            "seconds, got 3",
        ),
        (  # refused at once, not built
            {"devices": 1 << 70},
            ValueError,
            "devices must be at most 1024, got 1180591620717411303424",
        ),
        (
            {"bandwidth": float("nan")},
            ValueError,
            "bandwidth must be a finite number >= 1 (bytes per second), got nan",
        ),
        (
            {"d2d_bandwidth": 0},
            ValueError,
            "d2d_bandwidth must be a finite number >= 1 (bytes per second), got 0",
        ),
        ({"latency": -1}, ValueError, "latency must be >= 0 seconds, got -1"),
        ({"memory": 0}, ValueError, "memory must be >= 1, got 0"),
    ],
)
def test_reset_rejects_bad_input(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        ais.virtual.reset(**options)
    assert str(info.value) == message


def test_the_timeline_keeps_the_last_operations(monkeypatch: pytest.MonkeyPatch) -> None:
    """The timeline keeps the last ``TIMELINE_LIMIT`` completed operations (100,000; 5 here),
    the earlier ones dropped, so that a long run holds bounded memory."""
    from aiostream._backends.virtual import scheduler

    monkeypatch.setattr(scheduler, "TIMELINE_LIMIT", 5)
    clock = ais.virtual.VirtualClock()
    ais.virtual.reset(clock=clock)
    s = ais.Stream()
    for _ in range(8):
        ais.delay(1.0, stream=s)
    clock.advance(8.0)
    assert [r.end for r in ais.virtual.timeline()] == [4.0, 5.0, 6.0, 7.0, 8.0]


def test_options_are_one_frozen_record() -> None:
    options = ais.virtual.VirtualOptions(devices=2, compute_slots=3)
    assert options.slots() == {"compute": 3, "h2d": 1, "d2h": 1}
    with pytest.raises(AttributeError):
        options.devices = 3  # type: ignore[misc]
    with pytest.raises(TypeError) as info:
        ais.virtual.VirtualOptions.from_kwargs(zz=1, slots=2)
    assert str(info.value) == (
        "unknown virtual backend option(s) 'slots', 'zz'; accepted: devices, compute_slots, "
        "h2d_slots, d2h_slots, bandwidth, latency, d2d_bandwidth, memory"
    )
    assert ais.virtual.VirtualOptions.names()[:2] == ("devices", "compute_slots")
    # rates and times given as ints are kept as the floats the time model computes with
    rates = ais.virtual.VirtualOptions(bandwidth=16, d2d_bandwidth=32, latency=0)
    assert [(type(v), v) for v in (rates.bandwidth, rates.d2d_bandwidth, rates.latency)] == [
        (float, 16.0),
        (float, 32.0),
        (float, 0.0),
    ]


def test_option_durations_are_kept_to_the_nanosecond() -> None:
    """The latency is kept as the simulation uses it: whole nanoseconds, in seconds."""
    assert ais.virtual.VirtualOptions(latency=1.4e-9).latency == 1e-9
    assert ais.virtual.VirtualOptions(latency=2).latency == 2.0


def test_an_async_clock_is_refused_with_what_to_give() -> None:
    async def clock() -> float:
        return 0.0

    with pytest.raises(TypeError) as info:
        ais.virtual.reset(clock=clock)
    assert str(info.value) == (
        f"clock must return seconds when called; {clock!r} is an async function (its call "
        "returns a coroutine): give a plain function"
    )


def test_a_clock_returning_a_coroutine_is_refused_and_the_coroutine_closed() -> None:
    """A plain callable that returns a coroutine (not an async function, so not refused when
    given): its reading is refused, and the coroutine is closed there, not left to warn
    "never awaited" when collected."""

    async def seconds() -> float:
        return 0.0

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a "never awaited" warning would fail the test
        with pytest.raises(TypeError, match="not a number of seconds") as info:
            ais.virtual.reset(clock=lambda: seconds())
        del info
        gc.collect()


@pytest.mark.slow
async def test_twenty_thousand_waits_on_as_many_streams(clock: VirtualClock) -> None:
    """Scale is ordinary: every wait resumes, in order of completion, and nothing is left.
    (benchmarks/bench_scale.py goes to 100,000.)"""
    n = 20_000
    ais.virtual.reset(clock=clock, compute_slots=n)
    streams = [ais.Stream() for _ in range(n)]
    for i, s in enumerate(streams):
        ais.delay((i % 1000 + 1) * 1e-3, stream=s)
    resumed: list[int] = []

    async def wait(i: int) -> None:
        await streams[i].synchronize()
        resumed.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(wait, i)
        await anyio.wait_all_tasks_blocked()
        assert ais.virtual.stats().waits == n
        clock.advance(0.5)  # the first half of the durations
        await anyio.wait_all_tasks_blocked()
        assert len(resumed) == n // 2
        assert all(i % 1000 < 500 for i in resumed)
        clock.advance(0.5)
    assert len(resumed) == n
    assert ais.virtual.stats().waits == 0 and ais.virtual.stats().operations == 0


def test_submit_rejects_bad_input() -> None:
    s = ais.Stream()
    with pytest.raises(TypeError, match="stream must be an aiostream.Stream"):
        ais.virtual.submit("s", 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'compute', 'h2d', 'd2h'"):
        ais.virtual.submit(s, 1.0, engine="gpu")
    with pytest.raises(ValueError, match=">= 0"):
        ais.virtual.submit(s, -1.0)
    with pytest.raises(TypeError, match="fn must be callable"):
        ais.virtual.submit(s, 1.0, fn=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="error must be a message"):
        ais.virtual.submit(s, 1.0, error=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="name must be a str"):
        ais.virtual.submit(s, 1.0, name=1)  # type: ignore[arg-type]


async def test_objects_from_before_a_reset_raise_clearly() -> None:
    s = ais.Stream()
    e = s.record_event()
    ais.virtual.reset()
    for use in (s.query, e.query, lambda: ais.delay(0.1, stream=s), lambda: e.record(s)):
        with pytest.raises(ais.StaleHandleError, match="reset"):
            use()
    new = ais.Stream()
    replaced = (
        "come from two instances of one backend: it was replaced between them (for the "
        "virtual backend, aiostream.virtual.reset() ran); create them again after it"
    )
    with pytest.raises(ais.StaleHandleError) as caught:
        new.wait_event(e)
    assert str(caught.value) == f"Stream on virtual:0 and Event on virtual:0 {replaced}"
    with pytest.raises(ais.StaleHandleError) as caught:
        new.wait_stream(s)
    assert str(caught.value) == f"Stream on virtual:0 and Stream on virtual:0 {replaced}"
    with pytest.raises(ais.StaleHandleError):
        await s.synchronize()


async def test_reset_wakes_pending_waits_instead_of_hanging(clock: VirtualClock) -> None:
    s = ais.Stream()
    ais.delay(100.0, stream=s)
    e = s.record_event()
    errors: list[BaseException] = []

    async def waiter() -> None:
        try:
            await e.synchronize()
        except ais.StaleHandleError as exc:
            errors.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            ais.virtual.reset()
    assert len(errors) == 1


async def test_stats_count_what_is_alive(clock: VirtualClock) -> None:
    assert ais.virtual.stats() == ais.virtual.VirtualStats(0, 0, 0, 0)
    s = ais.Stream()
    e = ais.Event()
    assert ais.virtual.stats().events == 0  # created at the first record, as in PyTorch
    ais.delay(1.0, stream=s)
    e.record(s)
    ais.default_stream()
    seen: list[ais.virtual.VirtualStats] = []

    async def waiter(event: ais.Event) -> None:
        await event.synchronize()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, e)
        await anyio.wait_all_tasks_blocked()
        seen.append(ais.virtual.stats())
        clock.advance(1.0)
    assert seen == [ais.virtual.VirtualStats(streams=1, events=1, operations=1, waits=1)]
    assert ais.virtual.stats() == ais.virtual.VirtualStats(1, 1, 0, 0)
    del s, e
    gc.collect()
    assert ais.virtual.stats() == ais.virtual.VirtualStats(0, 0, 0, 0)


def test_queued_work_survives_its_stream(clock: VirtualClock) -> None:
    done: list[int] = []
    s = ais.Stream()
    ais.virtual.submit(s, 1.0, fn=lambda: done.append(1))
    del s
    gc.collect()
    clock.advance(1.0)
    assert ais.virtual.stats().operations == 0
    assert done == [1]


def program() -> list[ais.virtual.OpRecord]:
    clock = VirtualClock()
    ais.virtual.reset(clock=clock, compute_slots=2)
    streams = [ais.Stream(priority=-(i % 3)) for i in range(6)]
    for i in range(30):
        s = streams[(i * 7) % 6]
        engine = ais.virtual.ENGINES[i % 3]
        ais.virtual.submit(s, 0.001 * (1 + (i * 13) % 5), engine=engine, name=f"op{i}")
        if i % 4 == 0:
            streams[(i + 1) % 6].wait_stream(s)
        clock.advance(0.0005)
    clock.advance(10.0)
    return ais.virtual.timeline()


def test_same_program_gives_the_same_timeline() -> None:
    first = program()
    assert len(first) == 30
    assert all(
        a.end <= b.start or a.stream != b.stream for a, b in zip(first, first[1:], strict=False)
    )
    for _ in range(3):
        assert program() == first


async def test_two_loops_in_two_threads_wait_on_one_device() -> None:
    s1, s2 = ais.Stream(), ais.Stream()
    ais.delay(0.05, stream=s1)
    ais.delay(0.05, stream=s2)
    e1, e2 = s1.record_event(), s2.record_event()
    results: dict[str, bool] = {}

    def run(name: str, event: ais.Event, backend: str) -> None:
        async def main() -> None:
            await event.synchronize()
            results[name] = event.query()

        anyio.run(main, backend=backend)

    threads = [
        threading.Thread(target=run, args=("a", e1, "asyncio")),
        threading.Thread(target=run, args=("b", e2, "trio")),
    ]
    for t in threads:
        t.start()
    await e2.synchronize()  # and this loop waits too
    for t in threads:
        await anyio.to_thread.run_sync(t.join)
    assert results == {"a": True, "b": True}


# ---------------------------------------------------------------------- waits on other streams


async def test_a_stream_synchronize_covers_an_event_it_waits_on_after_its_work(
    clock: VirtualClock,
) -> None:
    """Cross-stream ordering: ``s.wait_event(e)`` after the last work of ``s`` is part of what
    ``s`` must finish, so ``await s.synchronize()`` and ``s.query()`` wait for ``e`` too."""
    producer, consumer = ais.Stream(), ais.Stream()
    ais.delay(2.0, stream=producer)
    ready = producer.record_event()
    ais.virtual.submit(consumer, 1.0, engine="h2d")  # beside the producer's kernel
    consumer.wait_event(ready)  # after the consumer's own work: no work follows it
    resumed: list[float] = []

    async def waiter() -> None:
        await consumer.synchronize()
        resumed.append(clock.now())

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        clock.advance(1.0)  # the consumer's own work is done; the event it waits on is not
        await anyio.wait_all_tasks_blocked()
        assert resumed == []
        assert consumer.query() is False
        clock.advance(1.0)
    assert resumed == [2.0]
    assert consumer.query() is True
    assert ais.virtual.stats().waits == 0


def test_a_stream_with_no_work_of_its_own_waits_for_the_event_it_waits_on(
    clock: VirtualClock,
) -> None:
    producer, consumer = ais.Stream(), ais.Stream()
    ais.delay(1.0, stream=producer)
    consumer.wait_event(producer.record_event())
    assert consumer.query() is False
    clock.advance(0.5)
    assert consumer.query() is False
    clock.advance(0.5)
    assert consumer.query() is True


def test_a_blocking_stream_sync_covers_an_event_it_waits_on(clock: VirtualClock) -> None:
    producer, consumer = ais.Stream(), ais.Stream()
    ais.delay(1.0, stream=producer)
    ais.virtual.submit(consumer, 0.25, engine="h2d")
    consumer.wait_event(producer.record_event())
    clock.advance(0.5)
    returned: list[float] = []
    thread = threading.Thread(target=lambda: (consumer.synchronize_blocking(), returned.append(1)))
    thread.start()
    thread.join(0.05)
    assert returned == []  # the consumer's own work is done, the producer's is not
    clock.advance(0.5)
    thread.join(10)
    assert returned == [1] and clock.now() == 1.0


# ---------------------------------------------------------------------- wait targets


def _live_targets() -> int:
    from aiostream._backends.virtual.simulation import Target

    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is Target)


async def test_cancelled_waits_leave_nothing_on_the_work_they_watched(
    clock: VirtualClock,
) -> None:
    """A wait cancelled while its work runs is forgotten by that work at once, not when the
    work completes: a loop of timed-out waits on a long kernel holds nothing."""
    before = _live_targets()  # other tests' backends may still hold some, uncollected
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    e = s.record_event()
    for _ in range(3):
        async with anyio.create_task_group() as tg:
            for _ in range(100):
                tg.start_soon(e.synchronize)
                tg.start_soon(s.synchronize)
            await anyio.wait_all_tasks_blocked()
            assert _live_targets() == before + 200
            tg.cancel_scope.cancel()
        await anyio.wait_all_tasks_blocked()  # the waiter, with nothing left, has exited
        assert _live_targets() == before  # the work still runs
        assert ais.virtual.stats().waits == 0
    assert not e.query()
    clock.advance(1.0)
    await e.synchronize()


async def test_a_refused_blocking_wait_leaves_the_other_waits_on_its_work_alone(
    clock: VirtualClock,
) -> None:
    """``synchronize_blocking()`` in the loop's thread is refused after its capture: the
    capture is let go without disturbing an await on the same work."""
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    e = s.record_event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(e.synchronize)
        await anyio.wait_all_tasks_blocked()
        for blocking in (e.synchronize_blocking, s.synchronize_blocking):
            with pytest.raises(ais.AiostreamError, match="would block the event loop"):
                blocking()
        assert ais.virtual.stats().waits == 1  # the await's, still watching
        clock.advance(1.0)
    assert ais.virtual.stats().waits == 0


# ---------------------------------------------------------------------- a lazy device


def _failing_later() -> tuple[list[float], ais.Stream, ais.Event, ais.Event]:
    """On a callable clock: 1 s of work between two timed events on one stream, and an
    operation on another stream that fails the device at 2.0 s."""
    now = [0.0]
    ais.virtual.reset(clock=lambda: now[0])
    a, b = ais.Stream(), ais.Stream()
    start = a.record_event(ais.Event(enable_timing=True))
    ais.delay(1.0, stream=a)
    end = a.record_event(ais.Event(enable_timing=True))
    ais.virtual.submit(b, 2.0, engine="h2d", error="ecc error")
    now[0] = 1.5
    assert end.query() is True  # the work is done; the failure is not yet
    return now, a, start, end


@pytest.mark.parametrize("call", ["event query", "stream query", "elapsed_time", "wait"])
async def test_a_failure_that_came_due_is_seen_by_the_first_call_after_it(
    anyio_backend: object, call: str
) -> None:
    """The device is lazy on a callable clock: whatever call first looks after the failing
    operation's end (at that very instant here) processes it and raises, though its own
    work had completed before, as every later call does (device errors are sticky)."""
    now, a, start, end = _failing_later()
    assert start.elapsed_time(end) == 1000.0
    now[0] = 2.0
    first: dict[str, Any] = {
        "event query": end.query,
        "stream query": a.query,
        "elapsed_time": lambda: start.elapsed_time(end),
        "wait": a.synchronize_blocking,
    }
    with pytest.raises(ais.DeviceError, match="ecc error"):
        await anyio.to_thread.run_sync(first[call])
    for later in first.values():
        with pytest.raises(ais.DeviceError, match="ecc error"):
            await anyio.to_thread.run_sync(later)


def test_inspection_brings_the_device_to_its_clock_first() -> None:
    """``stats()`` and ``timeline()`` on a callable clock, with nothing else called since
    the work's end: they show it done."""
    for inspect in ("stats", "timeline"):
        now = [0.0]
        ais.virtual.reset(clock=lambda now=now: now[0])
        s = ais.Stream()
        ais.virtual.submit(s, 1.0, name="kernel")
        now[0] = 2.0
        if inspect == "stats":
            assert ais.virtual.stats().operations == 0
        else:
            assert [(r.name, r.end) for r in ais.virtual.timeline()] == [("kernel", 1.0)]


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


async def test_the_leak_listing_names_each_thing_left(clock: VirtualClock) -> None:
    """What the pytest plugin prints for a leak: each pending wait (with the work it waits
    for), pending operation, live stream, event and buffer, one line each, in a stable order."""
    from aiostream import _backends

    backend: Any = _backends.get("virtual")
    s, other = ais.Stream(), ais.Stream()
    ais.delay(2.0, stream=s)
    later, first = ais.Event(), ais.Event()
    assert (later.event_id, first.event_id) == (0, 0)  # ids come with the first record
    first.record(s)
    clock.advance(0.5)
    later.record(s)
    ais.delay(1.0, stream=other)  # a second pending operation, submitted after the first
    host, big, buf = ais.HostBuffer(8), ais.DeviceBuffer(32), ais.DeviceBuffer(16)
    async with anyio.create_task_group() as tg:
        tg.start_soon(later.synchronize)
        await anyio.wait_all_tasks_blocked()
        assert backend.leaks() == [
            "pending wait on virtual:0 stream 1 (for the work up to its 'record', submitted at "
            "t=0.500000000s)",
            "pending operation 'delay' on virtual:0 stream 1, engine compute, submitted at "
            "t=0.000000000s, running until t=2.000000000s",
            "pending operation 'delay' on virtual:0 stream 2, engine compute, submitted at "
            "t=0.500000000s, not started",  # by submission
            "live stream virtual:0 stream 1 (priority 0)",  # by device, then id
            "live stream virtual:0 stream 2 (priority 0)",
            "live event virtual:0 event 1",  # by id: the order they were made in
            "live event virtual:0 event 2",
            "live buffer of 16 bytes on virtual:0",  # device memory by size, then the host's
            "live buffer of 32 bytes on virtual:0",
            "live buffer of 8 bytes on host",
        ]
        tg.cancel_scope.cancel()
    del host, big, buf, other


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


def test_a_host_function_that_asks_the_device_leaves_the_timeline_as_it_was() -> None:
    """A host function runs while the device reaches the clock's now: what it asks (a query)
    sees the instant the function runs at, and moves nothing; the work after it still runs."""
    clk = VirtualClock()
    ais.virtual.reset(clock=clk, compute_slots=2)
    s, t = ais.Stream(), ais.Stream()
    seen: list[bool] = []
    ais.delay(1.0, stream=t)
    ais.virtual.submit(s, 1.0, fn=lambda: seen.append(t.query()))
    ais.delay(0.5, stream=s)
    clk.advance(2.0)
    assert s.query() and t.query()
    assert seen == [False]  # t's work ends at the same instant, after s's in stream order
    ran = [(r.name, r.stream, r.start, r.end) for r in ais.virtual.timeline()]
    assert ran == [
        ("compute", s.stream_id, 0.0, 1.0),
        ("delay", t.stream_id, 0.0, 1.0),
        ("delay", s.stream_id, 1.0, 1.5),
    ]


def test_a_completion_check_in_doubt_is_not_settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """``settled()`` reads the heap of running work without the lock, and another thread may
    empty it between its two reads: in that doubt the answer is "not settled" (the caller
    then takes the lock and brings the simulation to now), never "settled"."""
    from aiostream import _backends

    sim = _backends.get("virtual")._sim  # type: ignore[attr-defined]

    class EmptiedMeanwhile(list):  # type: ignore[type-arg]
        def __bool__(self) -> bool:
            return True  # still work when first asked...

        def __getitem__(self, index: Any) -> Any:
            raise IndexError(index)  # ...and none a moment later

    assert sim.settled()  # nothing running: settled
    monkeypatch.setattr(sim.sched, "running", EmptiedMeanwhile())
    assert sim.settled() is False
