"""The loop's waiter on CUDA, white-box: ``hybrid`` waits handed to the watcher at once
(the check budget, ``SPIN_MIN_S`` and ``SPIN_MAX_S``, set to 0) or left to the loop (set
wide), and the compaction of
cancelled polled waits (``_COMPACT_MIN``).

These tune or read ``aiostream._waiting``'s constants and lanes, so they live here; where each
strategy waits is tested in ``tests/cuda/test_strategies.py``.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

import aiostream as ais
from aiostream import _backends
from aiostream._waiting import waiters
from tests.helpers.cuda import DEV, host_function_launches
from tests.helpers.deadlines import until
from tests.helpers.gate import gate
from tests.helpers.stand_in import FAKE

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


def spin_budget(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every wait's check budget ``seconds``, whatever the recent waits took."""
    monkeypatch.setattr(waiters, "SPIN_MIN_S", seconds)
    monkeypatch.setattr(waiters, "SPIN_MAX_S", seconds)


# ------------------------------------------------------ hybrid's handoff


def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The host functions the shared backend's watcher of cuda:0 launches from now on."""
    watcher: Any = _backends.get("cuda")._devices.get(0).watcher  # type: ignore[attr-defined]
    return host_function_launches(watcher, monkeypatch)


async def test_short_hybrid_waits_add_no_host_function(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hybrid hands a wait to the watcher, with its host function, only after the loop's
    check budget: waits shorter than that add nothing to the stream. (The budget is
    widened here, so that a loaded machine's slow loop turns do not make the waits long.)"""
    spin_budget(monkeypatch, 0.5)
    s = ais.Stream(DEV)
    s.record_event()  # the device is open: its watcher is there to spy on
    launched = launches(monkeypatch)
    calls = FAKE.fake_cuda_host_calls() if FAKE is not None else 0
    for _ in range(20):
        ais.delay(50e-6, stream=s)
        await s.synchronize(strategy="hybrid")
    assert launched == []
    if FAKE is not None:
        assert FAKE.fake_cuda_host_calls() == calls


@pytest.mark.parametrize("strategy", ["hybrid", "callback"])
async def test_a_handed_out_streams_wait_ends_soon_after_its_host_function(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """The mark after the host function lands only once the driver's thread has returned from
    it: the watcher, posted, keeps looking for it for a while, rather than at its next health
    check, 50 ms later. (The stand-in's thread takes 8 ms to return here, a GPU's driver its
    own time; hybrid hands the wait over at once.)"""
    spin_budget(monkeypatch, 0.0)
    s = ais.Stream(DEV)
    s.__cuda_stream__()
    s.record_event()  # the device is open: its watcher is there to spy on
    launched = launches(monkeypatch)
    took = []
    waited = 0  # the awaits that found the work pending (a loaded machine may come late)
    if FAKE is not None:
        FAKE.fake_cuda_host_fn_return_delay(round(0.008e9))
    try:
        for _ in range(5):
            start = time.monotonic()  # before the work: 1 ms at least, however late we run
            ais.delay(0.001, stream=s)
            waited += not s.query()
            with anyio.fail_after(5):
                await s.synchronize(strategy=strategy)
            took.append(time.monotonic() - start)
            assert s.query()
    finally:
        if FAKE is not None:
            FAKE.fake_cuda_host_fn_return_delay(0)
    assert waited >= 3, "the machine is too busy for this test's 1 ms kernels"
    assert len(launched) == waited  # each wait was announced by its host function
    took.sort()
    # Not before the kernel's 1 ms; and mostly well before the health check's 50 ms. A wait
    # may end before the 8 ms return: once the host function has begun (its post seen), the
    # stream's own work is complete (Waits.idle), which a loaded machine's late look finds.
    assert 0.001 <= took[0] and took[2] < 0.035, took


@pytest.mark.parametrize("strategy", ["hybrid", "callback"])
async def test_a_record_after_an_announced_wait_is_complete(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """Once ``await e.synchronize()`` returns, the host function that announced it may still be
    running on the driver's thread, and a record after it completes on the device only once
    that returns (the stand-in's thread takes 8 ms to return here). An event recorded then
    captured no work of the user's that had not completed: it, its stream, and an earlier
    event recorded again, are complete at once, and ``elapsed_time`` reads them (waiting the
    host function out), as where no host function was added."""
    spin_budget(monkeypatch, 0.0)
    s = ais.Stream(DEV)
    start = ais.Event(DEV, enable_timing=True)
    if FAKE is not None:
        FAKE.fake_cuda_host_fn_return_delay(round(0.008e9))
    try:
        for _ in range(3):
            start.record(s)
            ais.delay(0.001, stream=s)
            e = s.record_event()
            with anyio.fail_after(5):
                await e.synchronize(strategy=strategy)
            end = s.record_event(ais.Event(DEV, enable_timing=True))
            e.record(s)
            assert "id=" in repr(e)  # its handle named in a message is not handed out
            assert end.query() and e.query() and s.query()
            assert start.elapsed_time(end) >= 0.0
            release = gate(s)  # the user's work after them: not complete
            ais.delay(0.001, stream=s)
            later = s.record_event()
            assert not (later.query() or s.query())
            release()
            await s.synchronize(strategy=strategy)
    finally:
        if FAKE is not None:
            FAKE.fake_cuda_host_fn_return_delay(0)


@pytest.mark.parametrize("strategy", ["hybrid", "callback"])
async def test_a_record_after_others_work_is_not_complete(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """Others may record another library's event unseen, and, once a stream's handle is
    handed out, submit to it unseen: an event recorded after an announced wait is then
    complete only once the driver says so."""
    spin_budget(monkeypatch, 0.0)
    s = ais.Stream(DEV)
    owner = ais.Event(DEV)
    ais.delay(0.001, stream=s)
    owner.record(s)
    foreign = ais.as_event(owner.event_id, DEV)
    foreign.record(s)
    with anyio.fail_after(5):
        await foreign.synchronize(strategy=strategy)
    elsewhere = ais.Stream(DEV)
    releases = [gate(elsewhere)]  # the work after it waits until the test releases it
    ais.delay(0.001, stream=elsewhere)
    owner.record(elsewhere)  # the same CUDA event, recorded where the wrapper does not see
    assert not foreign.query()
    others = ais.ExternalStream(s.__cuda_stream__()[1], DEV)
    releases.append(gate(others))
    ais.delay(0.001, stream=others)  # another library's work, unseen by s
    after = s.record_event()
    assert not after.query() and not s.query()
    for release in releases:
        release()
    with anyio.fail_after(5):
        await after.synchronize()
        await foreign.synchronize()  # its latest record is owner's, on elsewhere
    assert foreign.query() and owner.query()


# ------------------------------------------------------- cancelled waits


async def test_cancelled_polled_waits_are_dropped_once_they_outnumber_the_live_ones(
    anyio_backend: object,
) -> None:
    """Polled waits cancelled behind a long one are not kept for the long one's lifetime: once
    there are ``_COMPACT_MIN`` of them, and more than the waits still pending, the waiter
    drops them all at once (a drop per cancel would cost O(n) each)."""
    least = waiters._COMPACT_MIN
    s = ais.Stream(DEV)
    release = gate(s)  # the work after it waits until the test releases it
    ais.delay(0.001, stream=s)
    head = s.record_event()  # the long wait's, first in its stream's lane
    events = [s.record_event() for _ in range(least)]
    scopes = [anyio.CancelScope() for _ in events]
    later, later_scope = s.record_event(), anyio.CancelScope()

    async def wait(event: ais.Event, scope: anyio.CancelScope) -> None:
        with scope:
            await event.synchronize(strategy="poll")

    async def pending(n: int) -> None:
        await until(lambda: len(ais.pending_waits()) == n, f"{n} wait(s) pending")

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait, head, anyio.CancelScope())
            await pending(1)
            waiter = waiters.waiter_for(_backends.get("cuda"), 0)

            def polled() -> int:
                return sum(len(lane) for lane in waiter._lanes.values())  # type: ignore[attr-defined]

            for event, scope in zip(events, scopes, strict=True):
                tg.start_soon(wait, event, scope)
            await pending(1 + least)
            assert polled() == 1 + least
            for scope in scopes[:-1]:
                scope.cancel()
            await pending(2)
            assert polled() == 1 + least  # least - 1 cancelled: kept a while
            scopes[-1].cancel()
            await pending(1)
            assert polled() == 1  # least cancelled, more than the one pending: all dropped
            tg.start_soon(wait, later, later_scope)  # and the count starts again
            await pending(2)
            later_scope.cancel()
            await pending(1)
            assert polled() == 2
            release()  # the long wait ends
    finally:
        release()
    assert s.query()
