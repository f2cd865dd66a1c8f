"""Events: recording rules, timing, IPC handles, and bad input."""

from __future__ import annotations

import gc
import os
from typing import Any

import anyio
import pytest

import aiostream as ais
from aiostream.testing import VirtualTime
from tests.helpers.process import in_spawned_process
from tests.helpers.protocol import backend_of, handle_of

pytestmark = pytest.mark.anyio


async def test_elapsed_time_is_exact_on_a_virtual_clock(clock: ais.virtual.VirtualClock) -> None:
    s = ais.Stream()
    e = ais.Event(enable_timing=True)
    start = s.record_event(ais.Event(enable_timing=True))
    ais.delay(0.020, stream=s)
    e.record(s)
    clock.advance(0.020)
    await e.synchronize()
    assert start.elapsed_time(e) == 20.0
    assert e.elapsed_time(start) == -20.0


def test_elapsed_time_errors_say_what_to_do(clock: ais.virtual.VirtualClock) -> None:
    s = ais.Stream()
    timed, untimed = ais.Event(enable_timing=True), ais.Event()
    timed.record(s)
    untimed.record(s)
    for start, end, which in ((timed, untimed, "end"), (untimed, timed, "start")):
        with pytest.raises(ValueError) as caught:
            start.elapsed_time(end)
        assert str(caught.value) == (
            f"elapsed_time() needs timing on both events, but the {which} event was created "
            "without it; create it with Event(enable_timing=True)"
        )
    never = ais.Event(enable_timing=True)
    for start, end, which in ((timed, never, "end"), (never, timed, "start")):
        with pytest.raises(ValueError) as caught:
            start.elapsed_time(end)
        assert str(caught.value) == (
            f"elapsed_time() needs two recorded events, but the {which} event was never "
            "recorded; call record() on it first"
        )
    ais.delay(1.0, stream=s)
    later = s.record_event(ais.Event(enable_timing=True))
    with pytest.raises(ais.NotReadyError, match="complete"):
        timed.elapsed_time(later)
    idle = ais.Stream().record_event(ais.Event(enable_timing=True))  # complete at once
    assert idle.query()
    with pytest.raises(ais.NotReadyError, match="complete"):
        later.elapsed_time(idle)  # the start is the one still pending
    clock.advance(1.0)
    assert later.elapsed_time(idle) == -1000.0
    assert timed.elapsed_time(later) == 1000.0
    with pytest.raises(TypeError, match="end_event must be an aiostream.Event"):
        timed.elapsed_time(1.0)  # type: ignore[arg-type]


def test_elapsed_time_needs_one_device() -> None:
    ais.virtual.reset(devices=2)
    a = ais.Event("virtual:0", enable_timing=True)
    b = ais.Event("virtual:1", enable_timing=True)
    a.record(ais.Stream("virtual:0"))
    b.record(ais.Stream("virtual:1"))
    with pytest.raises(ValueError, match="virtual:0 and virtual:1"):
        a.elapsed_time(b)


def test_recording_on_another_devices_stream_names_both() -> None:
    ais.virtual.reset(devices=2)
    e = ais.Event("virtual:0")
    with pytest.raises(ValueError) as caught:
        e.record(ais.Stream("virtual:1"))
    assert str(caught.value) == (
        "cannot record an event of virtual:0 on a stream of virtual:1; create the event on "
        "the stream's device"
    )
    with pytest.raises(TypeError, match="stream must be an aiostream.Stream or None"):
        e.record("virtual:0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stream must be an aiostream.Stream or None"):
        e.wait(0)  # type: ignore[arg-type]


def test_record_and_wait_default_to_the_current_stream() -> None:
    clock = ais.virtual.VirtualClock()
    ais.virtual.reset(clock=clock, compute_slots=2)  # t's work never waits for a slot
    s, t = ais.Stream(), ais.Stream()
    ais.delay(1.0, stream=s)
    e = ais.Event()
    with ais.use_stream(s):
        e.record()
    with ais.use_stream(t):
        e.wait()
        ais.delay(0.0)
    clock.advance(0.5)
    assert not t.query()
    clock.advance(0.5)
    assert t.query()


def test_wait_defaults_to_the_current_stream_of_the_events_own_device() -> None:
    clk = ais.virtual.VirtualClock()
    ais.virtual.reset(devices=2, clock=clk, compute_slots=2)  # t's work never waits for a slot
    s, t = ais.Stream("virtual:1"), ais.Stream("virtual:1")
    ais.delay(1.0, stream=s)
    e = s.record_event()
    with ais.use_stream(t):
        e.wait()  # t waits, not virtual:0's current stream
    ais.delay(0.0, stream=t)
    clk.advance(0.5)
    assert not t.query()
    clk.advance(0.5)
    assert t.query()


