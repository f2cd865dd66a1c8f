"""``aiostream.virtual.reset()``: its options, checked and kept as one frozen record; what a
reset does to the objects and waits made before it (they raise ``StaleHandleError``, nothing
hangs); and ``stats()``, which counts what is alive on the backend in use.
"""

from __future__ import annotations

import gc
from typing import Any

import anyio
import pytest

import aiostream as ais
from aiostream.virtual import VirtualClock
from tests.helpers.protocol import backend

pytestmark = pytest.mark.anyio


# ---------------------------------------------------------------------- options


def test_numpy_numbers_are_taken_as_python_ones() -> None:
    """Counts and rates given as numpy scalars (a config read with numpy) work as ints and
    floats do, and are kept as Python's own."""
    import numpy as np

    ais.virtual.reset(
        devices=np.int64(2),
        compute_slots=np.int32(3),
        memory=np.uint64(1 << 20),
        bandwidth=np.float32(1e10),
    )
    assert ais.device_count("virtual") == 2
    options = backend("virtual").options  # type: ignore[attr-defined]
    counts = (options.devices, options.compute_slots, options.memory)
    assert counts == (2, 3, 1 << 20) and {type(c) for c in counts} == {int}
    assert options.bandwidth == 1e10 and type(options.bandwidth) is float
    ais.virtual.reset()


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


def test_options_are_one_frozen_record() -> None:
    options = ais.virtual.VirtualOptions(devices=2, compute_slots=3)
    assert options.slots() == {"compute": 3, "h2d": 1, "d2h": 1}
    with pytest.raises(AttributeError):
        options.devices = 3  # type: ignore[misc]
    with pytest.raises(TypeError) as info:
        ais.virtual.VirtualOptions.from_kwargs(zz=1, slots=2)
    assert str(info.value) == (
        "unknown virtual backend option(s) 'slots', 'zz'; accepted: devices, compute_slots, "
        "h2d_slots, d2h_slots, bandwidth, latency, d2d_bandwidth, memory, profile"
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


# ---------------------------------------------------------------------- what came before


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


# ---------------------------------------------------------------------- what is alive


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
