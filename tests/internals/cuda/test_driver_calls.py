"""How many driver calls a wait costs, white-box: every call through cuda-python's bindings
counted (on any thread) while waits are submitted and awaited. A device's context is pushed
once per operation (an event's creation, record and mark share one push), the capture mode
is exchanged only around calls that a capture elsewhere prohibits, an await's first look
reads the mark's flag, and released events are destroyed with the device's next push."""

from __future__ import annotations

import collections
import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import aiostream as ais
from tests.helpers.cuda import DEV, held

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


@contextlib.contextmanager
def counted() -> Iterator[collections.Counter[str]]:
    """The driver calls made through the bindings while the block runs, by name."""
    from cuda.bindings import driver as cu

    calls: collections.Counter[str] = collections.Counter()

    def counting(name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            calls[name] += 1
            return fn(*args)

        return call

    with pytest.MonkeyPatch.context() as patch:
        for name in dir(cu):
            fn = getattr(cu, name)
            if name.startswith("cu") and callable(fn):
                patch.setattr(cu, name, counting(name, fn))
        yield calls


@pytest.mark.parametrize("streams", [1, 10])
async def test_a_wait_costs_at_most_ten_driver_calls(anyio_backend: object, streams: int) -> None:
    """100 waits of 2 ms kernels, records back to back on one or ten streams, awaited at once:
    the kernel, the event's creation, record and mark, its destruction and the context's
    pushes (once an operation) stay within 10 calls a wait, the submission included."""
    pool = [ais.Stream(DEV) for _ in range(streams)]
    for s in pool:  # the device, the module and the watcher, ready
        ais.delay(0.001, stream=s)
        await s.record_event().synchronize()
    with counted() as calls:
        events = []
        for s in pool:
            for _ in range(100 // streams):
                ais.delay(0.002, stream=s)
                events.append(s.record_event())
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for e in events:
                    tg.start_soon(e.synchronize)
        del e, events
        gc.collect()
        held()  # the events released: destroyed now
    assert calls["cuEventDestroy"] >= 100, calls
    assert sum(calls.values()) <= 10 * 100, calls
    assert calls["cuCtxPushCurrent"] <= 3 * 100, calls  # the kernel's, the record's, a few


async def test_an_awaits_first_look_reads_the_flag(anyio_backend: object) -> None:
    """Awaiting an event asks the driver nothing to learn its work is pending or complete;
    ``query()`` asks the driver (its errors are the caller's to see)."""
    s = ais.Stream(DEV)
    ais.delay(0.002, stream=s)
    e = s.record_event()
    with counted() as calls:
        await e.synchronize()
        await e.synchronize()  # complete work
    assert calls["cuEventQuery"] <= 1, calls  # the health check's, at most
    with counted() as calls:
        assert e.query()
    assert calls["cuEventQuery"] == 1, calls


def test_only_calls_a_capture_prohibits_exchange_the_capture_mode() -> None:
    """A launch, a record and its mark on a stream of aiostream's own are never potentially
    unsafe during another thread's capture: they leave the thread's capture mode alone; a
    query and anything on the legacy stream (it synchronizes implicitly) relax it around the
    call."""
    s = ais.Stream(DEV)
    e = ais.Event(DEV)
    e.record(s)
    with counted() as calls:
        ais.delay(0.0001, stream=s)
        e.record(s)
    assert calls["cuThreadExchangeStreamCaptureMode"] == 0, calls
    assert calls["cuCtxPushCurrent"] == 2, calls  # one per operation
    with counted() as calls:
        e.query()
        ais.delay(0.0001, stream=ais.default_stream(DEV))
    assert calls["cuThreadExchangeStreamCaptureMode"] == 4, calls


def test_released_events_are_destroyed_with_the_next_push() -> None:
    """An event the program releases is destroyed when the device's context is next pushed
    (any operation of the device, on any thread), or once 32 wait; ``held()`` settles them.
    (The last event recorded on a stream is kept as its last record until it records again.)"""
    s = ais.Stream(DEV)
    events = [s.record_event() for _ in range(5)]
    s.synchronize_blocking()
    gc.collect()
    held()  # what earlier tests released goes now
    with counted() as calls:
        del events
        gc.collect()
        assert calls["cuEventDestroy"] == 0  # not yet
        ais.delay(0.0001, stream=s)
        assert calls["cuEventDestroy"] == 4  # the last, kept as the stream's last record
        events = [s.record_event() for _ in range(40)]
        del events
        gc.collect()
        # the fifth once the stream records again; of the 40, 32 waited: destroyed at once
        assert calls["cuEventDestroy"] == 4 + 1 + 32
        held()
        assert calls["cuEventDestroy"] == 4 + 1 + 39  # the last kept as the stream's record