@pytest.mark.parametrize("flag", ["enable_timing", "blocking", "interprocess"])
def test_flags_must_be_bools(flag: str) -> None:
    with pytest.raises(TypeError, match=f"{flag} must be True or False"):
        ais.Event(**{flag: 1})


def test_interprocess_events_cannot_time() -> None:
    with pytest.raises(ValueError) as caught:
        ais.Event(enable_timing=True, interprocess=True)
    assert str(caught.value) == (
        "an interprocess event cannot have timing: pass enable_timing=False with "
        "interprocess=True (CUDA refuses the combination)"
    )


async def test_a_wait_names_the_event_and_the_stream_it_was_recorded_on(
    virtual_time: VirtualTime,
) -> None:
    """The profiler (and the pending-wait listing) name an awaited event by its id and the
    stream of its last record; an event never recorded has neither."""
    never, s = ais.Event(), ais.Stream()
    recorded = s.record_event()
    with ais.profile() as prof:
        await never.synchronize()
        await recorded.synchronize()
    assert [sp.name for sp in prof.spans if sp.kind == "await"] == [
        "await event 0",
        f"await event {recorded.event_id} on stream {s.stream_id}",
    ]


def test_repr_and_properties() -> None:
    e = ais.Event(enable_timing=True)
    assert e.device == ais.Device("virtual", 0)
    assert e.enable_timing is True
    assert repr(e) == "<aiostream.Event device=virtual:0 id=0 timing=True interprocess=False>"


async def test_ipc_round_trip_within_one_process(clock: ais.virtual.VirtualClock) -> None:
    s = ais.Stream()
    e = ais.Event(interprocess=True)
    ais.delay(1.0, stream=s)
    e.record(s)
    handle = e.ipc_handle()
    assert isinstance(handle, bytes) and len(handle) == 64
    opened = ais.Event.from_ipc_handle("virtual:0", handle)
    assert opened.ipc_handle() == handle  # interprocess too, as it was made
    assert (
        repr(opened)
        == f"<aiostream.Event device=virtual:0 id={e.event_id} timing=False interprocess=True>"
    )
    assert opened.device == e.device
    assert opened.event_id == e.event_id
    assert not opened.query()
    clock.advance(1.0)
    assert opened.query()
    await opened.synchronize()
    ais.delay(1.0, stream=s)
    opened.record(s)  # recording either handle moves the one event
    assert not e.query()


def test_ipc_handle_before_any_record_opens_a_complete_event() -> None:
    e = ais.Event(interprocess=True)
    opened = ais.Event.from_ipc_handle(None, e.ipc_handle())
    assert opened.query()


def test_an_event_made_on_the_device_but_never_recorded_reports_the_device_s_state() -> None:
    """Made on the device (here by its IPC handle) before any record: complete while the
    device is well, and, as every query on a failed device does, raising its error after."""
    e = ais.Event(interprocess=True)
    opened = ais.Event.from_ipc_handle("virtual:0", e.ipc_handle())
    assert e.query() is True and opened.query() is True
    ais.virtual.submit(ais.Stream(), 0.0, error="boom")
    for event in (e, opened):
        with pytest.raises(ais.DeviceError, match="boom"):
            event.query()
    assert ais.Event().query() is True  # one never made on the device asks nothing of it
    ais.virtual.reset()
    with pytest.raises(ais.StaleHandleError) as stale:
        e.query()
    assert str(stale.value) == (
        "this object belongs to a virtual backend that aiostream.virtual.reset() replaced; "
        "create new streams and events after the reset"
    )


def test_ipc_bad_input() -> None:
    with pytest.raises(ValueError) as caught:
        ais.Event().ipc_handle()
    assert str(caught.value) == (
        "ipc_handle() needs an interprocess event; create it with Event(interprocess=True)"
    )
    with pytest.raises(TypeError, match="handle must be bytes"):
        ais.Event.from_ipc_handle("virtual:0", "x" * 64)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="64 bytes, got 3"):
        ais.Event.from_ipc_handle("virtual:0", b"abc")
    with pytest.raises(ValueError, match="not an IPC handle of a virtual event"):
        ais.Event.from_ipc_handle("virtual:0", bytes(64))
    gone = ais.Event(interprocess=True)
    handle = gone.ipc_handle()
    # 64 bytes, as the driver's: a 16-byte magic, the backend's token, device, event and
    # process, then zeros
    assert len(handle) == 64 and handle[:14] == b"aiostream:virt" and handle[40:] == bytes(24)
    del gone
    gc.collect()
    with pytest.raises(ValueError) as caught:
        ais.Event.from_ipc_handle("virtual:0", handle)
    assert str(caught.value) == "the event behind this IPC handle no longer exists"
    handle = ais.Event(interprocess=True).ipc_handle()
    ais.virtual.reset()
    with pytest.raises(ais.StaleHandleError) as stale:
        ais.Event.from_ipc_handle("virtual:0", handle)
    assert str(stale.value) == (
        "the IPC handle comes from a virtual backend that aiostream.virtual.reset() replaced; "
        "its events are gone with it"
    )


