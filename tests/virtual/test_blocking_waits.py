"""Blocking waits (``synchronize_blocking()``) on the virtual device, the way peers' suites and
abuse use them, each a reproduction: from threads, they return once the work is done whatever
the clock and whoever completes it (PyTorch's ``test_stream_event_nogil``, CuPy's
``test_stream_thread``); in a thread that runs an event loop they are refused, leaving the
loop's own waits alone, and that check survives a half-imported trio or asyncio.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable

import anyio
import pytest

import aiostream as ais
from aiostream.virtual import VirtualClock

pytestmark = pytest.mark.anyio


def _in_thread(fn: Callable[[], object], timeout: float = 30.0) -> BaseException | None:
    """Run ``fn`` in a thread; fail if it has not returned after ``timeout`` seconds."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} did not return within {timeout} s"
    return raised[0] if raised else None


# ---------------------------------------------------------------------- from threads


def test_a_blocking_sync_returns_when_the_clock_completes_its_work_while_it_looks() -> None:
    """A clock that jumps past the work while the waiter asks when to wake: the work is
    done, so the wait returns (it used to wait for a wake-up nobody sends)."""
    for early in range(2, 16):  # the jump comes at each reading in turn
        readings = iter([0.0] * early)
        ais.virtual.reset(clock=lambda readings=readings: next(readings, 1.0))
        s = ais.Stream()
        ais.virtual.submit(s, 0.001)  # the waiter sleeps 1 ms of real time between readings
        assert _in_thread(s.synchronize_blocking) is None, early  # a lost wake-up: never
        assert s.query()
        assert ais.virtual.stats().waits == 0


def test_blocking_syncs_in_threads_return_on_the_real_clock() -> None:
    for _ in range(20):
        s = ais.Stream()
        for _ in range(100):
            ais.delay(10e-6, stream=s)
        assert _in_thread(s.synchronize_blocking) is None
        assert s.query()
    assert ais.virtual.stats().waits == 0


def test_a_blocking_sync_wakes_when_another_thread_completes_the_work() -> None:
    clock = VirtualClock()
    ais.virtual.reset(clock=clock)
    s = ais.Stream()
    ais.virtual.submit(s, 1.0)
    done = threading.Event()

    def wait() -> None:
        s.synchronize_blocking()
        done.set()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    assert not done.wait(0.05)
    clock.advance(1.0)
    assert done.wait(5.0)
    thread.join(5.0)


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


# ---------------------------------------------------------------------- in a loop's thread


def test_blocking_waits_are_refused_in_a_loop_s_thread_only(clock: VirtualClock) -> None:
    """Where an event loop runs in the thread (asyncio, trio), a blocking wait on pending work
    is refused; in a thread that runs none (here the main thread), it waits for the work."""
    s = ais.Stream()
    ais.delay(1.0, stream=s)

    async def inside() -> bool:
        with pytest.raises(ais.AiostreamError, match="would block the event loop"):
            s.synchronize_blocking()
        return True

    assert anyio.run(inside) is True
    assert anyio.run(inside, backend="trio") is True
    assert not s.query()
    completes = threading.Timer(0.01, clock.advance, args=(1.0,))  # the wait's deadline
    completes.start()
    try:
        s.synchronize_blocking()  # no loop runs in this thread: it waits, not refused
    finally:
        completes.join()
    assert s.query()


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


def test_a_half_imported_trio_does_not_break_blocking_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What another thread importing trio for the first time looks like from this one."""
    monkeypatch.setitem(sys.modules, "trio", types.ModuleType("trio"))
    s = ais.Stream()
    ais.delay(0.001, stream=s)
    assert _in_thread(s.synchronize_blocking) is None
    s.synchronize_blocking()  # in the main thread too, which runs no loop


def test_a_half_imported_asyncio_does_not_break_blocking_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What another thread importing asyncio for the first time looks like from this one."""
    monkeypatch.setitem(sys.modules, "asyncio", types.ModuleType("asyncio"))
    s = ais.Stream()
    ais.delay(0.001, stream=s)
    assert _in_thread(s.synchronize_blocking) is None
    s.synchronize_blocking()  # in the main thread too, which runs no loop
