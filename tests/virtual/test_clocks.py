"""Contracts that peers' suites, fuzzing and abuse hold aiostream to, each a reproduction.

- A blocking sync in a thread returns once the work is done (PyTorch's
  ``test_stream_event_nogil``, CuPy's ``test_stream_thread``), whatever the clock.
- A host function runs when the device reaches it (CuPy's ``launch_host_func``), and one that
  raises fails its device, as a failed operation does: nothing hangs.
- Stalls nest: an engine runs again when the last stall on it is released.
- A clock's readings are checked: a clock that reads inf or nan is refused with a message.
- The loop-thread check survives a half-imported trio.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable, Iterator

import anyio
import pytest

import aiostream as ais
from aiostream.virtual import VirtualClock

pytestmark = pytest.mark.anyio


def _in_thread(fn: Callable[[], object], timeout: float = 5.0) -> BaseException | None:
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


# ---------------------------------------------------------------------- blocking waits


def test_a_blocking_sync_returns_when_the_clock_completes_its_work_while_it_looks() -> None:
    """A clock that jumps past the work while the waiter asks when to wake: the work is
    done, so the wait returns (it used to wait for a wake-up nobody sends)."""
    for early in range(2, 16):  # the jump comes at each reading in turn
        readings = iter([0.0] * early)
        ais.virtual.reset(clock=lambda readings=readings: next(readings, 1.0))
        s = ais.Stream()
        ais.virtual.submit(s, 0.001)  # the waiter sleeps 1 ms of real time between readings
        assert _in_thread(s.synchronize_blocking, timeout=2.0) is None, early
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


# ---------------------------------------------------------------------- host functions


def test_a_host_function_runs_when_the_clock_reaches_it() -> None:
    clock = VirtualClock()
    ais.virtual.reset(clock=clock)
    landed: list[float] = []
    s = ais.Stream()
    ais.virtual.submit(s, 0.5, engine="h2d", fn=lambda: landed.append(clock.now()))
    clock.advance(0.4)
    assert landed == []
    clock.advance(1.1)  # no other call into aiostream: the device reached it all the same
    assert landed == [1.5]


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


# ---------------------------------------------------------------------- stalls


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


# ---------------------------------------------------------------------- clocks


@pytest.mark.parametrize("reading", [float("inf"), float("-inf"), float("nan"), 1e300])
def test_a_clock_that_reads_no_time_is_refused(reading: float) -> None:
    with pytest.raises(ValueError, match=r"clock returned .* seconds"):
        ais.virtual.reset(clock=lambda: reading)


async def test_a_clock_may_read_below_zero() -> None:
    """A callable clock reads seconds, float or int, from any origin, below zero too (an
    offset clock): only the time between readings matters."""
    readings = iter([-10, -10, -9.5, -9])
    ais.virtual.reset(clock=lambda: next(readings, -9))
    s = ais.Stream()
    ais.virtual.submit(s, 1.0)
    assert not s.query()  # 0.5 s in
    assert s.query()  # 1 s in: done


def test_a_clock_that_goes_bad_later_is_refused_at_that_reading() -> None:
    readings: Iterator[object] = iter([0.0, 0.0, 0.0])
    ais.virtual.reset(clock=lambda: next(readings, "soon"))
    s = ais.Stream()
    ais.virtual.submit(s, 1.0)
    with pytest.raises(TypeError, match="clock returned 'soon'"):
        for _ in range(5):
            s.query()


def test_host_memory_the_machine_cannot_give_is_a_device_error() -> None:
    with pytest.raises(ais.DeviceError, match="cannot allocate 1152921504606846976 bytes"):
        ais.HostBuffer(1 << 60)
    assert ais.HostBuffer(16).nbytes == 16  # the backend goes on


# ---------------------------------------------------------------------- loop-thread check


def test_a_half_imported_trio_does_not_break_blocking_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What another thread importing trio for the first time looks like from this one."""
    monkeypatch.setitem(sys.modules, "trio", types.ModuleType("trio"))
    s = ais.Stream()
    ais.delay(0.001, stream=s)
    assert _in_thread(s.synchronize_blocking) is None
    s.synchronize_blocking()  # in the main thread too, which runs no loop