@pytest.mark.parametrize("what", ["event", "buffer"])
def test_a_virtual_handle_of_another_process_is_refused_word_for_word(what: str) -> None:
    """The whole message for a virtual handle made by another process (its process id, bytes
    36-40 of the backend's handle, is not this one's); the other process itself is tested in
    test_interop_peers, where the message is checked in part."""
    if what == "event":
        handle = bytearray(ais.Event(interprocess=True).ipc_handle())
        kept = None
        at = 36
    else:
        kept = ais.DeviceBuffer(8, interprocess=True)
        handle = bytearray(kept.ipc_handle())
        # the backend's part of a buffer's handle comes after the buffer's own header
        memory = backend_of(kept).memory_ipc_handle(handle_of(kept))
        at = bytes(handle).index(memory) + 36
    other = os.getpid() + 1
    handle[at : at + 4] = other.to_bytes(4, "little")
    with pytest.raises(ais.StaleHandleError) as stale:
        if what == "event":
            ais.Event.from_ipc_handle("virtual:0", bytes(handle))
        else:
            ais.DeviceBuffer.from_ipc_handle("virtual:0", bytes(handle))
    kind = "event" if what == "event" else "device buffer"
    assert str(stale.value) == (
        f"the IPC handle comes from a virtual device of process {other}, and this is process "
        f"{os.getpid()}: a virtual device is one process's simulation, so its {kind}s are "
        f"shared within one process only. Share them across processes on CUDA devices; on "
        f"virtual devices, give each process its own {kind}s"
    )
    del kept


def test_an_event_opened_by_its_handle_is_live_until_dropped() -> None:
    e = ais.Event(interprocess=True)
    handle = e.ipc_handle()
    assert ais.virtual.stats().events == 1
    opened = ais.Event.from_ipc_handle("virtual:0", handle)
    assert ais.virtual.stats().events == 2  # each handle holds the event
    del e
    gc.collect()
    assert ais.virtual.stats().events == 1
    assert opened.query()
    del opened
    gc.collect()
    assert ais.virtual.stats().events == 0


def _open_in_child(handle: bytes, out: Any) -> None:
    try:
        ais.Event.from_ipc_handle("virtual:0", handle)
    except ais.StaleHandleError as exc:
        out.put(("StaleHandleError", str(exc)))
    except BaseException as exc:  # reported to the parent, which fails the test with it
        out.put((type(exc).__name__, str(exc)))
    else:
        out.put(("opened", ""))


@pytest.mark.slow
def test_ipc_handle_in_another_process_is_refused_with_the_reason() -> None:
    """A virtual device is one process's simulation: another process gets a clear error at
    once, never an event that would hang its waits."""
    handle = ais.Event(interprocess=True).ipc_handle()
    pid, (kind, message) = in_spawned_process(_open_in_child, handle)
    assert kind == "StaleHandleError", message
    assert f"process {os.getpid()}" in message and f"process {pid}" in message
    assert "within one process" in message and "CUDA" in message


def test_ipc_handle_of_another_device() -> None:
    ais.virtual.reset(devices=2)
    handle = ais.Event("virtual:0", interprocess=True).ipc_handle()
    with pytest.raises(ValueError, match="virtual:0, not virtual:1"):
        ais.Event.from_ipc_handle("virtual:1", handle)


async def test_await_before_rerecord_waits_for_its_capture(
    clock: ais.virtual.VirtualClock,
) -> None:
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    e = s.record_event()
    resumed_at: list[float] = []

    async def waiter() -> None:
        await e.synchronize()
        resumed_at.append(clock.now())

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        ais.delay(2.0, stream=s)
        e.record(s)  # now at t=3; the started await still waits for t=1
        clock.advance(1.0)
    assert resumed_at == [1.0]
    assert not e.query()
